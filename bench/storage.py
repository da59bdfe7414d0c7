"""`python -m bench storage`: append throughput, size on disk and query latency of the record store.

Writes N synthetic records in batches (one part file per batch, as tuning rounds do), times the
best-per-task and one-task history queries on the many small files, compacts, and times them again;
then once more after a night that timed every task's best again (re-timing rows) and measured a round.
Query times are medians of several runs in a fresh RecordStore each (nothing cached in the process;
the OS page cache is warm after the first run, as it is on a machine that just tuned).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import tempfile
from datetime import datetime, timedelta, timezone
from typing import Callable

import numpy as np

from bench.common import Stopwatch, environment
from tensortune.storage.records import RecordStore
from tensortune.storage.schema import frame_to_records
from tensortune.storage.synthetic import synthetic_batch, workload_key

TARGET = "llvm -mcpu=emeraldrapids"


def _median_seconds(action: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(first, median) wall time of `action` over `repeats` runs."""
    times = []
    for _ in range(repeats):
        with Stopwatch() as watch:
            action()
        times.append(watch.seconds)
    return times[0], statistics.median(times)


def _data_bytes(root: str) -> tuple[int, int]:
    """(files, bytes) of the record files under `root` (models, journals and temporaries left out)."""
    files = size = 0
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        for name in names:
            if name.endswith(".parquet") and not name.startswith("."):
                files += 1
                size += os.path.getsize(os.path.join(folder, name))
    return files, size


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench storage", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tasks", type=int, default=300, help="distinct workload keys")
    parser.add_argument("--repeats", type=int, default=3, help="runs per query timing")
    parser.add_argument("--dir", help="where to write the store (default: a temporary folder, removed)")
    parser.add_argument("--no-fsync", action="store_true", help="append without fsync (durable=False)")
    parser.add_argument("--auto-compact", type=int, default=128,
                        help="RecordStore(auto_compact=N) while appending; 0 = off (thousands of "
                             "small part files, as with no compaction at all)")
    parser.add_argument("--json", help="write the result rows to this JSON file")
    args = parser.parse_args(argv)

    env = environment(os.cpu_count()) if args.json else None
    root = args.dir or tempfile.mkdtemp(prefix="tensortune-bench-storage-")
    if args.dir and os.path.exists(root) and os.listdir(root):
        parser.error(f"--dir {root} is not empty; give an empty or new folder")
    try:
        rows = _run(root, args)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    _print(rows, args)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"benchmark": "storage", "environment": env, "host": platform.node(),
                       "records": args.records, "batch": args.batch, "tasks": args.tasks,
                       "fsync": not args.no_fsync, "rows": rows}, out, indent=1)
    return 0


def _run(root: str, args: argparse.Namespace) -> list[dict[str, object]]:
    rng = np.random.default_rng(0)
    store = RecordStore(root, durable=not args.no_fsync, auto_compact=args.auto_compact or None)
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    append_seconds = build_seconds = 0.0
    batches = -(-args.records // args.batch)
    for index in range(batches):
        size = min(args.batch, args.records - index * args.batch)
        with Stopwatch() as building:
            records = synthetic_batch(rng, size, target=TARGET, tasks=args.tasks,
                                      flow_run_id=f"run-{index // 500:04d}", round=index % 500,
                                      timestamp=start + timedelta(seconds=index), host="bench")
        with Stopwatch() as appending:
            store.append(records)
        build_seconds += building.seconds
        append_seconds += appending.seconds
    appended = f"as appended (auto {args.auto_compact})" if args.auto_compact else "as appended"
    rows: list[dict[str, object]] = [
        {"metric": "append throughput", "layout": appended, "value": args.records / append_seconds,
         "unit": "records/s", "detail": f"{batches} appends of {args.batch}, "
                                       f"{append_seconds / batches * 1e3:.2f} ms each"},
        {"metric": "MeasureRecord construction", "layout": "-", "value": args.records / build_seconds,
         "unit": "records/s", "detail": "synthetic generator, not part of append"},
    ]
    task = workload_key(7)
    rows += _layout_rows(root, appended, task, args.repeats)
    compaction = RecordStore(root, durable=not args.no_fsync).compact()
    rows.append({"metric": "compact()", "layout": "-> compacted",
                 "value": compaction.seconds, "unit": "s",
                 "detail": f"{compaction.input_files} files -> {compaction.output_files}, "
                           f"{compaction.rows} rows"})
    rows += _layout_rows(root, "compacted", task, args.repeats)
    # a night that resumes: each task's best timed again (a re-timing row, one time for all), then a round
    # of new records: the best-record query then reads the re-timed tasks' rows since their re-timing
    night = start + timedelta(seconds=batches + 3600)
    store.append([dataclasses.replace(r, record_id="", retiming=True, timestamp=night)
                  for r in frame_to_records(RecordStore(root).best_per_task())])
    store.append(synthetic_batch(rng, args.batch, target=TARGET, tasks=args.tasks, flow_run_id="run-night",
                                 timestamp=night + timedelta(seconds=1), host="bench"))
    rows += _layout_rows(root, "+ a night timed again", task, args.repeats)
    return rows


def _layout_rows(root: str, layout: str, task: str, repeats: int) -> list[dict[str, object]]:
    files, size = _data_bytes(root)
    best_rows = len(RecordStore(root).best_per_task())
    first_best, best = _median_seconds(lambda: RecordStore(root).best_per_task(), repeats)
    history_rows = len(RecordStore(root).history(task))
    first_history, history = _median_seconds(lambda: RecordStore(root).history(task), repeats)
    first_steps, steps = _median_seconds(lambda: RecordStore(root).measured_steps(task, TARGET), repeats)
    return [
        {"metric": "size on disk", "layout": layout, "value": size / 2**20, "unit": "MiB",
         "detail": f"{files} files, {size / max(files, 1) / 1024:.1f} KiB each"},
        {"metric": "best_per_task", "layout": layout, "value": best, "unit": "s",
         "detail": f"{best_rows} tasks; first run {first_best:.3f} s"},
        {"metric": "history (one task)", "layout": layout, "value": history, "unit": "s",
         "detail": f"{history_rows} runs; first run {first_history:.3f} s"},
        {"metric": "measured_steps (one task)", "layout": layout, "value": steps, "unit": "s",
         "detail": f"first run {first_steps:.3f} s"},
    ]


def _print(rows: list[dict[str, object]], args: argparse.Namespace) -> None:
    print(f"storage benchmark: {args.records:,} records, batches of {args.batch}, {args.tasks} tasks, "
          f"fsync {'off' if args.no_fsync else 'on'}, auto_compact {args.auto_compact or 'off'}, "
          f"{os.cpu_count()} CPUs")
    header = f"{'metric':<28} {'layout':<24} {'value':>12} {'unit':<10} detail"
    print(header)
    print("-" * len(header))
    for row in rows:
        value = row["value"]
        shown = f"{value:,.0f}" if row["unit"] == "records/s" else f"{value:,.3f}"
        print(f"{row['metric']:<28} {row['layout']:<24} {shown:>12} {row['unit']:<10} {row['detail']}")
