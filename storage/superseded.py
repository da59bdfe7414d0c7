"""Files a compaction replaced: moved out of the dataset into `<root>/_superseded/`, deleted after a grace period.

A compaction retires its inputs once its output is visible. It moves them instead of deleting them:

    <root>/_superseded/<unix seconds>-<journal id>/target=.../date=.../part-<id>.parquet.superseded

and a later compaction deletes each such folder once it is older than the grace period (GRACE_SECONDS
unless CompactionSettings.grace_seconds says otherwise). The new place is invisible to every reader of
the dataset: pyarrow and pandas skip folders starting with '_' (as storage.layout does), and the
`.superseded` ending matches no `*.parquet` glob (DuckDB's `read_parquet('<root>/**/*.parquet')`,
polars' `scan_parquet`). So the retired rows are never counted twice, however long they linger.

What the grace period buys, and what it cannot. On local and network file systems a reader that has
already opened a file keeps reading it: a rename leaves the file itself alone, where a delete breaks
such a reader on NFS (another client's unlink frees the file and turns its handle stale). On every
store, the replaced bytes stay a while for anyone who needs to see what a compaction replaced (on
object stores a move is a copy and a delete, so an open read of the old object ends there too). But a
reader that has *listed* a file and not yet opened it finds the path gone either way: a path in a
listing is the only name a reader can open, so no placement of a replaced file keeps its old path
openable and out of new listings at once. Raw readers that list and then open (pandas, pyarrow,
DuckDB on the folder) therefore read inside a hold (storage.holds), during which nothing is retired.
"""
from __future__ import annotations

import re
import time
from typing import Sequence

import pyarrow.fs as pafs

from tensortune.storage.filesystem import Location, exists, move
from tensortune.storage.layout import SUPERSEDED_DIR

GRACE_SECONDS = 600.0
SUFFIX = ".superseded"

_FOLDER = re.compile(r"^(?P<stamp>\d+)-[0-9a-f]{32}$")


def retire(location: Location, journal_id: str, inputs: Sequence[str]) -> int:
    """Move the compaction inputs `inputs` (paths relative to the root) that are still in the dataset
    into this compaction's superseded folder; how many were moved. Inputs already gone (moved by the
    compactor before us, or by a reader finishing a dead compactor's work) are skipped, so finishing a
    compaction twice is harmless."""
    folder = f"{int(time.time())}-{journal_id}"
    moved = 0
    for relative in inputs:
        source = location.path(relative)
        try:
            move(location, source, location.path(SUPERSEDED_DIR, folder, relative + SUFFIX))
        except FileNotFoundError:
            continue
        except OSError:
            if exists(location, source):
                raise
            continue  # gone meanwhile: some filesystems report that as a generic error
        moved += 1
    return moved


def purge(location: Location, grace_seconds: float = GRACE_SECONDS) -> int:
    """Delete the superseded folders older than `grace_seconds`; how many files they held."""
    limit = time.time() - grace_seconds
    selector = pafs.FileSelector(location.path(SUPERSEDED_DIR), recursive=False, allow_not_found=True)
    removed = 0
    for info in location.fs.get_file_info(selector):
        found = _FOLDER.match(info.base_name)
        if found is None or int(found.group("stamp")) >= limit:
            continue  # not ours (left alone), or still in its grace period
        files = location.fs.get_file_info(pafs.FileSelector(info.path, recursive=True,
                                                            allow_not_found=True))
        removed += sum(f.type == pafs.FileType.File for f in files)
        try:
            location.fs.delete_dir(info.path)
        except FileNotFoundError:
            continue  # another compactor purged it first
    return removed
