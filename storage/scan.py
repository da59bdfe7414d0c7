"""Reading a store: take a consistent snapshot of its record files and scan them with pyarrow.

Files are immutable once visible, so a snapshot is a listing minus the inputs of compactions whose
output is already there; a listing that overlapped a compaction and missed rows is taken again (see
storage.journal). A file that vanishes mid-scan (a compaction finished) means: list again and retry.
Every scan also reads `schema_version`, which every record file has: a row where it is null came
from a Parquet file that is not ours, and is reported rather than dropped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from tensortune.storage.filesystem import Location, exists, list_files
from tensortune.storage.integrity import find_bad_files, handle_bad_files
from tensortune.storage.journal import MAX_LISTING_SECONDS, read_journals, resolve
from tensortune.storage.layout import DataFile, classify, target_segment
from tensortune.storage.schema import DATASET_SCHEMA, fill_missing_columns

_SENTINEL = "schema_version"
_ATTEMPTS = 12


def _back_off(attempt: int) -> None:
    """Let the compaction we overlapped finish: 20 ms, 40 ms, ... then 1 s, about 6 s over all attempts
    (four writers merging every few files on two cores outlasted eight quick retries)."""
    time.sleep(min(1.0, 0.01 * 2 ** attempt))


class StoreChangedError(RuntimeError):
    """The store's files kept changing under a query (compactions finishing in a tight loop)."""


@dataclass(frozen=True)
class Snapshot:
    """The record files a query reads, and the foreign files found beside them."""

    files: list[DataFile]
    foreign: list[str]


