"""`tensortune history` and `tensortune best`: the record store's tables, printed for people."""
from __future__ import annotations

import math
import warnings
from typing import Annotated, Callable, Optional

import pandas as pd
import pyarrow as pa
import typer
from rich.console import Console
from rich.table import Table

from tensortune.flows.cli_app import app
from tensortune.flows.cli_input import USAGE, check_target, fail, open_store, store_failure
from tensortune.storage.integrity import BadFileError
from tensortune.storage.records import DEFAULT_ROOT
from tensortune.storage.scan import StoreChangedError

RecordsOption = Annotated[str, typer.Option(
    "--records", envvar="TENSORTUNE_RECORDS",
    help="Record store: a folder or a URL such as s3://bucket/records.")]
NetworkOption = Annotated[Optional[str], typer.Option("--network", help="Only records of this network.")]
TargetOption = Annotated[Optional[str], typer.Option("--target", help="Only records of this target.")]
QuarantineOption = Annotated[bool, typer.Option(
    "--quarantine", help="Move corrupt or foreign files to <records>/_quarantine/ instead of stopping.")]


@app.command("history")
def history(records: RecordsOption = DEFAULT_ROOT, network: NetworkOption = None,
            task: Annotated[Optional[str], typer.Option(
                "--task", help="A task's name or workload key: show how its best latency moved.")] = None,
            target: TargetOption = None,
            per_round: Annotated[bool, typer.Option("--per-round", help="With --task: a row per round.")]
            = False,
            quarantine: QuarantineOption = False) -> None:
    """Tuning runs so far, or (with --task) the best latency of one task run after run."""
    if per_round and task is None:
        fail("--per-round needs --task (the rounds of one task); without it the table has a row per run", USAGE)
    target = check_target(target) if target is not None else None   # as records name it
    store = open_store(records, quarantine=quarantine, check=False)   # _query reports
    if task is None:
        frame = _query(records, lambda: store.runs(network=network, target=target))
        _print(frame, f"flow runs in {records}", [
            ("flow run", "flow_run_id", str), ("start", "start", _time), ("end", "end", _time),
            ("networks", "networks", str), ("targets", "targets", str), ("tasks", "n_tasks", str),
            ("records", "n_records", str), ("errors", "n_errors", str)])
        return
    frame = _query(records, lambda: store.history(task, target=target, network=network,
                                         per="round" if per_round else "run"))
    if frame.empty:
        fail(f"no records of task {task!r} in {records} (a task's name or workload key; `tensortune best` "
             "lists them)")
    columns = [("target", "target", str), ("task", "task_name", str), ("workload key", "workload_key", _short),
               ("flow run", "flow_run_id", str)]
    if per_round:
        columns.append(("round", "round", str))
    columns += [("start", "start", _time), ("records", "n_records", str), ("errors", "n_errors", str),
                ("best ms", "best_latency", _ms), ("GFLOP/s", "best_gflops", _number),
                ("best so far ms", "best_so_far", _ms)]
    _print(frame, f"history of {task} in {records}", columns)


@app.command("best")
def best(records: RecordsOption = DEFAULT_ROOT, network: NetworkOption = None,
         target: TargetOption = None, quarantine: QuarantineOption = False) -> None:
    """The fastest schedule found so far for every task."""
    target = check_target(target) if target is not None else None   # as records name it
    store = open_store(records, quarantine=quarantine, check=False)   # _query reports
    frame = _query(records, lambda: store.best_per_task(network=network, target=target))
    _print(frame, f"best per task in {records}", [
        ("target", "target", str), ("task", "task_name", str), ("network", "network", str),
        ("best ms", "mean_latency", _ms), ("GFLOP/s", "gflops", _number),
        ("records", "n_records", str), ("errors", "n_errors", str), ("flow run", "flow_run_id", str),
        ("measured", "timestamp", _time), ("workload key", "workload_key", _short)])


def _query(records: str, run: Callable[[], pd.DataFrame]) -> pd.DataFrame:
    """Run a query; a store problem becomes a message and exit code 1, a warning a yellow line."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            frame = run()
    except (BadFileError, StoreChangedError, ValueError, OSError, pa.ArrowException) as exc:
        fail(store_failure(records, exc))
    for warning in caught:
        Console(stderr=True).print(f"[yellow]warning:[/yellow] {warning.message}", highlight=False, soft_wrap=True)
    return frame


def _print(frame: pd.DataFrame, title: str, columns: list[tuple[str, str, object]]) -> None:
    console = Console()
    if frame.empty:
        console.print(f"no records match ({title})")
        return
    table = Table(title=title)
    for header, _, _ in columns:
        table.add_column(header, overflow="fold")
    for row in frame.to_dict("records"):
        table.add_row(*[fmt(_task(row) if name == "task_name" else row[name])  # type: ignore[operator]
                        for _, name, fmt in columns])
    console.print(table)


def _task(row: dict) -> str:
    """The task as a person reads it: its label with shapes (records before schema v3: its name)."""
    return str(row.get("task_label") or row["task_name"])


def _ms(seconds: float) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.4f}"


def _number(value: float) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:,.1f}"


def _time(value: pd.Timestamp) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S")


def _short(text: str) -> str:
    return text if len(text) <= 48 else text[:45] + "..."
