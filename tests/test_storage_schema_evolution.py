"""Part files written by an older schema (without the newer columns) still read, query and compact."""
from __future__ import annotations

import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tensortune.storage.records import RecordStore
from tensortune.storage.schema import COLUMN_DEFAULTS, SCHEMA_VERSION
from tensortune.storage.synthetic import row_multiset, synthetic_batch, workload_key

# What an older tensortune would not have written: the cost-model and FLOP columns.
NEWER = ["model_version", "predicted_score", "flops", "gflops", "latencies", "host", "num_threads", "task_label",
         "kernel"]


def _write_old_file(store: RecordStore, seed: int) -> str:
    """A part file as an older version wrote it: same layout, fewer columns, schema_version 0."""
    path = store.append(synthetic_batch(np.random.default_rng(seed), 12, tasks=3))
    table = pq.read_table(path).drop_columns(NEWER)
    index = table.column_names.index("schema_version")
    table = table.set_column(index, "schema_version", pa.array([0] * table.num_rows, pa.int32()))
    os.remove(path)
    pq.write_table(table, path)
    return path


def test_old_files_read_with_defaults(tmp_path):
    store = RecordStore(str(tmp_path), auto_compact=None)
    old = _write_old_file(store, 1)
    assert set(NEWER).isdisjoint(pq.read_schema(old).names)
    store.append(synthetic_batch(np.random.default_rng(2), 8, tasks=3))
    frame = store.read()
    assert len(frame) == 20
    olds = frame[frame["schema_version"] == 0]
    assert len(olds) == 12
    assert (olds["model_version"] == COLUMN_DEFAULTS["model_version"]).all()
    assert olds["predicted_score"].isna().all() and olds["flops"].isna().all()
    assert all(len(v) == 0 for v in olds["latencies"])
    assert (olds["host"] == "").all()
    assert (olds["num_threads"] == 0).all() and (olds["task_label"] == "").all() and (olds["kernel"] == "").all()
    news = frame[frame["schema_version"] == SCHEMA_VERSION]
    assert len(news) == 8 and (news["model_version"] != "").all() and (news["num_threads"] == 2).all()
    assert (news["task_label"] != "").all() and (news["kernel"].str.len() == 32).all()
    assert str(frame["round"].dtype) == "int32"  # defaults keep the column types
    records = store.load_records()  # and rows become MeasureRecords again
    assert len(records) == 20 and any(math.isnan(r.flops) for r in records)


def test_old_files_query_and_compact(tmp_path):
    store = RecordStore(str(tmp_path), auto_compact=None)
    for seed in range(3):
        _write_old_file(store, seed)
    store.append(synthetic_batch(np.random.default_rng(9), 8, tasks=3))
    before = store.read()
    best = store.best_per_task()
    assert len(best) == 3
    assert len(store.history(workload_key(0))) == 1
    store.compact()
    after = store.read()
    assert row_multiset(after) == row_multiset(before)
    assert best["record_id"].tolist() == store.best_per_task()["record_id"].tolist()
