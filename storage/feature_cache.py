"""Cost-model features of stored programs, kept beside the records so that a restart does not compute
them again.

    <root>/_features/<code digest>/<uuid hex>.features   Parquet: task digest, steps digest, a float32 matrix

Why: a tuning run's first retrain featurises every stored program of its target (every network, every
night: the model transfers across tasks), and a store grows every night. The 6000 programs of a
ResNet-50 store took 16-18 s to replay and featurise on the Xeon VM, before the run's first round, and
every later night pays it again for a larger store.

What is stored is a pure function of three things: the task's description, the program's steps and the
code that computes features. The first two are the row's key (as digests, `digest`); the third names the
folder (the caller's digest of that code, search.feature_pool.feature_code_digest), so a change of the
code starts an empty cache and never serves the old numbers. The files are Parquet but not named
`.parquet` (as superseded record files are renamed): a reader of the records that globs
`tuning-records/**/*.parquet` (DuckDB) must not meet them.

Crash safety: this is a cache, never a record; losing any of it costs only the time to compute it
again. Each file is written whole or not at all (storage.filesystem.write_atomic; not fsynced, as a file
lost to a power cut is recomputed); a file that cannot be read is passed over and its programs are
featurised again. A save writes a file of its own (a flow saves once per retrain, so once a round), and
`load` merges the files when there are more than MERGE_AT: it writes their union as one new file first
and deletes the old ones after, so a reader listing in between sees some entries twice (the same key,
the same matrix) or misses a file just deleted (recomputes those features), never a wrong matrix. A
merge drops the files it could not read with the rest.
"""
from __future__ import annotations

import hashlib
import uuid
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tensortune.storage.filesystem import Location, delete_quietly, list_files, open_location, read_bytes, write_atomic
from tensortune.storage.layout import FEATURES_DIR

MERGE_AT = 16           # files of one code digest that `load` merges into one
SUFFIX = ".features"
_SCHEMA = pa.schema([("task", pa.string()), ("steps", pa.string()), ("rows", pa.int32()),
                     ("width", pa.int32()), ("data", pa.binary())])

Key = tuple[str, str]   # (task digest, steps digest)


def digest(text: str) -> str:
    """A short, collision-safe name of a task's description or a program's steps (128-bit BLAKE2b)."""
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class FeatureCache:
    """`FeatureCache("./tuning-records", code)`: the stored features of one feature code, by (task, steps)."""

    def __init__(self, url_or_path: str, code: str, *, filesystem: Any = None):
        if not code or not code.isalnum():
            raise ValueError(f"the code digest names a folder: letters and digits only, got {code!r}")
        self.location: Location = open_location(url_or_path, filesystem)
        self.folder = self.location.path(FEATURES_DIR, code)

    def __repr__(self) -> str:
        return f"FeatureCache({self.location.url!r}, {self.folder.rsplit('/', 1)[1]!r})"

    def load(self) -> dict[Key, np.ndarray]:
        """Every stored matrix of this code (read-only float32 arrays [stores, features]); merges the
        files into one when there are more than MERGE_AT."""
        infos = [i for i in list_files(self.location, self.folder) if i.base_name.endswith(SUFFIX)
                 and not i.base_name.startswith(".")]
        out: dict[Key, np.ndarray] = {}
        for info in infos:
            out.update(_entries(self.location, info.path))
        if len(infos) > MERGE_AT and out:
            try:
                self.save(out)
            except OSError:
                return out                   # a store this process may read but not write: unmerged
            for info in infos:
                try:
                    delete_quietly(self.location, info.path)
                except OSError:
                    break                        # left in place: their entries are in the merged file too
        return out

    def save(self, entries: Mapping[Key, np.ndarray]) -> None:
        """Store `entries` as one new file (nothing when empty)."""
        if not entries:
            return
        mats = [np.ascontiguousarray(m, dtype=np.float32) for m in entries.values()]
        table = pa.table({"task": [k[0] for k in entries], "steps": [k[1] for k in entries],
                          "rows": pa.array([m.shape[0] for m in mats], pa.int32()),
                          "width": pa.array([m.shape[1] for m in mats], pa.int32()),
                          "data": pa.array([m.tobytes() for m in mats], pa.binary())}, schema=_SCHEMA)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        write_atomic(self.location, f"{self.folder}/{uuid.uuid4().hex}{SUFFIX}", sink.getvalue(), durable=False)


def _entries(location: Location, path: str) -> dict[Key, np.ndarray]:
    """One file's matrices; nothing from a file that is gone, cannot be read or is not ours."""
    try:
        table = pq.read_table(pa.BufferReader(read_bytes(location, path)))
        cols = [table.column(n).to_pylist() for n in ("task", "steps", "rows", "width", "data")]
    except (OSError, pa.ArrowException, KeyError):
        return {}
    out: dict[Key, np.ndarray] = {}
    for task, steps, rows, width, data in zip(*cols):
        if not isinstance(data, bytes) or rows is None or width is None or len(data) != 4 * rows * width:
            continue
        out[(task, steps)] = np.frombuffer(data, np.float32).reshape(rows, width)
    return out
