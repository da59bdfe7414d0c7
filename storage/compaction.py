"""Merging small part files into large sorted ones without losing or duplicating a row.

Protocol for each group of inputs (one target/date partition): write a journal claiming the inputs, back
off if another compactor claimed any of them or a raw reader holds the store (storage.holds: the claim
is written before that look, which is what lets a hold wait for exactly the compactions that did not
see it), write the merged file atomically (the commit point), retire the inputs, mark the journal
finished (it stays a while as a tombstone for readers). Readers skip inputs whose journal's output exists
(see storage.journal), so a crash at any step leaves every row visible exactly once; the next
compaction finishes or abandons what a dead compactor left, and drops expired tombstones.

Retiring moves an input out of the dataset into `_superseded/`, where no reader of the dataset looks;
a later compaction deletes it once the grace period (`grace_seconds`, storage.superseded.GRACE_SECONDS
by default) has passed. For RecordStore readers a retired input is simply gone, as a deleted one was,
so the reasoning above is unchanged; what the grace period is for, and why raw readers also need a
hold, storage.superseded says.

The merged file's row group 0 holds the best successful row of each (workload_key, network) in it and
every re-timing row (storage.queries.competing_mask), the other rows follow sorted by workload_key then
time. The best-record query then reads one small row group per merged file (and, for a task timed again,
its rows since then), and one-task queries skip every row group whose workload_key range misses the task.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tensortune.storage.filesystem import Location, delete_quietly, exists, list_files, write_atomic
from tensortune.storage.holds import is_held, remove_expired_holds
from tensortune.storage.journal import (
    STALE_SECONDS,
    Journal,
    complete_journal,
    delete_journal,
    read_journals,
    write_journal,
)
from tensortune.storage.layout import COMPACTIONS_DIR, DataFile, classify, new_data_name, target_segment
from tensortune.storage.queries import best_positions
from tensortune.storage.scan import Scanner
from tensortune.storage.schema import FILE_SCHEMA, SCHEMA_VERSION
from tensortune.storage.superseded import GRACE_SECONDS, purge

LAYOUT_KEY = b"tensortune.layout"
LAYOUT_LEADERS = b"leaders-in-row-group-0"


@dataclass(frozen=True)
class CompactionSettings:
    """What counts as small, how big a merged file may grow, when a leftover counts as abandoned, and
    how long replaced files stay in `_superseded/` before a compaction deletes them."""

    small_file_bytes: int = 32 << 20
    max_input_bytes: int = 128 << 20  # inputs merged into one output (bounds memory: ~10x this)
    row_group_rows: int = 32_768
    stale_seconds: float = STALE_SECONDS
    durable: bool = True
    grace_seconds: float = GRACE_SECONDS

    def __post_init__(self) -> None:
        if self.grace_seconds < 0:
            raise ValueError(f"grace_seconds={self.grace_seconds}: a grace period cannot be negative")


@dataclass(frozen=True)
class CompactionStats:
    """What a compaction did."""

    input_files: int
    output_files: int
    rows: int
    bytes_before: int
    bytes_after: int
    seconds: float
    skipped_claimed: int  # groups left alone because another compactor holds them
    recovered: int  # journals of dead compactions finished or dropped
    temporaries_removed: int  # dead writers' temporaries, and holds of readers that died holding
    held: bool = False  # a raw reader's hold stopped it (storage.holds): what was left stays for later
    purged: int = 0  # replaced files deleted from _superseded/ after their grace period


def compact(location: Location, scanner: Scanner, targets: Sequence[str] | None = None,
            settings: CompactionSettings = CompactionSettings()) -> CompactionStats:
    """Merge the small record files of every target/date partition (or only `targets`)."""
    started = time.perf_counter()
    if is_held(location):
        return _nothing(started, held=True)
    recovered, claimed = _recover(location, settings)
    removed = _remove_stale_temporaries(location, settings) + remove_expired_holds(location)
    purged = purge(location, settings.grace_seconds)
    groups: dict[tuple[str, str], list[DataFile]] = defaultdict(list)
    for file in scanner.snapshot(targets):
        if file.size < settings.small_file_bytes and file.relative not in claimed:
            groups[(file.target, file.date)].append(file)
    return _merge_groups(location, scanner, list(groups.values()), settings, started, recovered,
                         removed, purged)


def compact_partition(location: Location, scanner: Scanner, target: str, day: str, min_files: int,
                      settings: CompactionSettings = CompactionSettings()) -> CompactionStats | None:
    """The cheap check made after an append: list one partition, and once it holds `min_files` part
    files merge them; likewise its small compaction outputs. None when there was nothing to do.

    Two tiers keep both the file count and the rewriting bounded: a row is rewritten about twice
    before a full compact() (tier one: part files; tier two: the small outputs of tier one).
    """
    started = time.perf_counter()
    folder = location.path(target_segment(target), f"date={day}")
    tiers = _tiers(location, folder, settings)
    if not any(len(tier) >= min_files for tier in tiers):
        return None
    if is_held(location):
        return _nothing(started, held=True)
    recovered, claimed = _recover(location, settings)
    purged = purge(location, settings.grace_seconds)
    tiers = [[f for f in tier if f.relative not in claimed] for tier in _tiers(location, folder, settings)]
    return _merge_groups(location, scanner, [t for t in tiers if len(t) >= min_files], settings,
                         started, recovered, 0, purged)


def _nothing(started: float, held: bool) -> CompactionStats:
    return CompactionStats(input_files=0, output_files=0, rows=0, bytes_before=0, bytes_after=0,
                           seconds=time.perf_counter() - started, skipped_claimed=0, recovered=0,
                           temporaries_removed=0, held=held)


def _tiers(location: Location, folder: str, settings: CompactionSettings) -> list[list[DataFile]]:
    files = classify(location, list_files(location, folder)).data
    return [[f for f in files if f.kind == "part"],
            [f for f in files if f.kind == "compact" and f.size < settings.small_file_bytes]]


def _merge_groups(location: Location, scanner: Scanner, groups: list[list[DataFile]],
                  settings: CompactionSettings, started: float, recovered: int,
                  removed: int, purged: int) -> CompactionStats:
    totals = dict(input_files=0, output_files=0, rows=0, bytes_before=0, bytes_after=0, skipped=0)
    held = False
    chunks = [chunk for files in groups
              for chunk in _chunks(sorted(files, key=lambda f: f.relative), settings.max_input_bytes)]
    for chunk in chunks:
        if len(chunk) < 2:
            continue
        done = _merge(location, scanner, chunk, settings)
        if done == "held":
            held = True
            break  # the rest would back off too: leave them to a compaction after the hold
        if isinstance(done, str):
            totals["skipped"] += 1
            continue
        rows, size = done
        totals["input_files"] += len(chunk)
        totals["output_files"] += 1
        totals["rows"] += rows
        totals["bytes_before"] += sum(f.size for f in chunk)
        totals["bytes_after"] += size
    return CompactionStats(input_files=totals["input_files"], output_files=totals["output_files"],
                           rows=totals["rows"], bytes_before=totals["bytes_before"],
                           bytes_after=totals["bytes_after"],
                           seconds=time.perf_counter() - started, skipped_claimed=totals["skipped"],
                           recovered=recovered, temporaries_removed=removed, held=held, purged=purged)


def _chunks(files: list[DataFile], max_bytes: int) -> list[list[DataFile]]:
    chunks: list[list[DataFile]] = [[]]
    size = 0
    for file in files:
        if chunks[-1] and size + file.size > max_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(file)
        size += file.size
    return chunks


def _recover(location: Location, settings: CompactionSettings) -> tuple[int, set[str]]:
    """Finish claims whose output exists, drop abandoned ones and expired tombstones; the inputs of live
    claims are claimed.

    Oldest first, and a tombstone outlives those of the compactions that made its inputs: a reader
    follows the chain input -> output -> merged output, so no link may vanish before the older ones.
    """
    recovered = 0
    claimed: set[str] = set()
    journals = sorted(read_journals(location), key=lambda j: j.created)
    made = {j.output for j in journals}
    for journal in journals:
        if journal.finished is not None:
            if journal.expired() and made.isdisjoint(journal.inputs):
                delete_journal(location, journal)
                made.discard(journal.output)
        elif exists(location, location.path(journal.output)):
            complete_journal(location, journal)
            recovered += 1
        elif journal.abandoned(settings.stale_seconds):
            delete_journal(location, journal)
            made.discard(journal.output)
            recovered += 1
        else:
            claimed.update(journal.inputs)
    return recovered, claimed


def _remove_stale_temporaries(location: Location, settings: CompactionSettings) -> int:
    """Delete writes in flight that are old enough to be surely dead (a writer or compactor killed
    mid-write): temporary part files, and temporary journals."""
    limit = time.time() - settings.stale_seconds
    removed = 0
    journals = [info for info in list_files(location, location.path(COMPACTIONS_DIR))
                if info.base_name.startswith(".") and info.base_name.endswith(".tmp")]
    for info in classify(location, list_files(location, location.root)).temporaries + journals:
        if info.mtime is not None and info.mtime.timestamp() < limit:
            removed += delete_quietly(location, info.path)
    return removed


def _merge(location: Location, scanner: Scanner, chunk: list[DataFile],
           settings: CompactionSettings) -> tuple[int, int] | str:
    """Merge `chunk` into one file; (rows, bytes) written, or why not: "claimed" (another compactor
    holds an input, or took us for dead) or "held" (a raw reader's hold: no file may change now)."""
    first = chunk[0]
    output = "/".join([target_segment(first.target), f"date={first.date}", new_data_name("compact")])
    journal = Journal.new(output, [f.relative for f in chunk])
    write_journal(location, journal)
    finished = False
    try:
        mine = set(journal.inputs)
        if any(other.id != journal.id and mine & set(other.inputs) for other in read_journals(location)):
            return "claimed"
        if is_held(location):  # after the claim is written: see storage.holds for why this order
            return "held"
        table = _read_inputs(scanner, chunk)
        if table is None:
            return "claimed"
        if not exists(location, journal.path(location)):
            return "claimed"  # someone took us for dead and dropped our claim: let them have the inputs
        size = write_atomic(location, location.path(output),
                            lambda out: _write_merged(table, out, settings.row_group_rows),
                            durable=settings.durable)
        complete_journal(location, journal)
        finished = True
        return table.num_rows, size
    finally:
        # A claim that never committed goes; one whose output exists stays while inputs may remain
        # (readers need it to skip them, and the next compaction retires them).
        if not finished and not exists(location, location.path(output)):
            delete_journal(location, journal)


def _read_inputs(scanner: Scanner, chunk: list[DataFile]) -> pa.Table | None:
    """All rows of `chunk`, or None if one of them vanished (someone else compacted it)."""
    try:
        table = scanner.read_files(chunk, list(FILE_SCHEMA.names))
    except FileNotFoundError:
        return None
    return table.select(FILE_SCHEMA.names).cast(FILE_SCHEMA)


def _write_merged(table: pa.Table, out: Any, row_group_rows: int) -> None:
    narrow = table.select(["workload_key", "network", "mean_latency", "error_code", "timestamp",
                           "record_id"]).to_pandas()
    leaders = best_positions(narrow, ["workload_key", "network"])
    is_leader = table.column("retiming").to_numpy(zero_copy_only=False).astype(bool)
    is_leader[leaders] = True
    head = table.filter(pa.array(is_leader))
    head = head.take(pc.sort_indices(head, [("workload_key", "ascending")]))
    rest = table.filter(pa.array(~is_leader))
    rest = rest.take(pc.sort_indices(rest, [("workload_key", "ascending"),
                                            ("timestamp", "ascending")]))
    schema = FILE_SCHEMA.with_metadata({LAYOUT_KEY: LAYOUT_LEADERS,
                                        b"tensortune.schema_version": str(SCHEMA_VERSION).encode()})
    with pq.ParquetWriter(out, schema, compression="zstd") as writer:
        writer.write_table(head, row_group_size=max(head.num_rows, 1))
        if rest.num_rows:
            writer.write_table(rest, row_group_size=row_group_rows)
