"""A writer or compactor killed (SIGKILL) at any moment leaves a readable store with every finished
batch in it exactly once."""
from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import time
from dataclasses import replace

import numpy as np
import pandas as pd

from tensortune.storage.journal import Journal, read_journals, write_journal
from tensortune.storage.records import RecordStore
from tensortune.storage.synthetic import row_multiset, synthetic_batch

BATCH = 1500  # big enough that a kill often lands in the middle of writing a file


def _endless_writer(root: str, log: str, seed: int) -> None:
    # Most of the loop is the append itself (the batch is made once), so most kills land in it:
    # while the part file is being written, or while auto-compaction merges (auto_compact=3).
    store = RecordStore(root, auto_compact=3)
    template = synthetic_batch(np.random.default_rng(seed), BATCH, flow_run_id=f"seed-{seed}")
    round_ = 0
    while True:
        store.append([replace(r, record_id="", round=round_) for r in template])
        with open(log, "a") as out:
            out.write(f"{round_}\n")
        round_ += 1


def _finished_rounds(log: str) -> set[int]:
    if not os.path.exists(log):
        return set()
    with open(log) as handle:
        return {int(line) for line in handle.read().split()}


def test_killed_writer_loses_only_the_batch_in_flight(tmp_path):
    root = str(tmp_path / "records")
    context = multiprocessing.get_context("spawn")
    chooser = random.Random(1234)
    for seed in range(3):
        log = str(tmp_path / f"log-{seed}")
        child = context.Process(target=_endless_writer, args=(root, log, seed))
        child.start()
        deadline = time.monotonic() + 60
        while len(_finished_rounds(log)) < 2 + seed and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(chooser.uniform(0.0, 0.25))
        os.kill(child.pid, signal.SIGKILL)
        child.join()

        frame = RecordStore(root).read(columns=["record_id", "flow_run_id", "round"])
        assert frame["record_id"].is_unique
        mine = frame[frame["flow_run_id"] == f"seed-{seed}"]
        rows_per_round = mine.groupby("round").size()
        finished = _finished_rounds(log)
        assert len(finished) >= 2
        assert (rows_per_round == BATCH).all(), "a partly written batch became visible"
        assert finished <= set(rows_per_round.index), "a finished batch was lost"
        assert len(set(rows_per_round.index) - finished) <= 1  # the batch in flight, if its rename won


def _compact_once(root: str) -> None:
    RecordStore(root, auto_compact=None).compact(small_file_bytes=1 << 30)


def test_killed_compactor_keeps_every_row_once(tmp_path):
    root = str(tmp_path / "records")
    store = RecordStore(root, auto_compact=None, durable=False)
    rng = np.random.default_rng(0)
    for index in range(120):
        store.append(synthetic_batch(rng, 40, round=index))
    expected = row_multiset(store.read())
    context = multiprocessing.get_context("spawn")
    chooser = random.Random(99)
    for attempt in range(4):
        child = context.Process(target=_compact_once, args=(root,))
        child.start()
        time.sleep(chooser.uniform(0.3, 1.2))  # spawn start-up is ~0.3 s; the merge ~0.2-0.5 s
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert row_multiset(RecordStore(root).read()) == expected, f"attempt {attempt}"
        store.append(synthetic_batch(rng, 40, round=1000 + attempt))  # more small files for the next
        store.append(synthetic_batch(rng, 40, round=2000 + attempt))
        expected = row_multiset(store.read())
    store.compact(stale_seconds=0)  # the dead compactors' leftovers are cleaned up
    assert row_multiset(store.read()) == expected
    assert all(j.finished is not None for j in read_journals(store.location))  # tombstones only


def test_crash_between_commit_and_cleanup(tmp_path):
    """The merged file is visible but the inputs are not yet deleted: readers must not double count,
    and the next compaction finishes the job."""
    root = tmp_path / "records"
    store = RecordStore(str(root), auto_compact=None)
    rng = np.random.default_rng(1)
    paths = [store.append(synthetic_batch(rng, 10, round=i)) for i in range(5)]
    expected = row_multiset(store.read())
    saved = tmp_path / "saved"
    saved.mkdir()
    for path in paths:
        shutil.copy(path, saved / os.path.basename(path))
    store.compact()
    (output,) = [p for p in root.rglob("compact-*.parquet")]
    for path in paths:  # put the inputs back, as if the compactor died before deleting them
        shutil.copy(saved / os.path.basename(path), path)
    relative = lambda p: os.path.relpath(p, root)  # noqa: E731
    write_journal(store.location, Journal.new(relative(output), [relative(p) for p in paths]))
    assert row_multiset(store.read()) == expected
    assert len(pd.read_parquet(root)) == 2 * sum(expected.values())  # the raw files do hold both
    stats = store.compact()
    assert stats.recovered == 1
    assert all(not os.path.exists(p) for p in paths)
    assert row_multiset(store.read()) == expected


def test_stale_journal_temporaries_are_removed(tmp_path):
    store = RecordStore(str(tmp_path), auto_compact=None)
    folder = tmp_path / "_compactions"
    folder.mkdir()
    stale, fresh = folder / f".{'a' * 32}.json.0badf00d.tmp", folder / f".{'b' * 32}.json.0badf00d.tmp"
    for path in (stale, fresh):
        path.write_text('{"half": ')
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert store.compact().temporaries_removed == 1
    assert not stale.exists() and fresh.exists()
