"""Compaction keeps the exact multiset of rows, and every query answers the same before and after."""
from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from tensortune.storage.journal import TOMBSTONE_SECONDS, Journal, read_journals, write_journal
from tensortune.storage.records import RecordStore
from tensortune.storage.synthetic import row_multiset, synthetic_batch, workload_key


def _filled(root: str, batches: int = 60, targets: tuple[str, ...] = ("llvm", "cuda")) -> RecordStore:
    store = RecordStore(root, auto_compact=None, durable=False)
    rng = np.random.default_rng(7)
    for index in range(batches):
        store.append(synthetic_batch(rng, 25, target=targets[index % len(targets)], tasks=6,
                                     flow_run_id=f"run-{index // 20}", round=index, error_rate=0.2))
    return store


def _data_files(root) -> list[str]:
    return sorted(str(p) for p in Path(root).rglob("*.parquet") if "_quarantine" not in str(p))


def test_compaction_keeps_the_exact_row_multiset(tmp_path):
    store = _filled(str(tmp_path))
    before = store.read()
    best_before = store.best_per_task()
    best_bert_before = store.best_per_task(network="bert-base")
    history_before = store.history(workload_key(1))
    errors_before = store.error_counts(per_task=True)
    steps_before = store.measured_steps(workload_key(2), "cuda")

    stats = store.compact()
    assert stats.input_files == 60 and stats.output_files == 2 and stats.rows == len(before)
    assert len(_data_files(tmp_path)) == 2
    after = store.read()
    assert row_multiset(after) == row_multiset(before)
    pd.testing.assert_frame_equal(store.best_per_task(), best_before)
    pd.testing.assert_frame_equal(store.best_per_task(network="bert-base"), best_bert_before)
    pd.testing.assert_frame_equal(store.history(workload_key(1)), history_before)
    pd.testing.assert_frame_equal(store.error_counts(per_task=True), errors_before)
    assert store.measured_steps(workload_key(2), "cuda") == steps_before

    again = store.compact()  # nothing small left: a no-op
    assert again.input_files == 0
    assert row_multiset(store.read()) == row_multiset(before)


def test_merged_file_layout(tmp_path):
    store = _filled(str(tmp_path), targets=("llvm",))
    store.compact()
    (path,) = _data_files(tmp_path)
    parquet = pq.ParquetFile(path)
    leaders = parquet.read_row_group(0).to_pandas()
    # Row group 0: one best row per (task, network); the rest sorted by task for row-group skipping.
    assert not leaders.duplicated(["workload_key", "network"]).any()
    assert (leaders["error_code"] == 0).all()
    rest = pd.concat([parquet.read_row_group(i).to_pandas() for i in range(1, parquet.num_row_groups)])
    assert rest["workload_key"].is_monotonic_increasing
    everything = pd.concat([leaders, rest])
    ok = everything[everything["error_code"] == 0]
    assert (leaders.set_index("workload_key")["mean_latency"].sort_index()
            == ok.groupby("workload_key")["mean_latency"].min().sort_index()).all()


def test_appends_during_and_after_compaction_are_kept(tmp_path):
    store = _filled(str(tmp_path), batches=20)
    rng = np.random.default_rng(3)
    store.compact()
    store.append(synthetic_batch(rng, 10, target="llvm", round=500))
    store.append(synthetic_batch(rng, 10, target="llvm", round=501))
    assert len(store.read()) == 20 * 25 + 20
    store.compact()
    assert len(store.read()) == 20 * 25 + 20
    # A merged file that is still small is merged again with newer part files.
    assert len(_data_files(tmp_path)) == 2


def _compact(root: str) -> None:
    RecordStore(root, auto_compact=None).compact(small_file_bytes=1 << 30)


def test_parallel_compactors_never_duplicate(tmp_path):
    store = _filled(str(tmp_path), batches=80)
    expected = row_multiset(store.read())
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_compact, args=(str(tmp_path),)) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    assert row_multiset(store.read()) == expected
    store.compact(small_file_bytes=1 << 30)
    assert row_multiset(store.read()) == expected
    assert len(_data_files(tmp_path)) == 2
    journals = read_journals(store.location)  # no claim is left behind, only tombstones
    assert journals and all(j.finished is not None for j in journals)
    _age_tombstones(store)
    store.compact(small_file_bytes=1 << 30)
    assert not os.listdir(tmp_path / "_compactions")
    assert row_multiset(store.read()) == expected


def _age_tombstones(store: RecordStore, seconds: float = 2 * TOMBSTONE_SECONDS) -> None:
    for journal in read_journals(store.location):
        write_journal(store.location, replace(journal, finished=journal.finished - seconds))


def test_tombstones_expire_oldest_link_first(tmp_path):
    # a -> c, then c -> d: a reader follows a to d through both journals, so the second may not go
    # while the first stays, even when it is older than the tombstone life.
    store = RecordStore(str(tmp_path), auto_compact=None)
    d = os.path.relpath(store.append(synthetic_batch(np.random.default_rng(0), 5)), tmp_path)
    folder = os.path.dirname(d)
    now = time.time()
    first = Journal(id="1" * 32, output=f"{folder}/c", inputs=(f"{folder}/a",), created=now - 300,
                    finished=now - 10)
    second = Journal(id="2" * 32, output=d, inputs=(f"{folder}/c",), created=now - 200,
                     finished=now - 2 * TOMBSTONE_SECONDS)
    for journal in (first, second):
        write_journal(store.location, journal)
    store.compact()
    assert {j.id for j in read_journals(store.location)} == {first.id, second.id}
    write_journal(store.location, replace(first, finished=now - 2 * TOMBSTONE_SECONDS))
    store.compact()
    assert read_journals(store.location) == []
    assert len(store.read()) == 5


def test_auto_compaction_bounds_the_file_count(tmp_path):
    store = RecordStore(str(tmp_path), auto_compact=4, durable=False)
    rng = np.random.default_rng(5)
    for index in range(40):
        store.append(synthetic_batch(rng, 5, round=index))
    files = _data_files(tmp_path)
    parts = [f for f in files if os.path.basename(f).startswith("part-")]
    assert len(parts) < 4 and len(files) < 8
    assert len(store.read()) == 200


def test_compaction_settings_are_checked(tmp_path):
    with pytest.raises(TypeError):
        RecordStore(str(tmp_path)).compact(no_such_setting=1)
    with pytest.raises(ValueError, match="auto_compact"):
        RecordStore(str(tmp_path), auto_compact=1)
