"""`tensortune make-certs`: the TLS certificates of a cluster deployment (flows/cluster_security.py)."""
from __future__ import annotations

import re
from typing import Annotated, Optional

import typer
from rich.console import Console

from tensortune.flows.cli_app import app
from tensortune.flows.cli_input import USAGE, fail, folder_to_write
from tensortune.flows.cluster_security import TLS_DIR_ENV, make_certificates

# a DNS name (labels of letters, digits and hyphens), an IPv4 address or an IPv6 one: what a certificate's
# subject alternative names hold
HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*|[0-9A-Fa-f:.]+:[0-9A-Fa-f:.]*")


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
        if not HOST_NAME.fullmatch(name):
            fail(f"--host {name!r} is not a host name or IP address", USAGE)
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
