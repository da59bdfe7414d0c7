"""Raw readers of the store's folder (pandas, pyarrow, DuckDB) under concurrent tuning: writers appending,
compactions merging, a raw reader looping pd.read_parquet inside hold_compactions(): 0 errors, 0 rows
lost, 0 rows counted twice. Replaced files wait out a grace period in _superseded/, where no reader looks.

The fault a hold prevents is shown first, deterministically: a raw listing, a compaction, then the
reads of what was listed."""
from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pytest

from tensortune.storage.holds import take_hold
from tensortune.storage.journal import Journal, read_journals, write_journal
from tensortune.storage.records import RecordStore
from tensortune.storage.synthetic import row_multiset, synthetic_batch

WRITERS = 3
BATCHES = 20
BATCH = 16


def _small_files(root: Path, files: int = 8, rows: int = 10) -> RecordStore:
    store = RecordStore(str(root), auto_compact=None, durable=False)
    rng = np.random.default_rng(0)
    for index in range(files):
        store.append(synthetic_batch(rng, rows, round=index))
    return store


def _superseded(root: Path) -> list[Path]:
    return sorted(p for p in (root / "_superseded").rglob("*") if p.is_file())


def test_a_raw_listing_outlives_a_compaction_only_inside_a_hold(tmp_path):
    store = _small_files(tmp_path)
    listed = ds.dataset(str(tmp_path), partitioning="hive")       # what pd.read_parquet does first
    assert store.compact().input_files == 8
    with pytest.raises(FileNotFoundError):                         # ...and then it opens the files
        listed.to_table()

    store = _small_files(tmp_path / "held")
    with store.hold_compactions():
        listed = ds.dataset(str(tmp_path / "held"), partitioning="hive")
        stats = store.compact()
        assert stats.held and stats.input_files == 0
        assert listed.to_table().num_rows == 80
        assert store.append(synthetic_batch(np.random.default_rng(1), 10, round=99))  # appends go on
    assert not list((tmp_path / "held" / "_holds").iterdir())     # the hold is gone with the block
    assert store.compact().input_files == 9                        # merging resumes after it
    assert len(pd.read_parquet(tmp_path / "held")) == 90


def test_replaced_files_wait_out_the_grace_period_where_no_reader_looks(tmp_path):
    store = _small_files(tmp_path)
    expected = row_multiset(store.read())
    assert store.compact().input_files == 8
    retired = _superseded(tmp_path)
    assert len(retired) == 8 and all(p.name.endswith(".parquet.superseded") for p in retired)
    assert row_multiset(pd.read_parquet(tmp_path)) == expected     # pandas does not count them
    glob = str(tmp_path / "**" / "*.parquet")
    assert duckdb.sql(f"select count(*) from read_parquet('{glob}')").fetchall() == [(80,)]  # nor DuckDB
    assert row_multiset(store.read()) == expected

    store.append(synthetic_batch(np.random.default_rng(2), 10, round=50))
    store.append(synthetic_batch(np.random.default_rng(3), 10, round=51))
    again = store.compact()                                        # the default grace: 10 minutes
    assert again.input_files == 3 and again.purged == 0
    assert len(_superseded(tmp_path)) == 11
    assert store.compact(grace_seconds=0).purged == 11             # a later compaction deletes them
    assert _superseded(tmp_path) == [] and len(store.read()) == 100


def test_a_hold_finishes_a_dead_compactors_commit_and_waits_for_a_live_one(tmp_path):
    store = _small_files(tmp_path, files=4)
    expected = row_multiset(store.read())
    inputs = {p: p.read_bytes() for p in tmp_path.rglob("part-*.parquet")}
    store.compact()
    (output,) = tmp_path.rglob("compact-*.parquet")
    for path, data in inputs.items():  # the inputs back in place: a compactor died after its commit
        path.write_bytes(data)
    dead = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    relative = lambda p: os.path.relpath(p, tmp_path)  # noqa: E731
    claim = Journal(id="d" * 32, output=relative(output), inputs=tuple(relative(p) for p in inputs),
                    pid=dead.pid)
    write_journal(store.location, claim)
    assert len(pd.read_parquet(tmp_path)) == 2 * len(store.read())   # a raw reader would count twice
    with store.hold_compactions():                                   # no compaction will run now...
        assert row_multiset(pd.read_parquet(tmp_path)) == expected   # ...so the hold finished it
    assert all(not p.exists() for p in inputs)
    (finished,) = [j for j in read_journals(store.location) if j.id == claim.id]
    assert finished.finished is not None

    live = Journal.new(relative(output).replace("compact-", "compact-0"), [relative(output)])
    write_journal(store.location, live)                              # a claim of this (live) process
    with pytest.raises(TimeoutError, match=f"compactions {live.id} \\(pid {os.getpid()}"):
        take_hold(store.location, settle_seconds=0.3)
    assert not list((tmp_path / "_holds").iterdir())                 # a hold not taken is not left


