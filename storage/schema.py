"""One measurement as a Python record and as an Arrow row: the versioned schema of the record store.

The files hold every column except the two hive partition columns (`target`, `date`), which live in the
directory names. Columns added by a later schema version get a default here, so part files written by an
older version still read (their missing columns come back as the default).
"""
from __future__ import annotations

import math
import socket
import uuid
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from importlib import metadata
from typing import Any, Iterable, Sequence

import pandas as pd
import pyarrow as pa

SCHEMA_VERSION = 5   # 2: num_threads; 3: task_label; 4: kernel; 5: retiming

# TVM's auto_scheduler MeasureErrorNo, so error codes mean the same thing in both tools.
ERROR_NAMES: dict[int, str] = {
    0: "NO_ERROR",
    1: "INSTANTIATION_ERROR",
    2: "COMPILE_HOST",
    3: "COMPILE_DEVICE",
    4: "RUNTIME_DEVICE",
    5: "WRONG_ANSWER",
    6: "BUILD_TIMEOUT",
    7: "RUN_TIMEOUT",
    8: "UNKNOWN_ERROR",
}


def error_name(code: int) -> str:
    """TVM's name for a measure error code (`UNKNOWN_ERROR_<n>` for codes TVM does not define)."""
    return ERROR_NAMES.get(int(code), f"UNKNOWN_ERROR_{int(code)}")


def _tool_version() -> str:
    try:
        return metadata.version("tensortune")
    except metadata.PackageNotFoundError:
        return "unknown"


TOOL_VERSION = _tool_version()


@dataclass(kw_only=True)
class MeasureRecord:
    """One measured schedule: what was run, where, how fast, and by which run of which flow."""

    workload_key: str
    target: str
    steps: str  # compact JSON of the schedule's step list; opaque to storage
    kernel: str = ""  # which kernel the steps compiled to (codegen.kernel_identity); "" not known
    record_id: str = ""  # uuid4 hex, generated when empty
    flow_run_id: str = ""
    round: int = 0
    timestamp: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    task_name: str = ""
    task_label: str = ""  # the op name with its shapes, e.g. "conv2d_bias_relu 1x64x56x56, 64x64x3x3, 64 -> 1x64x56x56"
    network: str = ""
    host: str = field(default_factory=socket.gethostname)
    latencies: list[float] = field(default_factory=list)  # seconds, one per repeat
    # seconds: the figure the run is ranked by (the mean of its latencies, or the fastest of interleaved
    # passes: codegen.measure.MeasureResult.latency); inf/NaN for errors; mean of latencies when NaN
    mean_latency: float = math.nan
    gflops: float = math.nan  # computed from flops and mean_latency when NaN
    error_code: int = 0  # 0 = NO_ERROR; TVM's MeasureErrorNo otherwise
    error_msg: str = ""
    build_seconds: float = math.nan
    run_seconds: float = math.nan
    model_version: str = ""
    predicted_score: float = math.nan
    tool_version: str = TOOL_VERSION
    flops: float = math.nan  # the task's FLOP count
    num_threads: int = 0  # CPU threads the kernel was timed on (0: a GPU kernel, or written before v2)
    # a stored program timed again when a run resumed: the task's records older than its newest
    # re-timing no longer compete for its best (storage.queries.competing_mask says why)
    retiming: bool = False
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not self.record_id:
            self.record_id = uuid.uuid4().hex
        if self.timestamp.tzinfo is None:
            raise ValueError(
                f"MeasureRecord.timestamp {self.timestamp!r} has no time zone; "
                "pass an aware UTC time such as datetime.now(timezone.utc)")
        self.latencies = [float(x) for x in self.latencies]
        if math.isnan(self.mean_latency) and self.error_code == 0 and self.latencies:
            self.mean_latency = sum(self.latencies) / len(self.latencies)
        if (math.isnan(self.gflops) and self.error_code == 0 and self.flops > 0
                and math.isfinite(self.mean_latency) and self.mean_latency > 0):
            self.gflops = self.flops / self.mean_latency / 1e9


# Hive partition columns: stored in directory names, not in the files.
PARTITION_SCHEMA = pa.schema([("target", pa.string()), ("date", pa.string())])

