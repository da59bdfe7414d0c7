"""Records in and out of TVM auto_scheduler's log format: the record store on one side, a TVM log on the
other, for the workloads both tools share (tasks.tvm_workloads).

The log's format is storage.tvm_records, the step numbering schedule.tvm_steps, the workload names
tasks.tvm_workloads; this module runs them over a store and a file and counts what it could not
carry across (and why), because a line TVM wrote for a workload tensortune does not have is an
ordinary thing to meet in a real log, not an error.
"""
from __future__ import annotations

import os
import uuid
from collections import Counter
from dataclasses import astuple, dataclass, field
from typing import Sequence

from tensortune.codegen.target import Target, parse_target
from tensortune.schedule.stage import IllegalStep
from tensortune.schedule.state import State
from tensortune.schedule.tvm_steps import UnconvertibleSteps, from_tvm, to_tvm
from tensortune.storage.queries import competing_mask
from tensortune.storage.records import RecordStore
from tensortune.storage.schema import MeasureRecord, frame_to_records
from tensortune.storage.tvm_records import (
    TVMLogError,
    TVMRecord,
    TVMTask,
    format_record,
    from_tvm_record,
    read_log,
    target_spec,
    to_tvm_record,
    tvm_target,
)
from tensortune.tasks.tvm_workloads import EXPORTED, Resolved, UnsharedWorkload, from_tvm_key, resolve_task, to_tvm_key


@dataclass
class Summary:
    """What an import or export carried across, and what it left and why (reason -> records)."""

    done: int = 0
    tasks: Counter[str] = field(default_factory=Counter)      # task -> records carried
    already: int = 0                                          # import: programs the store had
    skipped: Counter[str] = field(default_factory=Counter)


# ------------------------------------------------------------------------------ import


def check_log(path: str) -> list[tuple[int, TVMRecord]]:
    """Every record of the log at `path`, or TVMLogError naming the first line that is not one (checked
    whole before anything is imported)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise TVMLogError(f"cannot read {path}: {err}") from None
    out = []
    for number, item in read_log(text):
        if isinstance(item, TVMLogError):
            raise TVMLogError(f"{path} line {number}: {item}")
        out.append((number, item))
    if not out:
        raise TVMLogError(f"{path} holds no records (only comments or blank lines)")
    return out


def _target(task: TVMTask, override: Target | None) -> Target:
    spec, _ = target_spec(task)
    if override is None:
        return parse_target(spec)
    if spec.split()[0] != override.kind:
        raise ValueError(f"a {spec.split()[0]} program cannot be stored under the {override.kind} target "
                         f"{override}")
    return override


def import_log(path: str, store: RecordStore, target: str | None = None) -> Summary:
    """Append the log's records of shared workloads to `store`, each under its tensortune task and target
    (the TVM target's -mcpu/-arch and thread count; `target` puts them all under that one instead).
    A program the store already has for that task and target is not added again."""
    lines = check_log(path)
    override = parse_target(target) if target is not None else None
    source = os.path.basename(path)
    summary = Summary()
    workloads: dict[str, Resolved | UnsharedWorkload] = {}
    targets: dict[tuple, Target] = {}
    known: dict[tuple[str, str], set[str]] = {}
    batches: dict[str, list[MeasureRecord]] = {}
    for _, record in lines:
        key = record.task.workload_key
        if key not in workloads:
            try:
                workloads[key] = from_tvm_key(key)
            except UnsharedWorkload as err:
                workloads[key] = err
        resolved = workloads[key]
        if isinstance(resolved, UnsharedWorkload):
            summary.skipped[f"workload {key}: {resolved}"] += 1
            continue
        tkey = astuple(record.task)
        try:
            if tkey not in targets:
                targets[tkey] = _target(record.task, override)
            tt = targets[tkey]
            steps = from_tvm(resolved.dag, record.steps, resolved.tvm_dag).steps_json()
        except (TVMLogError, ValueError) as err:
            summary.skipped[f"{type(err).__name__}: {err}"] += 1
            continue
        dag, where = resolved.dag, str(tt)
        seen = known.setdefault((dag.workload_key, where), store.measured_steps(dag.workload_key, where))
        if steps in seen:
            summary.already += 1
            continue
        seen.add(steps)
        batches.setdefault(where, []).append(from_tvm_record(
            record, workload_key=dag.workload_key, target=where, steps=steps, task_name=resolved.name,
            task_label=f"{resolved.name} {dag.shape_signature}", flops=dag.flop_ct,
            num_threads=tt.num_threads, source=source))
        summary.done += 1
        summary.tasks[f"{resolved.name} {dag.shape_signature} on {where}"] += 1
    for batch in batches.values():
        store.append(batch)
    return summary


# ------------------------------------------------------------------------------ export


def export_log(store: RecordStore, out: str, workloads: Sequence[str] = (), history: bool = False) -> Summary:
    """Write the store's records of the tasks TVM shares (only the workloads named, if any) to `out` as a
    TVM log; the file is replaced whole (written beside it, then renamed), and left alone when nothing
    is shared.

    Only the records that compete for a task's best are written (storage.queries.competing_mask: those
    since the task's newest re-timing), unless `history`. TVM's ApplyHistoryBest takes the fastest
    successful record of a log, and its format has no field that says a timing is from another night,
    so an older record timed in a fast hour would be TVM's best again, the stale choice a resumed run's
    re-timing exists to undo. `history` writes them all, for TVM's cost model to train on."""
    names = list(workloads) or sorted(EXPORTED)
    frame = store.read(task_name=names)
    summary = Summary()
    if not workloads:
        others = store.read(columns=["task_name"])["task_name"].value_counts()
        for name, n in others[~others.index.isin(names)].items():
            summary.skipped[f"tasks of {name or 'unnamed workloads'}: no TVM workload is shared for it"] += int(n)
    # the rule per task and target, over every name it was stored under
    frame = frame.assign(_live=True if history else competing_mask(frame, ["workload_key", "target"]))
    lines: list[str] = []
    for (key, target, name, label), group in frame.groupby(
            ["workload_key", "target", "task_name", "task_label"], sort=False):
        try:
            task_of = resolve_task(str(name), str(label), str(key))
            tvm_key = to_tvm_key(str(name), task_of.args)
            resolved = parse_target(str(target))
        except (UnsharedWorkload, ValueError) as err:
            summary.skipped[f"task {label or name}: {err}"] += len(group)
            continue
        hardware = astuple(resolved.hardware)
        task = TVMTask(tvm_key, tvm_target(str(target), hardware), hardware)
        live = group["_live"].to_numpy(dtype=bool)
        if not live.all():
            summary.skipped[f"records of {label or name} older than its newest re-timing: timed in an earlier run, "
                            f"TVM would take them for the best (--history writes them)"] += int((~live).sum())
            group = group[live]
        for record in frame_to_records(group):
            try:
                steps = to_tvm(State.from_json(task_of.dag, record.steps), task_of.tvm_dag)
            except (IllegalStep, UnconvertibleSteps) as err:
                summary.skipped[f"program of {label}: {err}"] += 1
                continue
            lines.append(format_record(to_tvm_record(record, task, steps)))
            summary.done += 1
            summary.tasks[f"{tvm_key} on {task.target}"] += 1
    if not lines:
        return summary
    folder = os.path.dirname(os.path.abspath(out))
    tmp = os.path.join(folder, f".tvm-log-{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)     # an ordinary file: the umask decides
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise
    return summary
