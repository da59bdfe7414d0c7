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
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import urlsplit

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from tensortune.storage.records import RecordStore

USAGE = 2
FAILED = 1

# a run of a million measurements takes weeks on one node; more is a typo (an extra zero or two)
MAX_TRIALS = 1_000_000
CLUSTER_CONNECT_SECONDS = 3.0
# search.cost_model.MODEL_OBJECTIVES (the default first) and the random model, named here so the CLI checks
# --model before it imports the search
MODELS = ("xgb-blend", "xgb", "xgb-rank", "random")


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


def at_least(option: str, low: float) -> dict[str, Any]:
    """typer.Option keywords (`**at_least("--threads", 1)`) for a number that must be at least `low`:
    a callback that fails with one error line (typer's own `min=` answers with a boxed usage message of
    several lines) and a metavar that shows the range in --help, as `min=` did."""
    def check(value: Any) -> Any:
        if value is not None and value < low:
            fail(f"{option} must be at least {low:g}, got {value:g}", USAGE)
        return value
    return {"callback": check, "metavar": f"{'FLOAT' if isinstance(low, float) else 'INTEGER'}>={low:g}"}


def check_model(name: str) -> str:
    if name not in MODELS:
        fail(f"unknown cost model {name!r}; use {' or '.join(MODELS)}", USAGE)
    return name


def _is_url(path: str) -> bool:
    return "://" in path


def records_to_read(path: str) -> str:
    """A record store a command only reads: it must exist (a folder, or a URL the store opens later; a
    file:// URL is a folder here, checked as one)."""
    if _is_url(path) and urlsplit(path).scheme != "file":
        return path
    local = urlsplit(path).path if _is_url(path) else path
    if not os.path.exists(local):
        fail(f"no record store at {path} (the folder does not exist; tune first, or pass --records)", USAGE)
    if not os.path.isdir(local):
        fail(f"{path} is a file, not a record store folder", USAGE)
    return path


def _unwritable(path: str) -> str | None:
    """Why no folder can be made or written at `path` (None: one can): the nearest existing folder on
    its way is a file, or not writable by this user."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{folder} is a file"
    if not os.access(folder, os.W_OK):
        return f"{folder} is not writable"
    return None


def records_to_write(path: str) -> str:
    """A record store a command writes: created when missing, but never a file or under one."""
    if _is_url(path):
        return path
    problem = _unwritable(path)
    if problem:
        fail(f"cannot write a record store at {path}: {problem}", USAGE)
    return path


def folder_to_write(option: str, path: str) -> str:
    """A folder a command writes its output into (created when missing), checked before the work that
    fills it: not empty, not a file or under one, writable."""
    if not path.strip():
        fail(f"{option} is empty; name the folder to write into", USAGE)
    problem = _unwritable(path)
    if problem:
        fail(f"cannot write into {option} {path}: {problem}", USAGE)
    return path


def open_store(path: str, *, write: bool = False, quarantine: bool = False, check: bool = True) -> "RecordStore":
    """The record store at `path`, checked readable now (records_to_read / records_to_write first): a
    corrupt or foreign file in it, a folder this user cannot list, a URL whose host does not answer,
    fail here as one message and exit 1, not as a traceback after a build, a banner or a Prefect server.
    The check is one best-record query, which opens every file (of a compacted one only its leading row
    group is read): 0.3 s on a 6000-record ResNet-50 store of 131 part files, 0.08 s on the main job's; a
    reader such as `best` that runs its own query at once and reports its errors alike passes check=False.
    `write`: a missing store is created (nothing to check); `quarantine`: the store moves bad files to
    <path>/_quarantine/ with a warning instead (for the caller's own query to report: with check=False)."""
    import pyarrow as pa

    from tensortune.storage.records import RecordStore
    exists = _is_url(path) or os.path.exists(path)
    if write:
        records_to_write(path)
    else:
        records_to_read(path)
    try:
        policy = "quarantine" if quarantine else "raise"
        store = RecordStore(path, on_bad_file=policy) if write else RecordStore(
            path, on_bad_file=policy, auto_compact=None)
        if exists and check:
            store.best_per_task()
    except (OSError, RuntimeError, ValueError, pa.ArrowException) as err:    # BadFileError is a RuntimeError
        fail(store_failure(path, err))
    return store


def store_failure(path: str, err: BaseException) -> str:
    """What stops the record store at `path` from being read, as one line for `fail`: for bad files, how
    many, the first and what is wrong with it, and how to move them aside; else the error with its type
    (PermissionError, an unreachable URL ...)."""
    from tensortune.storage.integrity import BadFileError
    if isinstance(err, BadFileError) and err.problems:
        first = min(err.problems)
        return (f"record store {path} holds {len(err.problems)} file(s) that are not readable tensortune record "
                f"files ({first}: {err.problems[first]}); `tensortune history --records {path} --quarantine` "
                f"moves them to its _quarantine/ folder")
    return f"cannot read the record store {path}: {type(err).__name__}: {err}"


def check_target(target: str) -> str:
    """A target string that parses (an empty one is a mistake, not this CPU), or one clear error line;
    returned as records name it (`llvm` is this CPU with its thread count: `llvm -mcpu=X -num-threads=N`)."""
    from tensortune.codegen.target import TargetError, parse_target
    if not target.strip():
        fail("--target is empty; use llvm (this CPU) or 'cuda -arch=sm_90'", USAGE)
    try:
        return str(parse_target(target))
    except TargetError as err:
        fail(str(err), USAGE)


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
    params = list(signature.parameters.values())
    sizes = [p for p in params if p.annotation in (int, "int")]
    # a size too many lands on a parameter that is no size (matmul's dtype): say so, not "unknown dtype 64"
    beyond = [p.annotation for p, v in zip(params[len(sizes):], positional[len(sizes):])
              if type(v) is int and p.annotation not in (bool, "bool")]
    if positional and (len(positional) < len(sizes) or len(positional) > len(params) or beyond):
        defaults = ",".join(str(p.default) for p in sizes)
        fail(f"{name} takes {len(sizes)} sizes ({', '.join(p.name for p in sizes)}), got {len(positional)}: "
             f"pass all of them, or none for the defaults ({defaults})", USAGE)
