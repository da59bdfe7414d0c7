"""TVM auto_scheduler's tuning log (JSON lines), read and written, so a TVM user can bring a log and take
one back.

One measurement per line, as TVM's `RecordToFile` writes it (src/auto_scheduler/measure_record.cc, log
version v0.6):

    {"i": [[workload_key, target, [8 hardware params], target_host, layout_rewrite_option, [input names]],
           [[], [step, step, ...]]],
     "r": [[cost, ...], error_no, all_cost, timestamp],
     "v": "v0.6"}

TVM's reader also takes the shorter task lists older logs have ([workload_key, target] in v0.2, the
hardware params from v0.3), so this one does; a line starting with '#' or a space is a comment, as there.
The error numbers are TVM's MeasureErrorNo, which the record store already uses (storage.schema), so
they pass through unchanged; a failed measurement's cost is TVM's 1e10.

This file knows the log's format and how its fields meet a `MeasureRecord`. What the fields mean for a
program (TVM's stage ids, its annotation numbers, its workload names) is the business of the layers
that know programs: `schedule.tvm_steps` and `tasks.tvm_workloads`; `flows.tvm_interop` ties them
together. Storage imports nothing of tensortune's other layers.
"""
from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterator, Sequence

from tensortune.storage.schema import MeasureRecord

LOG_VERSION = "v0.6"           # what this writer writes (TVM's AUTO_SCHEDULER_LOG_VERSION)
FAILED_COST = 1e10             # TVM's cost of a measurement that failed (MAX_FLOAT in measure.py)
HARDWARE_FIELDS = ("num_cores", "vector_unit_bytes", "cache_line_bytes", "max_shared_memory_per_block",
                   "max_local_memory_per_block", "max_threads_per_block", "max_vthread_extent", "warp_size")


class TVMLogError(ValueError):
    """A line that is not a TVM auto_scheduler record; the message says which part is wrong."""


@dataclass(frozen=True)
class TVMTask:
    """TVM's SearchTask as a record carries it."""

    workload_key: str                                   # '["matmul_add", 1024, 1024, 1024, "float32"]'
    target: str                                         # "llvm -keys=cpu -mcpu=skylake-avx512"
    hardware_params: tuple[int, ...] | None = None      # HARDWARE_FIELDS, in that order
    target_host: str = ""
    layout_rewrite_option: int = 0
    task_input_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class TVMRecord:
    """One line of a TVM log: the task, the program (TVM's step list, as JSON lists) and its result."""

    task: TVMTask
    steps: list                                          # [["SP", 2, 0, 1024, [2, 1, 4], 1], ...]
    costs: tuple[float, ...]                             # seconds, one per repeat
    error_no: int = 0
    all_cost: float = 0.0                                # seconds the whole measurement took
    timestamp: float = 0.0                               # seconds since the epoch
    version: str = LOG_VERSION

    @property
    def ok(self) -> bool:
        return self.error_no == 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _task(item: Any) -> TVMTask:
    if not isinstance(item, list) or len(item) < 2 or not all(isinstance(x, str) for x in item[:2]):
        raise TVMLogError(f"the task must be [workload_key, target, ...] (two strings first), got {item!r:.200}")
    hardware: tuple[int, ...] | None = None
    if len(item) > 2:
        hw = item[2]
        if not isinstance(hw, list) or len(hw) != len(HARDWARE_FIELDS) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in hw):
            raise TVMLogError(f"the task's hardware params must be {len(HARDWARE_FIELDS)} integers "
                              f"({', '.join(HARDWARE_FIELDS)}), got {hw!r:.200}")
        hardware = tuple(hw)
    host = item[3] if len(item) > 3 else ""
    layout = item[4] if len(item) > 4 else 0
    names = item[5] if len(item) > 5 else []
    if not isinstance(host, str) or not isinstance(layout, int) or not isinstance(names, list) \
            or not all(isinstance(n, str) for n in names) or len(item) > 6:
        raise TVMLogError(f"the task must be [workload_key, target, hardware_params, target_host, "
                          f"layout_rewrite_option, [input names]], got {item!r:.200}")
    return TVMTask(item[0], item[1], hardware, host, layout, tuple(names))


