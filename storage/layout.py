"""The folder layout of a record store, and sorting a listing into our files, temporaries and strangers.

    <root>/target=<uri-quoted target>/date=YYYY-MM-DD/part-<uuid hex>.parquet      one append
    <root>/target=<uri-quoted target>/date=YYYY-MM-DD/compact-<uuid hex>.parquet   one compaction output
    <root>/target=.../date=.../.<name>.<rand>.tmp                                  a write in flight
    <root>/_compactions/<uuid hex>.json                                            a compaction journal
    <root>/_superseded/<seconds>-<uuid hex>/target=.../part-....parquet.superseded  replaced by a compaction
    <root>/_holds/<uuid hex>.json                                                  a raw reader's hold
    <root>/_models/..., <root>/_tasks/..., <root>/_features/..., <root>/_quarantine/...  not records

Hive style, so `pandas.read_parquet(root)` and pyarrow read it as is (they skip names starting with '.' or
'_', as we do). `date` is the UTC day the file was written. Targets are URI-quoted (pyarrow's hive
default), so any target string survives the round trip through a folder name.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import date
from urllib.parse import quote, unquote

import pyarrow.fs as pafs

from tensortune.storage.filesystem import Location

COMPACTIONS_DIR = "_compactions"
SUPERSEDED_DIR = "_superseded"
HOLDS_DIR = "_holds"
QUARANTINE_DIR = "_quarantine"
MODELS_DIR = "_models"
TASKS_DIR = "_tasks"
FEATURES_DIR = "_features"

_DATA_NAME = re.compile(r"^(?P<kind>part|compact)-[0-9a-f]{32}\.parquet$")
_TEMP_NAME = re.compile(r"^\.(part|compact)-[0-9a-f]{32}\.parquet\.[0-9a-f]{8}\.tmp$")
_DATE_DIR = re.compile(r"^date=(\d{4}-\d{2}-\d{2})$")
_MAX_SEGMENT = 250  # most filesystems allow 255 bytes per name


@dataclass(frozen=True)
class DataFile:
    """One Parquet file of records: an append's part file or a compaction's output."""

    path: str
    relative: str
    target: str
    date: str
    kind: str  # "part" or "compact"
    size: int


@dataclass(frozen=True)
class Listing:
    """A store folder sorted out: record files, writes in flight, and files that are none of ours."""

    data: list[DataFile]
    temporaries: list[pafs.FileInfo]
    foreign: list[str]


def target_segment(target: str) -> str:
    """The folder name of a target's partition."""
    if not target:
        raise ValueError("a record's target is empty: set MeasureRecord.target (e.g. 'llvm -mcpu=native')")
    segment = "target=" + quote(target, safe="")
    if len(segment.encode()) > _MAX_SEGMENT:
        raise ValueError(f"target {target!r} is too long for a folder name once quoted "
                         f"({len(segment)} bytes, at most {_MAX_SEGMENT}); shorten the target string")
    return segment


def date_segment(day: date) -> str:
    """The folder name of a day's partition."""
    return f"date={day.isoformat()}"


def new_data_name(kind: str) -> str:
    """A fresh, collision-free file name for a part file ("part") or a compaction output ("compact")."""
    return f"{kind}-{uuid.uuid4().hex}.parquet"


def classify(location: Location, infos: list[pafs.FileInfo]) -> Listing:
    """Sort the files under a store root (or under one target's folder) into a Listing."""
    data: list[DataFile] = []
    temporaries: list[pafs.FileInfo] = []
    foreign: list[str] = []
    targets: dict[str, str] = {}  # unquoting is the slow part of this loop: once per folder
    for info in infos:
        relative = location.relative(info.path)
        parts = relative.split("/")
        if _TEMP_NAME.match(parts[-1]) and len(parts) == 3:
            temporaries.append(info)
            continue
        if any(part.startswith((".", "_")) for part in parts):
            continue  # hidden or private (ours or a tool's), skipped by every Parquet reader too
        found = _data_file(info, relative, parts, targets)
        if found is None:
            foreign.append(info.path)
        else:
            data.append(found)
    return Listing(data=data, temporaries=temporaries, foreign=foreign)


def _data_file(info: pafs.FileInfo, relative: str, parts: list[str],
               targets: dict[str, str]) -> DataFile | None:
    if len(parts) != 3 or not parts[0].startswith("target=") or len(parts[0]) == len("target="):
        return None
    day = _DATE_DIR.match(parts[1])
    name = _DATA_NAME.match(parts[2])
    if day is None or name is None:
        return None
    target = targets.get(parts[0])
    if target is None:
        target = targets[parts[0]] = unquote(parts[0][len("target="):])
    return DataFile(path=info.path, relative=relative, target=target,
                    date=day.group(1), kind=name.group("kind"), size=int(info.size or 0))
