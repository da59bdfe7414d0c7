"""The tasks behind the records, one file per workload key beside them.

    <root>/_tasks/<workload_key>.json    {"workload_key", "task" (its description, opaque here), "name", "label"}

A record names its task by workload key, a hash, so a record alone cannot be turned back into a program.
A cost model that learns from every stored record of a target (all networks, all nights: issue 19's
transfer) must rebuild each record's program, and for that it needs the task; the tuners write it here
the first time they store a record of it.

The key is a hash of the task's computation, so one key means one task: a file, once written, is never
written again (the first writer wins, and any later one would write the same computation). Each file
is written atomically (storage.filesystem.write_atomic), so a reader sees a whole description or none;
a crash leaves at most a temporary file, which `descriptions` never reads. The folder starts with '_',
which pandas, pyarrow and DuckDB readers of the records skip, as they skip `_models`.
"""
from __future__ import annotations

import json
import re
from typing import Any

from tensortune.storage.filesystem import Location, exists, list_files, open_location, read_bytes, write_atomic
from tensortune.storage.layout import TASKS_DIR

_NAME = re.compile(r"^(?P<key>[0-9A-Za-z_\-]{1,200})\.json$")


class TaskStore:
    """`TaskStore("./tuning-records")`: the task descriptions of a record store (the same URL)."""

    def __init__(self, url_or_path: str = "./tuning-records", *, filesystem: Any = None, durable: bool = True):
        self.location: Location = open_location(url_or_path, filesystem)
        self.durable = durable

    def __repr__(self) -> str:
        return f"TaskStore({self.location.url!r})"

    def add(self, workload_key: str, description: str, name: str = "", label: str = "") -> bool:
        """Store the task of `workload_key` unless it is there already; True when this call wrote it."""
        if not _NAME.match(f"{workload_key}.json"):
            raise ValueError(f"workload key {workload_key!r} cannot name a file (letters, digits, '_' and '-' only)")
        path = self.location.path(TASKS_DIR, f"{workload_key}.json")
        if exists(self.location, path):
            return False
        doc = {"workload_key": workload_key, "task": description, "name": name, "label": label}
        write_atomic(self.location, path, json.dumps(doc).encode(), durable=self.durable)
        return True

    def descriptions(self) -> dict[str, str]:
        """workload_key -> the stored description, for every task stored whole."""
        out: dict[str, str] = {}
        for info in list_files(self.location, self.location.path(TASKS_DIR)):
            match = _NAME.match(info.base_name)
            if match is None:
                continue                       # a write in flight ('.name.rand.tmp') or a stranger
            try:
                doc = json.loads(read_bytes(self.location, info.path))
                out[str(doc["workload_key"])] = str(doc["task"])
            except (ValueError, KeyError, FileNotFoundError):
                continue                       # not ours: never a reason to fail a training
        return out