FILE_SCHEMA = pa.schema([
    ("record_id", pa.string()),
    ("flow_run_id", pa.string()),
    ("round", pa.int32()),
    ("timestamp", pa.timestamp("us", tz="UTC")),
    ("workload_key", pa.string()),
    ("task_name", pa.string()),
    ("task_label", pa.string()),
    ("network", pa.string()),
    ("host", pa.string()),
    ("steps", pa.string()),
    ("kernel", pa.string()),
    ("latencies", pa.list_(pa.float64())),
    ("mean_latency", pa.float64()),
    ("gflops", pa.float64()),
    ("error_code", pa.int32()),
    ("error_msg", pa.string()),
    ("build_seconds", pa.float64()),
    ("run_seconds", pa.float64()),
    ("model_version", pa.string()),
    ("predicted_score", pa.float64()),
    ("tool_version", pa.string()),
    ("flops", pa.float64()),
    ("num_threads", pa.int32()),
    ("retiming", pa.bool_()),
    ("schema_version", pa.int32()),
])

DATASET_SCHEMA = pa.schema(list(FILE_SCHEMA) + list(PARTITION_SCHEMA))

# The columns of a query's DataFrame, in the order people read them (target after network).
RECORD_COLUMNS: tuple[str, ...] = tuple(
    name for column in FILE_SCHEMA.names
    for name in ((column, "target") if column == "network" else (column,)))

# Every schema version writes these; a file without them is not one of ours.
REQUIRED_COLUMNS: tuple[str, ...] = ("record_id", "workload_key", "steps", "mean_latency",
                                     "error_code", "schema_version")

# What a column reads as in a file written before the column existed. A version that adds a column adds
# its default here (version 2 added num_threads: 0, "not recorded"; version 3 task_label: ""; version 4
# kernel: ""; version 5 retiming: False).
COLUMN_DEFAULTS: dict[str, Any] = {
    "flow_run_id": "", "round": 0, "task_name": "", "network": "", "host": "", "latencies": [],
    "gflops": math.nan, "error_msg": "", "build_seconds": math.nan, "run_seconds": math.nan,
    "model_version": "", "predicted_score": math.nan, "tool_version": "unknown", "flops": math.nan,
    "num_threads": 0, "task_label": "", "kernel": "", "retiming": False,
}

if set(RECORD_COLUMNS) != {f.name for f in fields(MeasureRecord)}:
    raise ImportError("storage.schema: FILE_SCHEMA and MeasureRecord disagree on the columns")


def records_to_table(records: Sequence[MeasureRecord]) -> pa.Table:
    """The file-schema Arrow table of `records` (partition columns left out: they go in the path)."""
    columns = {}
    for name in FILE_SCHEMA.names:
        values = [getattr(r, name) for r in records]
        if name == "schema_version":
            values = [SCHEMA_VERSION] * len(records)
        try:
            columns[name] = pa.array(values, type=FILE_SCHEMA.field(name).type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
            raise TypeError(f"MeasureRecord.{name} must be {FILE_SCHEMA.field(name).type} in every "
                            f"record: {exc}") from exc
    return pa.Table.from_pydict(columns, schema=FILE_SCHEMA)


def fill_missing_columns(table: pa.Table) -> pa.Table:
    """Replace the nulls an older file's absent columns read as by their defaults.

    Writers never write nulls, so a null here always means "this file predates the column".
    """
    for name, default in COLUMN_DEFAULTS.items():
        if name not in table.column_names:
            continue
        index = table.column_names.index(name)
        column = table.column(index)
        if column.null_count == 0:
            continue
        if name == "latencies":
            filled = pa.array([v if v is not None else default for v in column.to_pylist()],
                              type=column.type)
        else:
            filled = column.fill_null(pa.scalar(default, type=column.type))
        table = table.set_column(index, name, filled)
    return table


def frame_to_records(frame: pd.DataFrame) -> list[MeasureRecord]:
    """MeasureRecords from a DataFrame returned by a RecordStore query (all record columns needed)."""
    missing = [c for c in RECORD_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"cannot rebuild MeasureRecords: the frame lacks columns {missing}; "
                         "read it with all columns (RecordStore.read() without columns=)")
    return [_row_to_record(row) for row in frame[list(RECORD_COLUMNS)].itertuples(index=False)]


def _row_to_record(row: Iterable[Any]) -> MeasureRecord:
    values = dict(zip(RECORD_COLUMNS, row))
    timestamp = values["timestamp"]
    values["timestamp"] = timestamp.to_pydatetime() if hasattr(timestamp, "to_pydatetime") else timestamp
    values["latencies"] = [float(x) for x in values["latencies"]]
    for name in ("round", "error_code", "num_threads", "schema_version"):
        values[name] = int(values[name])
    values["retiming"] = bool(values["retiming"])
    for name in ("mean_latency", "gflops", "build_seconds", "run_seconds", "predicted_score", "flops"):
        values[name] = float(values[name])
    for name in ("record_id", "flow_run_id", "workload_key", "task_name", "network", "target", "host",
                 "steps", "error_msg", "model_version", "tool_version"):
        values[name] = str(values[name])
    return MeasureRecord(**values)
