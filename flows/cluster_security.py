"""TLS for the Dask cluster: who may submit work to the workers.

A Dask scheduler runs whatever its clients send on every worker, so a reachable scheduler without TLS
hands the measure nodes to anyone on the network. With TLS (`tls://` addresses) every connection, client,
worker or scheduler, must present a certificate signed by the cluster's own CA, and one that does not is
refused during the handshake. `make_certificates` writes that CA and one certificate the cluster's
processes share (`tensortune make-certs DIR --host ...`); the scheduler and workers take the files on
the command line (`dask scheduler --tls-ca-file ...`), the flow through TENSORTUNE_TLS_DIR.

The CA's private key is written beside the certificates so more hosts can be added later; keep it off the
nodes (deploy/README.md). Keys are created 0600.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from distributed.security import Security

TLS_DIR_ENV = "TENSORTUNE_TLS_DIR"     # the folder make_certificates wrote; the flow's client uses it
VALID_DAYS = 825                        # the longest lifetime common TLS clients accept for a leaf


@dataclass(frozen=True)
class ClusterCertificates:
    """The files of one cluster's TLS: its CA, and the certificate and key its processes present."""
    folder: Path

    @property
    def ca_file(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca-key.pem"

    @property
    def cert(self) -> Path:
        return self.folder / "cluster.pem"

    @property
    def key(self) -> Path:
        return self.folder / "cluster-key.pem"

    def security(self) -> Security:
        """Dask's Security for a client, worker or scheduler of this cluster (encryption required)."""
        missing = [str(p) for p in (self.ca_file, self.cert, self.key) if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"TLS files missing: {', '.join(missing)} (make them with "
                                    f"`tensortune make-certs {self.folder}`)")
        files = {"tls_ca_file": str(self.ca_file), "tls_client_cert": str(self.cert),
                 "tls_client_key": str(self.key), "tls_scheduler_cert": str(self.cert),
                 "tls_scheduler_key": str(self.key), "tls_worker_cert": str(self.cert),
                 "tls_worker_key": str(self.key)}
        return Security(require_encryption=True, **files)

    def command_flags(self) -> str:
        """The flags `dask scheduler` and `dask worker` take to use these files."""
        return f"--tls-ca-file {self.ca_file} --tls-cert {self.cert} --tls-key {self.key}"


def make_certificates(folder: str | os.PathLike, hosts: list[str]) -> ClusterCertificates:
    """A new CA and one certificate for the cluster's processes, valid for `hosts` (names or IPs; the
    scheduler's address must be among them for clients that check host names) plus localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    certs = ClusterCertificates(Path(folder))
    certs.folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tensortune cluster CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False),
                         critical=True)
          .sign(ca_key, hashes.SHA256()))
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*hosts, "localhost", "127.0.0.1"]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tensortune cluster")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))

    def pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    _write(certs.ca_key, pem_key(ca_key), private=True)
    _write(certs.key, pem_key(key), private=True)
    _write(certs.ca_file, ca.public_bytes(serialization.Encoding.PEM))
    _write(certs.cert, cert.public_bytes(serialization.Encoding.PEM))
    return certs


def _write(path: Path, data: bytes, private: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def client_security(address: str) -> Security | None:
    """The Security a flow's client needs for `address`: the cluster's certificates from
    $TENSORTUNE_TLS_DIR for a tls:// address (an error without them), None for tcp://."""
    if not address.startswith("tls://"):
        return None
    folder = os.environ.get(TLS_DIR_ENV)
    if not folder:
        raise FileNotFoundError(f"{address} is a TLS cluster: set {TLS_DIR_ENV} to the folder of its "
                                "certificates (`tensortune make-certs`)")
    return ClusterCertificates(Path(folder)).security()
