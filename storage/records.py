"""The record store: every measurement of every tuning run, as a hive-partitioned Parquet dataset.

Writers append one immutable part file per call (atomically, no coordination between writers, processes
or nodes); queries read a consistent snapshot and return pandas DataFrames; compaction merges small files
so queries stay fast, and keeps the files it replaced for a grace period (storage.superseded). Raw
readers of the folder (pandas, pyarrow, DuckDB) read inside hold_compactions() (storage.holds). See
storage.layout for the folder layout.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Any, Iterator, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tensortune.storage.compaction import CompactionSettings, CompactionStats, compact, compact_partition
from tensortune.storage.filesystem import Location, open_location, write_atomic
from tensortune.storage.holds import HOLD_SECONDS, release_hold, take_hold
from tensortune.storage.integrity import check_policy, find_bad_files, handle_bad_files
from tensortune.storage.layout import date_segment, new_data_name, target_segment
from tensortune.storage.queries import (
    best_positions,
    competing_mask,
    error_table,
    history_table,
    ok_expression,
    runs_table,
    task_counts,
)
from tensortune.storage.scan import Scanner
from tensortune.storage.schema import RECORD_COLUMNS, MeasureRecord, frame_to_records, records_to_table

__all__ = ["MeasureRecord", "RecordStore", "TrainingRow"]

DEFAULT_ROOT = "./tuning-records"


@dataclass(frozen=True, slots=True)
class TrainingRow:
    """What cost-model training needs from one measurement (unpacks like a tuple)."""

    workload_key: str
    steps: str
    mean_latency: float
    flops: float
    error_code: int

    def __iter__(self) -> Iterator[Any]:
        return iter(tuple(getattr(self, f.name) for f in fields(self)))


class RecordStore:
    """Tuning records in a folder or bucket: `RecordStore("./tuning-records")`,
    `RecordStore("s3://bucket/records")`.

    on_bad_file: what a query does when it meets a corrupt or foreign file: "raise" (the default: an
    error naming the files) or "quarantine" (move them to <root>/_quarantine/ and warn).
    durable: fsync each part file on local disks so a power cut cannot lose an acknowledged batch.
    auto_compact: after an append, merge its partition's part files once there are this many (and
    likewise the small outputs of such merges), so queries never face thousands of tiny files; None
    turns it off (then call compact() yourself).
    """

    def __init__(self, url_or_path: str = DEFAULT_ROOT, *, filesystem: Any = None,
                 on_bad_file: str = "raise", durable: bool = True, auto_compact: int | None = 128):
        if auto_compact is not None and auto_compact < 2:
            raise ValueError(f"auto_compact={auto_compact}: use None (off) or a count of at least 2")
        self.location: Location = open_location(url_or_path, filesystem)
        self.durable = durable
        self.auto_compact = auto_compact
        self._appends = 0  # appends by this instance: the partition is looked at every few of them
        self._scanner = Scanner(self.location, check_policy(on_bad_file))

    def __repr__(self) -> str:
        return f"RecordStore({self.location.url!r})"

    @property
    def root(self) -> str:
        """The store's root path on its filesystem."""
        return self.location.root

    # -- writing ---------------------------------------------------------------------------------------

    def append(self, records: Sequence[MeasureRecord]) -> str:
        """Write `records` as one new part file, atomically; its path ("" when `records` is empty).

        All records of one call must share a target (the target is a partition folder).
        """
        if not records:
            return ""
        targets = {r.target for r in records}
        if len(targets) != 1:
            raise ValueError(f"one append() writes one part file, in one target's folder, but these "
                             f"records have targets {sorted(targets)}: append them per target")
        table = records_to_table(records)
        target = targets.pop()
        day = datetime.now(timezone.utc).date()
        path = self.location.path(target_segment(target), date_segment(day), new_data_name("part"))
        # No dictionaries: at a few dozen rows they cost time and bytes.
        write_atomic(self.location, path,
                     lambda out: pq.write_table(table, out, compression="zstd", use_dictionary=False),
                     durable=self.durable)
        self._appends += 1
        # Listing the partition after every append would cost more than the append itself; looking
        # every auto_compact/8 appends lets at most ~auto_compact * (1 + writers/8) part files pile up.
        if self.auto_compact and (self._appends - 1) % max(1, self.auto_compact // 8) == 0:
            self._compact_after_append(target, day.isoformat(), self.auto_compact)
        return path

    def _compact_after_append(self, target: str, day: str, threshold: int) -> None:
        # The batch is safely written: a failed merge must not turn the append into an error.
        try:
            compact_partition(self.location, self._scanner, target, day, threshold,
                              CompactionSettings(durable=self.durable))
        except Exception as exc:  # noqa: BLE001 - reported, and compact() shows it in full
            warnings.warn(f"record store {self.location.url}: merging small part files after an "
                          f"append failed ({type(exc).__name__}: {exc}); the batch itself is saved. "
                          "Run RecordStore.compact() to see the full error", stacklevel=3)

    def compact(self, target: str | None = None, **settings: Any) -> CompactionStats:
        """Merge small part files (all targets, or one); keeps every row exactly once.

        Safe to run while writers append and readers query, and from several processes at once.
        Keyword settings are those of storage.compaction.CompactionSettings (grace_seconds: how long
        replaced files stay in <root>/_superseded/ before a compaction deletes them). Does nothing
        while a raw reader holds the store (hold_compactions(); stats.held says so).
        """
        options = CompactionSettings(**{"durable": self.durable, **settings})
        return compact(self.location, self._scanner, [target] if target else None, options)

    @contextmanager
    def hold_compactions(self, seconds: float = HOLD_SECONDS) -> Iterator[None]:
        """While the block runs (at most `seconds`), no compaction changes a record file, in any process
        or on any host: read the folder raw inside it, and each row appended before the block is counted
        exactly once and no listed file vanishes. Appends go on.

            with RecordStore("tuning-records").hold_compactions():
                frame = pd.read_parquet("tuning-records")

        Entering waits for compactions already under way (seconds at most); merging waits until the
        block ends. Queries through RecordStore need no hold. See storage.holds.
        """
        hold = take_hold(self.location, seconds)
        try:
            yield
        finally:
            release_hold(self.location, hold)

    # -- reading ---------------------------------------------------------------------------------------

    def read(self, *, target: str | None = None, workload_key: str | Sequence[str] | None = None,
             task_name: str | Sequence[str] | None = None, network: str | Sequence[str] | None = None,
             flow_run_id: str | Sequence[str] | None = None, since: datetime | None = None,
             until: datetime | None = None, columns: Sequence[str] | None = None) -> pd.DataFrame:
        """Records matching every given filter, oldest first (`since` inclusive, `until` exclusive)."""
        wanted = list(columns) if columns is not None else list(RECORD_COLUMNS)
        unknown = [c for c in wanted if c not in RECORD_COLUMNS]
        if unknown:
            raise ValueError(f"unknown record columns {unknown}; the columns are {list(RECORD_COLUMNS)}")
        filter = _all_of(_match("workload_key", workload_key), _match("task_name", task_name),
                         _match("network", network), _match("flow_run_id", flow_run_id),
                         _time_range(since, until))
        scan_columns = list(dict.fromkeys([*wanted, "timestamp"]))
        # no pruning of date= partitions by `since`: a partition is the day its file was written, and a
        # record's timestamp may be later (another host's clock, imported records); the filter skips
        # row groups by their timestamp statistics instead
        table = self._scanner.scan(scan_columns, filter, _targets(target))
        frame = table.to_pandas()
        frame = frame.sort_values("timestamp", kind="stable").reset_index(drop=True)
        return frame[wanted]

    def records_of(self, workload_key: str, target: str | None = None) -> pd.DataFrame:
        """Every record of one task (on one target, or on all), oldest first."""
        return self.read(workload_key=workload_key, target=target)

    def load_records(self, **filters: Any) -> list[MeasureRecord]:
        """MeasureRecords for read()'s filters, to resume a run or replay its history."""
        return frame_to_records(self.read(**filters))

    def best_per_task(self, network: str | None = None, target: str | None = None) -> pd.DataFrame:
        """The fastest successful record of each task (workload_key) on each target, among those since
        its newest re-timing (storage.queries.competing_mask), with the task's record and error counts
        (n_records, n_errors). `network` keeps only records measured for that network; a task's newest
        re-timing counts under whichever network's run made it (a timing from another night is stale
        for every reader, as resume and export-tvm have it). Tasks with no successful record are left
        out (see error_counts())."""
        network_filter = _match("network", network)
        candidates = self._scanner.scan(list(RECORD_COLUMNS),
                                        _all_of(ok_expression(), network_filter),
                                        _targets(target), leaders=True).to_pandas()
        candidates = self._competing(candidates, network_filter, target)
        best = candidates.iloc[best_positions(candidates, ["target", "workload_key"])]
        counted = self._scanner.scan(["target", "workload_key", "error_code"], network_filter,
                                     _targets(target))
        counts = task_counts(counted, ["target", "workload_key"])
        table = best.merge(counts, on=["target", "workload_key"], how="left")
        return table.sort_values(["target", "task_name", "workload_key"],
                                 kind="stable").reset_index(drop=True)

    def _competing(self, leaders: pd.DataFrame, network_filter: pc.Expression | None,
                   target: str | None) -> pd.DataFrame:
        """The best-record candidates under storage.queries.competing_mask: `leaders` as they are for
        tasks never re-timed; for a re-timed task, its successful records since its newest re-timing
        (of any network), read in full (a compaction's leaders are the best rows of each file, which may
        all be older)."""
        by = ["target", "workload_key"]
        retimings = self._scanner.scan([*by, "timestamp", "retiming"], pc.field("retiming"),
                                       _targets(target), leaders=True).to_pandas()     # compaction keeps them there
        if retimings.empty:
            return leaders
        recent = self._scanner.scan(list(RECORD_COLUMNS), _all_of(
            ok_expression(), network_filter, _match("workload_key", sorted(set(retimings["workload_key"]))),
            pc.field("timestamp") >= pa.scalar(retimings["timestamp"].min(), type=pa.timestamp("us", tz="UTC"))),
            _targets(target)).to_pandas()
        merged = pd.concat([leaders, recent], ignore_index=True).drop_duplicates("record_id")
        return merged[competing_mask(merged, by, retimings)].reset_index(drop=True)

    def history(self, task: str, *, target: str | None = None, network: str | None = None,
                per: str = "run") -> pd.DataFrame:
        """How the best latency of a task (its workload_key or its task_name) moved over time: one row
        per flow run (per="run") or per round (per="round"), oldest first, with `best_so_far`."""
        columns = ["target", "workload_key", "flow_run_id", "round", "task_name", "task_label", "network",
                   "timestamp", "mean_latency", "gflops", "error_code", "retiming"]
        rows = self._scanner.scan(columns, (pc.field("workload_key") == task) | (pc.field("task_name") == task),
                                  _targets(target)).to_pandas()
        # one read: the re-timings of every network count (as in best_per_task), the rows of `network` show
        retimings = rows[rows["retiming"].to_numpy(dtype=bool)]
        frame = rows if network is None else rows[rows["network"] == network]
        return history_table(frame, per, retimings)

    def runs(self, network: str | None = None, target: str | None = None) -> pd.DataFrame:
        """One row per flow run: time span, networks, targets, tasks, records and errors."""
        columns = ["flow_run_id", "timestamp", "network", "target", "workload_key", "error_code"]
        frame = self._scanner.scan(columns, _match("network", network), _targets(target)).to_pandas()
        return runs_table(frame)

    def error_counts(self, target: str | None = None, network: str | None = None,
                     per_task: bool = False) -> pd.DataFrame:
        """How many measurements ended with each error code (0 = NO_ERROR), per target (and task)."""
        by = ["target", "workload_key", "task_name"] if per_task else ["target"]
        frame = self._scanner.scan([*by, "error_code"], _match("network", network),
                                   _targets(target)).to_pandas()
        return error_table(frame, by)

    def measured_steps(self, workload_key: str, target: str) -> set[str]:
        """The step strings already measured for a task on a target, so a resumed run skips them."""
        table = self._scanner.scan(["steps"], pc.field("workload_key") == workload_key, [target])
        return set(table.column("steps").to_pylist())

    def training_frame(self, target: str | None = None,
                       workload_keys: Sequence[str] | None = None) -> pd.DataFrame:
        """Columns workload_key, steps, mean_latency, flops, error_code of every record (errors
        included: the trainer decides what to do with them), oldest first: files are listed in no time
        order (part files are named by uuid, compaction puts each task's best rows first), and a trainer
        that keeps a task's newest programs (search.training_set.training_rows) must know which they are.
        Records of one time keep their order in the files."""
        columns = ["workload_key", "steps", "mean_latency", "flops", "error_code"]
        table = self._scanner.scan([*columns, "timestamp"], _match("workload_key", workload_keys),
                                   _targets(target))
        frame = table.select([*columns, "timestamp"]).to_pandas()
        return frame.sort_values("timestamp", kind="stable", ignore_index=True)[columns]

    def iter_training_rows(self, target: str | None = None,
                           workload_keys: Sequence[str] | None = None) -> Iterator[TrainingRow]:
        """training_frame() as TrainingRow objects."""
        frame = self.training_frame(target, workload_keys)
        for key, steps, latency, flops, code in frame.itertuples(index=False, name=None):
            yield TrainingRow(str(key), str(steps), float(latency), float(flops), int(code))

    def targets(self) -> list[str]:
        """The targets that have records."""
        return sorted({f.target for f in self._scanner.snapshot()})

    def check(self) -> dict[str, str]:
        """Read every record file in full; {path: problem} for the bad ones, handled by on_bad_file."""
        files = self._scanner.snapshot()
        problems = find_bad_files(self.location, [f.path for f in files], deep=True)
        handle_bad_files(self.location, problems, self._scanner.on_bad_file)
        return problems


def _targets(target: str | None) -> list[str] | None:
    return [target] if target else None


def _match(column: str, value: str | Sequence[str] | None) -> pc.Expression | None:
    if value is None:
        return None
    if isinstance(value, str):
        return pc.field(column) == value
    return pc.field(column).isin(list(value))


def _utc(moment: datetime) -> datetime:
    if moment.tzinfo is None:
        raise ValueError(f"{moment!r} has no time zone; pass an aware time, e.g. "
                         "datetime(2026, 1, 1, tzinfo=timezone.utc)")
    return moment.astimezone(timezone.utc)


def _time_range(since: datetime | None, until: datetime | None) -> pc.Expression | None:
    parts = []
    if since is not None:
        parts.append(pc.field("timestamp") >= pa.scalar(_utc(since), pa.timestamp("us", tz="UTC")))
    if until is not None:
        parts.append(pc.field("timestamp") < pa.scalar(_utc(until), pa.timestamp("us", tz="UTC")))
    return _all_of(*parts)


def _all_of(*expressions: pc.Expression | None) -> pc.Expression | None:
    present = [e for e in expressions if e is not None]
    if not present:
        return None
    combined = present[0]
    for expression in present[1:]:
        combined = combined & expression
    return combined
