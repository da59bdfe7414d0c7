"""Command-line input, checked before anything starts: one clear line on stderr and a non-zero exit.

Every command checks what it was given (counts, names, paths, addresses) before it starts a Prefect
server, a cluster, a flow run or a measurement, so a typo costs nothing, prints no traceback, and
leaves no half-started run behind. Exit code 2 is a usage error (typer's own code for a bad option);
1 is a failure of the work itself.
"""
from __future__ import annotations

import inspect
import os
import socket
from typing import NoReturn
from urllib.parse import urlsplit

import typer
from rich.console import Console
from rich.markup import escape

USAGE = 2
FAILED = 1

# a run of a million measurements takes weeks on one node; more is a typo (an extra zero or two)
MAX_TRIALS = 1_000_000
CLUSTER_CONNECT_SECONDS = 3.0
MODELS = ("xgb", "xgb-rank", "random")


def fail(message: str, code: int = FAILED) -> NoReturn:
    """Print `error: message` on stderr and exit with `code` (the message as text: one that quotes a
    list, `[workload_key, target]`, must not lose it to rich's markup)."""
    Console(stderr=True).print(f"[red]error:[/red] {escape(message)}", markup=True, highlight=False,
                               soft_wrap=True)
    raise typer.Exit(code=code)


def check_count(option: str, value: int, high: int = MAX_TRIALS) -> int:
    """A count that must lie in 1..high (trials, measurements per round)."""
    if not 1 <= value <= high:
        fail(f"{option} must be between 1 and {high:,}, got {value:,}", USAGE)
    return value


def check_model(name: str) -> str:
    if name not in MODELS:
        fail(f"unknown cost model {name!r}; use {' or '.join(MODELS)}", USAGE)
    return name


def _is_url(path: str) -> bool:
    return "://" in path


def records_to_read(path: str) -> str:
    """A record store a command only reads: it must exist (a folder, or a URL the store opens later)."""
    if _is_url(path):
        return path
    if not os.path.exists(path):
        fail(f"no record store at {path} (the folder does not exist; tune first, or pass --records)", USAGE)
    if not os.path.isdir(path):
        fail(f"{path} is a file, not a record store folder", USAGE)
    return path


def records_to_write(path: str) -> str:
    """A record store a command writes: created when missing, but never a file or under one."""
    if _is_url(path):
        return path
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        fail(f"cannot use {path} as a record store: {folder} is a file", USAGE)
    if not os.access(folder, os.W_OK):
        fail(f"cannot write a record store at {path}: {folder} is not writable", USAGE)
    return path


def check_cluster(address: str | None, timeout: float = CLUSTER_CONNECT_SECONDS) -> str | None:
    """A Dask scheduler address that answers a TCP connection now (None: a local cluster is started).
    A refused connection fails at once instead of after the client's timeout."""
    if address is None:
        return None
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        fail(f"--cluster {address!r} is not a scheduler address like tcp://host:8786", USAGE)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as err:
        fail(f"no Dask scheduler answers at {address} ({err.strerror or err})")
    return address


def check_workload_args(name: str, signature: inspect.Signature, positional: list) -> None:
    """Sizes given by position must be all of the workload's sizes (its int parameters), so a missing
    one is an error instead of a silent default; none at all means the registered defaults."""
    sizes = [p for p in signature.parameters.values() if p.annotation in (int, "int")]
    if positional and len(positional) < len(sizes):
        defaults = ",".join(str(p.default) for p in sizes)
        fail(f"{name} takes {len(sizes)} sizes ({', '.join(p.name for p in sizes)}), got {len(positional)}: "
             f"pass all of them, or none for the defaults ({defaults})", USAGE)