def _steps(item: Any) -> list:
    if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], list):
        raise TVMLogError(f"the state must be [[], [steps...]], got {item!r:.200}")
    for step in item[1]:
        if not isinstance(step, list) or not step or not isinstance(step[0], str):
            raise TVMLogError(f"each step must be a list starting with its code (\"SP\", \"CA\", ...), "
                              f"got {step!r:.200}")
    return item[1]


def parse_record(obj: Any) -> TVMRecord:
    """A record from its decoded JSON object; TVMLogError says what does not fit TVM's format."""
    if not isinstance(obj, dict) or "i" not in obj or "r" not in obj:
        raise TVMLogError("a record is an object with \"i\" (input) and \"r\" (result)")
    unknown = sorted(set(obj) - {"i", "r", "v"})
    if unknown:
        raise TVMLogError(f"unknown keys {unknown} (a record has \"i\", \"r\" and \"v\")")
    inp, res, version = obj["i"], obj["r"], obj.get("v", "")
    if not isinstance(inp, list) or len(inp) != 2:
        raise TVMLogError(f"\"i\" must be [task, state], got {inp!r:.200}")
    if not (isinstance(res, list) and len(res) == 4 and isinstance(res[0], list)
            and all(_number(c) for c in res[0]) and isinstance(res[1], int) and not isinstance(res[1], bool)
            and _number(res[2]) and _number(res[3])):
        raise TVMLogError(f"\"r\" must be [[costs...], error_no, all_cost, timestamp], got {res!r:.200}")
    if not isinstance(version, str):
        raise TVMLogError(f"\"v\" must be the log version string, got {version!r:.50}")
    return TVMRecord(_task(inp[0]), _steps(inp[1]), tuple(float(c) for c in res[0]), res[1], float(res[2]),
                     float(res[3]), version)


def is_comment(line: str) -> bool:
    """TVM's reader skips lines that start with '#' or a space; blank lines carry nothing either."""
    return not line.strip() or line[0] in "# "


def parse_line(line: str) -> TVMRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise TVMLogError(f"not JSON ({err.msg} at column {err.colno})") from None
    return parse_record(obj)


def read_log(text: str) -> Iterator[tuple[int, TVMRecord | TVMLogError]]:
    """(line number, record or the error that line has) for every line that is not a comment, so a
    caller can check the whole log before it imports anything."""
    for number, line in enumerate(text.splitlines(), start=1):
        if is_comment(line):
            continue
        try:
            yield number, parse_line(line)
        except TVMLogError as err:
            yield number, err


def format_record(record: TVMRecord) -> str:
    """One line as TVM's writer lays it out (full-precision floats: TVM reads any double)."""
    task = record.task
    hardware = list(task.hardware_params) if task.hardware_params is not None else [0] * len(HARDWARE_FIELDS)
    obj = {"i": [[task.workload_key, task.target, hardware, task.target_host, task.layout_rewrite_option,
                  list(task.task_input_names)], [[], record.steps]],
           "r": [list(record.costs), record.error_no, record.all_cost, int(record.timestamp)],
           "v": record.version}
    return json.dumps(obj)


# ------------------------------------------------------------------------------ targets


def tvm_target(target: str, hardware: Sequence[int]) -> str:
    """TVM's spelling of a record store target: `llvm -mcpu=X -num-threads=N` is TVM's `llvm -keys=cpu
    -mcpu=X -num-cores=N` (TVM has no -num-threads; -num-cores is what its HardwareParams read),
    `cuda -arch=sm_XY` is `cuda -keys=cuda,gpu -arch=sm_XY` with the limits of `hardware`."""
    parts = shlex.split(target)
    opts = dict(p.lstrip("-").partition("=")[::2] for p in parts[1:])
    if parts[0] == "llvm":
        out = ["llvm", "-keys=cpu"] + ([f"-mcpu={opts['mcpu']}"] if "mcpu" in opts else [])
        threads = opts.get("num-threads") or str(hardware[0])
        return " ".join(out + [f"-num-cores={threads}"])
    if parts[0] == "cuda":
        hw = dict(zip(HARDWARE_FIELDS, hardware))
        return (f"cuda -keys=cuda,gpu -arch={opts.get('arch', 'sm_90')} "
                f"-max_num_threads={hw['max_threads_per_block']} -thread_warp_size={hw['warp_size']}")
    raise TVMLogError(f"no TVM spelling for target {target!r}")