class Scanner:
    """Lists and scans one store's record files; bad files are handled by the `on_bad_file` policy."""

    def __init__(self, location: Location, on_bad_file: str = "raise"):
        self.location = location
        self.on_bad_file = on_bad_file
        self._format = ds.ParquetFileFormat()

    def snapshot(self, targets: Sequence[str] | None = None) -> list[DataFile]:
        """The record files that count now (all targets, or only `targets`); bad files are handled."""
        for _ in range(_ATTEMPTS):
            snap = self._list(targets)
            if not snap.foreign:
                return snap.files
            handle_bad_files(self.location, {p: "not a tensortune record file (unexpected name or "
                                             "place; record files are target=<t>/date=<YYYY-MM-DD>/"
                                             "part-<id>.parquet)" for p in snap.foreign},
                             self.on_bad_file)
        raise StoreChangedError(f"foreign files keep appearing in {self.location.url}")

    def _list(self, targets: Sequence[str] | None) -> Snapshot:
        slow = False
        for attempt in range(_ATTEMPTS):
            if attempt:
                _back_off(attempt)
            started = time.monotonic()
            if targets is None:
                infos = list_files(self.location, self.location.root)
            else:
                segments = [target_segment(target) for target in dict.fromkeys(targets)]
                infos = [info for segment in segments
                         for info in list_files(self.location, self.location.path(segment))]
            listing = classify(self.location, infos)
            present = {f.relative for f in listing.data}
            journals = read_journals(self.location)
            if targets is not None:  # a compaction stays in its partition: only those of ours count
                journals = [j for j in journals if j.output.split("/", 1)[0] in segments]
            view = resolve(journals, present,
                           lambda relative: exists(self.location, self.location.path(relative)))
            slow = time.monotonic() - started >= MAX_LISTING_SECONDS
            if not view.torn and not slow:
                return Snapshot(files=[f for f in listing.data if f.relative not in view.skip],
                                foreign=listing.foreign)
        if slow:
            raise StoreChangedError(
                f"listing {self.location.url} takes over {MAX_LISTING_SECONDS:.0f} s, too long to be "
                "sure no compaction was missed: run RecordStore.compact() to merge its small files")
        raise StoreChangedError(f"listings of {self.location.url} kept overlapping compactions; try "
                                "again when they have finished")

    def scan(self, columns: Sequence[str], filter: pc.Expression | None = None,
             targets: Sequence[str] | None = None, leaders: bool = False) -> pa.Table:
        """Rows of the matching files, with `columns` (missing-in-old-files columns defaulted).

        `leaders` reads only row group 0 of compaction outputs: the best row of each (task, network)
        in that file and its re-timing rows, which is all the best-record query needs to start from.
        """
        for attempt in range(_ATTEMPTS):
            if attempt:
                _back_off(attempt)
            files = self.snapshot(targets)
            try:
                table = self._scan(files, columns, filter, leaders)
            except (pa.ArrowException, OSError):
                if self._vanished(files, targets):
                    continue
                problems = find_bad_files(self.location, [f.path for f in files], deep=True)
                if not problems:
                    raise
                handle_bad_files(self.location, problems, self.on_bad_file)
                continue
            if table.column(_SENTINEL).null_count:
                problems = find_bad_files(self.location, [f.path for f in files], deep=False)
                if not problems and not self._vanished(files, targets):
                    raise RuntimeError(f"rows without schema_version in {self.location.url}, yet every "
                                       "file checks out: please report this")
                handle_bad_files(self.location, problems, self.on_bad_file)
                continue
            if _SENTINEL not in columns:
                table = table.drop_columns([_SENTINEL])
            return fill_missing_columns(table)
        raise StoreChangedError(f"the files of {self.location.url} kept changing during a query; "
                                "try again when compactions have finished")

    def read_files(self, files: list[DataFile], columns: Sequence[str]) -> pa.Table:
        """All rows of exactly `files` (compaction's inputs). FileNotFoundError when one of them is
        gone (compacted by someone else, or quarantined here): the caller should leave them alone."""
        try:
            table = self._scan(files, columns, None, False)
        except (pa.ArrowException, OSError) as exc:
            if self._vanished(files, None):
                raise FileNotFoundError("an input file vanished during the read") from exc
            problems = find_bad_files(self.location, [f.path for f in files], deep=True)
            if not problems:
                raise
            handle_bad_files(self.location, problems, self.on_bad_file)
            raise FileNotFoundError("bad input files were quarantined") from exc
        if table.column(_SENTINEL).null_count:
            problems = find_bad_files(self.location, [f.path for f in files], deep=False)
            if not problems:
                raise RuntimeError(f"rows without schema_version in {[f.path for f in files]}, yet "
                                   "every file checks out: please report this")
            handle_bad_files(self.location, problems, self.on_bad_file)
            raise FileNotFoundError("foreign input files were quarantined")
        if _SENTINEL not in columns:
            table = table.drop_columns([_SENTINEL])
        return fill_missing_columns(table)

    def _scan(self, files: list[DataFile], columns: Sequence[str], filter: pc.Expression | None,
              leaders: bool) -> pa.Table:
        wanted = list(dict.fromkeys([*columns, _SENTINEL]))
        fragments = [self._fragment(f, leaders) for f in files]
        dataset = ds.FileSystemDataset(fragments, schema=DATASET_SCHEMA, format=self._format,
                                       filesystem=self.location.fs)
        if filter is not None:
            filter = filter | pc.is_null(pc.field(_SENTINEL))
        return dataset.to_table(columns=wanted, filter=filter)

    def _fragment(self, file: DataFile, leaders: bool) -> ds.Fragment:
        partition = (pc.field("target") == file.target) & (pc.field("date") == file.date)
        row_groups = [0] if leaders and file.kind == "compact" else None
        return self._format.make_fragment(file.path, filesystem=self.location.fs,
                                          partition_expression=partition, row_groups=row_groups,
                                          file_size=file.size or None)

    def _vanished(self, files: list[DataFile], targets: Sequence[str] | None) -> bool:
        now = {f.path for f in self._list(targets).files}
        return any(f.path not in now for f in files)


def empty_table(columns: Sequence[str]) -> pa.Table:
    """A table with no rows and the dataset's types for `columns`."""
    return pa.schema([DATASET_SCHEMA.field(c) for c in columns]).empty_table()
