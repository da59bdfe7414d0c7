"""`tensortune export-tvm` and `tensortune import-tvm`: the record store to and from TVM auto_scheduler's
tuning log, for the workloads both tools share (tasks.tvm_workloads lists them)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from tensortune.flows.cli_app import app
from tensortune.flows.cli_input import USAGE, fail, open_store, records_to_read, store_failure
from tensortune.flows.history_cli import RecordsOption
from tensortune.storage.records import DEFAULT_ROOT

if TYPE_CHECKING:
    from tensortune.flows.tvm_interop import Summary

SHOWN_REASONS = 10     # a real log can fail in as many ways as it has programs: the commonest, then a count


def _report(console: Console, summary: "Summary") -> None:
    for task, n in sorted(summary.tasks.items()):
        console.print(f"  {n:6d}  {task}", highlight=False, soft_wrap=True, markup=False)
    if summary.already:
        console.print(f"{summary.already} program(s) already in the store, not added again", highlight=False,
                      markup=False)
    if summary.skipped:
        console.print(f"skipped {sum(summary.skipped.values())} record(s):", highlight=False)
        for reason, n in summary.skipped.most_common(SHOWN_REASONS):
            console.print(f"  {n:6d}  {reason}", highlight=False, soft_wrap=True, markup=False)
        rest = summary.skipped.most_common()[SHOWN_REASONS:]
        if rest:
            console.print(f"  {sum(n for _, n in rest):6d}  for {len(rest)} other reasons", highlight=False)


@app.command("export-tvm")
def export_tvm(out: Annotated[str, typer.Option("--out", help="The TVM log (JSON lines) to write; replaced.")],
               records: RecordsOption = DEFAULT_ROOT,
               workload: Annotated[Optional[list[str]], typer.Option(
                   "--workload", help="Only tasks of this tensortune workload (repeatable).")] = None,
               history: Annotated[bool, typer.Option(
                   "--history", help="Also write the records older than a task's newest re-timing, for TVM's "
                   "cost model to train on; TVM's ApplyHistoryBest takes the fastest record of a log, these "
                   "included.")] = False) -> None:
    """Write the store's records of workloads TVM shares as a TVM auto_scheduler log: those that compete
    for each task's best (since its newest re-timing), or all of them with --history."""
    from tensortune.flows.tvm_interop import export_log
    from tensortune.tasks.tvm_workloads import EXPORTED
    records_to_read(records)
    unknown = sorted(set(workload or ()) - set(EXPORTED))
    if unknown:
        fail(f"--workload {', '.join(unknown)}: not shared with TVM; shared: {', '.join(sorted(EXPORTED))}", USAGE)
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        fail(f"--out {out} is a folder; name the log file to write", USAGE)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        fail(f"--out {out}: {folder} is not a writable folder", USAGE)
    store = open_store(records)
    try:
        summary = export_log(store, out, workload or (), history)
    except ValueError as err:
        fail(str(err))
    except RuntimeError as err:                             # the store changed under the read (BadFileError ...)
        fail(store_failure(records, err))
    except OSError as err:                                  # most likely the log (the store was read just now)
        fail(f"export to {out} failed: {type(err).__name__}: {err}")
    console = Console()
    _report(console, summary)
    if not summary.done:
        fail(f"no record in {records} has a TVM counterpart; {out} not written")
    console.print(f"wrote {summary.done} record(s) of {len(summary.tasks)} task(s) to {out}", highlight=False)


@app.command("import-tvm")
def import_tvm(log: Annotated[str, typer.Argument(help="A TVM auto_scheduler log (JSON lines).")],
               records: RecordsOption = DEFAULT_ROOT,
               target: Annotated[Optional[str], typer.Option(
                   "--target", help="Store every record under this target instead of the log's (its "
                   "-mcpu and thread count; a log without -mcpu means this machine's CPU).")] = None) -> None:
    """Add a TVM auto_scheduler log's records of shared workloads to the store, as tensortune programs."""
    from tensortune.codegen.target import TargetError, parse_target
    from tensortune.flows.tvm_interop import check_log, import_log
    from tensortune.storage.tvm_records import TVMLogError
    if not os.path.exists(log):
        fail(f"no TVM log at {log}", USAGE)
    if not os.path.isfile(log):
        fail(f"{log} is not a file (a TVM log is one JSON record per line)", USAGE)
    try:
        check_log(log)
        if target is not None:
            parse_target(target)
    except (TVMLogError, TargetError) as err:
        fail(str(err), USAGE)
    store = open_store(records, write=True)
    try:
        summary = import_log(log, store, target)
    except (TVMLogError, ValueError) as err:
        fail(str(err))
    except (OSError, RuntimeError) as err:                  # the store (BadFileError is a RuntimeError)
        fail(store_failure(records, err))
    console = Console()
    _report(console, summary)
    if not summary.done and not summary.already:
        fail(f"no record of {log} has a tensortune counterpart; nothing imported")
    console.print(f"imported {summary.done} record(s) of {len(summary.tasks)} task(s) into {records}",
                  highlight=False)