def target_spec(tvm: TVMTask) -> tuple[str, bool]:
    """The tensortune target a TVM task's target names, before it is resolved (codegen.target), and
    whether the TVM target pins the machine (an -mcpu or -arch). `llvm -keys=cpu -mcpu=X` with 4 cores in
    its hardware params is `llvm -mcpu=X -num-threads=4`; without -mcpu it is this machine's CPU, which
    is all TVM's own string says too. The thread count is TVM's -num-cores, else the hardware params'
    num_cores, else left to the resolver (all cores)."""
    try:
        parts = shlex.split(tvm.target)
    except ValueError as err:
        raise TVMLogError(f"cannot parse target {tvm.target!r}: {err}") from None
    if not parts:
        raise TVMLogError("the task's target is empty")
    opts = dict(p.lstrip("-").partition("=")[::2] for p in parts[1:])
    kind = parts[0]
    if kind == "llvm":
        threads = opts.get("num-cores") or (str(tvm.hardware_params[0]) if tvm.hardware_params
                                            and tvm.hardware_params[0] > 0 else "")
        spec = ["llvm"] + ([f"-mcpu={opts['mcpu']}"] if "mcpu" in opts else []) + \
            ([f"-num-threads={threads}"] if threads else [])
        return " ".join(spec), "mcpu" in opts
    if kind == "cuda":
        return (f"cuda -arch={opts['arch']}", True) if "arch" in opts else ("cuda", False)
    raise TVMLogError(f"target kind {kind!r} has no tensortune counterpart (llvm and cuda do)")


# ------------------------------------------------------------------------------ records


def to_tvm_record(record: MeasureRecord, task: TVMTask, steps: list) -> TVMRecord:
    """A store record as a TVM record of `task` with `steps` (already in TVM's numbering). all_cost is
    the build and run time together, as TVM counts it."""
    if record.error_code == 0 and record.latencies:
        costs = tuple(record.latencies)
    elif record.error_code == 0 and math.isfinite(record.mean_latency):
        costs = (record.mean_latency,)
    else:
        costs = (FAILED_COST,)
    spent = sum(x for x in (record.build_seconds, record.run_seconds) if math.isfinite(x))
    return TVMRecord(task, steps, costs, int(record.error_code), float(spent), record.timestamp.timestamp())


def from_tvm_record(record: TVMRecord, *, workload_key: str, target: str, steps: str, task_name: str,
             task_label: str, flops: float, num_threads: int, source: str) -> MeasureRecord:
    """A TVM record as a store record of the task `workload_key` on `target` (steps already converted).
    A failed measurement keeps its error number and no latencies; TVM's all_cost becomes the run time
    (it does not say how much of it was the build); `source` names the log in flow_run_id and
    error_msg, so imported records read apart from measured ones."""
    ok = record.ok and bool(record.costs) and all(math.isfinite(c) and c < FAILED_COST for c in record.costs)
    return MeasureRecord(
        workload_key=workload_key, target=target, steps=steps, flow_run_id=f"tvm-import:{source}",
        timestamp=datetime.fromtimestamp(record.timestamp, timezone.utc), task_name=task_name,
        task_label=task_label, host="", latencies=list(record.costs) if ok else [],
        mean_latency=math.nan if ok else math.inf, error_code=record.error_no or (0 if ok else 8),
        error_msg="" if ok else f"measured by TVM (log {source}, error_no {record.error_no})",
        run_seconds=record.all_cost, flops=flops, num_threads=num_threads,
        tool_version=f"tvm-auto_scheduler-log-{record.version or 'unversioned'}")