def test_a_hold_ends_with_its_block_or_its_expiry(tmp_path):
    store = _small_files(tmp_path, files=3)
    with pytest.warns(UserWarning, match="held compactions for longer than its hold lasted"):
        with store.hold_compactions(seconds=0.2):
            time.sleep(0.3)                                   # compactions may run again: said so
    dead = take_hold(store.location, seconds=0.1)             # a reader killed while holding
    (path,) = (tmp_path / "_holds").iterdir()
    path.write_text(json.dumps({**json.loads(path.read_text()), "expires": dead.expires - 120}))
    stats = store.compact()
    assert not stats.held and stats.input_files == 3          # an expired hold stops nothing...
    assert stats.temporaries_removed == 1 and not path.exists()   # ...and is cleaned up


def _writer(root: str, number: int, reading) -> None:
    store = RecordStore(root, auto_compact=4, durable=False)         # merges race the reader's holds
    rng = np.random.default_rng(number)
    reading.wait(timeout=120)     # once the reader reads: a reader process starting late saw only the end
    for index in range(BATCHES):
        store.append(synthetic_batch(rng, BATCH, flow_run_id=f"writer-{number}", round=index))
        time.sleep(0.01)


def _compactor(root: str, stop, out, merging) -> None:
    store = RecordStore(root, auto_compact=None, durable=False)
    merged = held = 0
    while not stop.is_set():
        stats = store.compact(small_file_bytes=1 << 30)
        merged, held = merged + stats.input_files, held + stats.held
        if merged:
            merging.set()
        time.sleep(0.05)
    out.put(("compactor", merged, held))


def _raw_reader(root: str, stop, out, reading) -> None:
    store = RecordStore(root)
    reads, errors, duplicated, lost = 0, [], 0, 0
    previous: set = set()
    while not stop.is_set():
        try:
            with store.hold_compactions():
                ids = pd.read_parquet(root, columns=["record_id"])["record_id"]
        except Exception as exc:  # noqa: BLE001 - counted: the assertion names them
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        reads += 1
        reading.set()
        duplicated += int(ids.duplicated().sum())
        now = set(ids)
        lost += len(previous - now)                                  # a row once seen must stay seen
        previous = now
        time.sleep(0.02)                                             # a reader polling, not spinning
    out.put(("reader", reads, errors, duplicated, lost))


def test_writers_compaction_and_a_raw_pandas_reader(tmp_path):
    root = str(tmp_path)
    first = synthetic_batch(np.random.default_rng(99), BATCH, flow_run_id="before")
    RecordStore(root, durable=False).append(first)                  # the reader's first read has rows
    context = multiprocessing.get_context("spawn")
    stop, out, reading, merging = context.Event(), context.Queue(), context.Event(), context.Event()
    writers = [context.Process(target=_writer, args=(root, n, reading)) for n in range(WRITERS)]
    others = [context.Process(target=_compactor, args=(root, stop, out, merging)),
              context.Process(target=_raw_reader, args=(root, stop, out, reading))]
    for process in others + writers:
        process.start()
    for process in writers:
        process.join(timeout=180)
        assert process.exitcode == 0
    # the reader keeps reading until the compactor has merged once: on a loaded 2-core machine the
    # writers could finish before the compactor's first merge got between the reader's holds
    merging.wait(timeout=60)
    stop.set()
    reports = {report[0]: report[1:] for report in (out.get(timeout=120), out.get(timeout=120))}
    for process in others:
        process.join(timeout=60)
        assert process.exitcode == 0
    reads, errors, duplicated, lost = reports["reader"]
    merged, held = reports["compactor"]
    assert errors == [] and duplicated == 0 and lost == 0
    assert reads >= 5 and merged > 0                                 # the reads overlapped merging
    final = pd.read_parquet(root)
    assert len(final) == (WRITERS * BATCHES + 1) * BATCH and final["record_id"].is_unique
    assert row_multiset(final) == row_multiset(RecordStore(root).read())
    assert final.groupby("flow_run_id").size().to_dict() == {"before": BATCH, **{
        f"writer-{n}": BATCHES * BATCH for n in range(WRITERS)}}


def test_the_readme_raw_recipe_runs_as_written(tmp_path):
    """The README's raw-reader block, against a store whose merges it holds off: all rows, once."""
    store = _small_files(tmp_path, files=5)
    text = (Path(__file__).parents[1] / "README.md").read_text()
    start = text.index("```python", text.index("`pyarrow.dataset`, DuckDB's")) + len("```python")
    block = text[start:text.index("```", start)]
    assert "hold_compactions()" in block and "pd.read_parquet" in block
    scope: dict = {}
    exec(block.replace('"tuning-records"', repr(str(tmp_path))), scope)
    assert row_multiset(scope["raw"]) == row_multiset(store.read())
