"""`tensortune make-certs`: the TLS certificates of a cluster deployment (flows/cluster_security.py)."""
from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Optional

import typer
from rich.console import Console

from tensortune.flows.cli_app import app
from tensortune.flows.cli_input import USAGE, fail, folder_to_write
from tensortune.flows.cluster_security import TLS_DIR_ENV, make_certificates

# a DNS name as certificates carry them: labels of letters, digits, hyphens and underscores (compose
# service names), a leading `*.` wildcard, a trailing dot
DNS_NAME = re.compile(r"(\*\.)?[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                      r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")


def host_problem(name: str) -> str | None:
    """Why `name` cannot be a host of the cluster's certificate (None: it can): an IP address (which
    make_certificates stores as one) or a DNS name; a port is no part of either."""
    try:
        ipaddress.ip_address(name)
        return None
    except ValueError:
        pass
    if ":" in name:
        return "is not a host name or IP address (a port does not belong in --host)"
    if not DNS_NAME.fullmatch(name):
        return "is not a host name or IP address"
    return None


@app.command("make-certs")
def make_certs(folder: Annotated[str, typer.Argument(help="Folder to write the CA and the cluster's certificate to.")],
               host: Annotated[Optional[list[str]], typer.Option(
                   "--host", help="A name or IP the scheduler is reached at (repeatable); localhost is added.")]
               = None,
               force: Annotated[bool, typer.Option("--force", help="Replace certificates already there.")] = False,
               ) -> None:
    """Make a CA and a certificate for a TLS Dask cluster: only processes holding them can connect."""
    from pathlib import Path
    target = Path(folder)
    if target.exists() and not target.is_dir():
        fail(f"{folder} is a file, not a folder", USAGE)
    folder_to_write("the certificate folder", folder)
    for name in host or []:
        problem = host_problem(name)
        if problem:
            fail(f"--host {name!r} {problem}", USAGE)
    if (target / "ca.pem").exists() and not force:
        fail(f"{folder} already holds a cluster CA; pass --force to replace it (every node then needs the new files)",
             USAGE)
    certs = make_certificates(target, host or [])
    console = Console()
    console.print(f"wrote {certs.ca_file}, {certs.cert}, {certs.key} (and the CA's key {certs.ca_key}: keep it "
                  "off the nodes)", soft_wrap=True)
    console.print(f"scheduler: dask scheduler --protocol tls --port 8786 {certs.command_flags()}", soft_wrap=True)
    console.print(f"workers:   dask worker tls://SCHEDULER:8786 {certs.command_flags()} --resources measure-cpu=1",
                  soft_wrap=True)
    console.print(f"flow:      export {TLS_DIR_ENV}={certs.folder.resolve()} TENSORTUNE_CLUSTER=tls://SCHEDULER:8786",
                  soft_wrap=True)
