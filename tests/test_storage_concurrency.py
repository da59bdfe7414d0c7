"""Several processes appending (and merging, and reading) at once lose and duplicate nothing."""
from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from tensortune.storage import scan
from tensortune.storage.journal import Journal, resolve
from tensortune.storage.records import RecordStore
from tensortune.storage.synthetic import synthetic_batch

WRITERS = 4
BATCHES = 24
BATCH = 16


def _writer(root: str, number: int, auto_compact: int | None) -> None:
    store = RecordStore(root, auto_compact=auto_compact, durable=False)
    rng = np.random.default_rng(number)
    for index in range(BATCHES):
        store.append(synthetic_batch(rng, BATCH, flow_run_id=f"writer-{number}", round=index))


def _reader(root: str, rounds: int, queue) -> None:
    store = RecordStore(root)
    sizes = []
    for _ in range(rounds):
        frame = store.read(columns=["record_id"])
        assert frame["record_id"].is_unique, "a reader saw a row twice"
        sizes.append(len(frame))
    queue.put(sizes)


def _run_writers(root: str, auto_compact: int | None, with_reader: bool) -> list[int]:
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_writer, args=(root, n, auto_compact)) for n in range(WRITERS)]
    queue = context.Queue()
    reader = context.Process(target=_reader, args=(root, 15, queue)) if with_reader else None
    for process in writers + ([reader] if reader else []):
        process.start()
    sizes = queue.get(timeout=120) if reader else []
    for process in writers + ([reader] if reader else []):
        process.join(timeout=120)
        assert process.exitcode == 0
    return sizes


def test_concurrent_appends_lose_nothing(tmp_path):
    _run_writers(str(tmp_path), auto_compact=None, with_reader=False)
    frame = RecordStore(str(tmp_path)).read()
    assert len(frame) == WRITERS * BATCHES * BATCH
    assert frame["record_id"].is_unique
    per_writer = frame.groupby("flow_run_id").size()
    assert per_writer.to_dict() == {f"writer-{n}": BATCHES * BATCH for n in range(WRITERS)}
    rounds = frame.groupby(["flow_run_id", "round"]).size()
    assert (rounds == BATCH).all() and len(rounds) == WRITERS * BATCHES


def test_concurrent_appends_with_merging_and_a_reader(tmp_path):
    # Every writer merges part files as it goes (auto_compact=4), so merges race each other, the
    # appends, and a reader: the reader must never see a row twice, and in the end all rows are there.
    sizes = _run_writers(str(tmp_path), auto_compact=4, with_reader=True)
    assert sizes == sorted(sizes)  # rows only ever appear
    store = RecordStore(str(tmp_path))
    frame = store.read()
    assert len(frame) == WRITERS * BATCHES * BATCH
    assert frame["record_id"].is_unique
    store.compact()
    again = store.read()
    assert sorted(again["record_id"]) == sorted(frame["record_id"])


def _journal(inputs: tuple[str, ...], output: str, finished: bool) -> Journal:
    return Journal(id=output.replace("/", "") * 4, output=output, inputs=inputs,
                   finished=1.0 if finished else None)


def test_a_listing_that_missed_a_compaction_is_torn():
    # A directory listing is not a snapshot: it can miss an output created behind its cursor and the
    # inputs deleted ahead of it. The journal tells, and the reader lists again.
    merged = _journal(("p/a", "p/b"), "p/c", finished=True)
    never = lambda output: False  # noqa: E731
    made = lambda *names: (lambda output: output in names)  # noqa: E731
    assert resolve([merged], {"p/x"}, made("p/c")).torn
    assert not resolve([merged], {"p/c", "p/x"}, made("p/c")).torn
    view = resolve([merged], {"p/a", "p/b", "p/c"}, made("p/c"))  # committed, inputs not yet deleted
    assert view.skip == {"p/a", "p/b"} and not view.torn
    # An output that is gone for good (quarantined, deleted by hand) is no reason to list again.
    assert not resolve([merged], {"p/x"}, never).torn
    # c merged again into d: a's rows are in d, so only d counts.
    again = _journal(("p/c", "p/e"), "p/d", finished=True)
    assert resolve([merged, again], {"p/d"}, never) == resolve([again], {"p/d"}, never)
    assert resolve([merged, again], {"p/a", "p/d"}, never).skip == {"p/a"}
    assert resolve([merged, again], {"p/x"}, made("p/d")).torn
    # A claim that never committed (its inputs were merged by someone else) is not a tear...
    dead = _journal(("p/a",), "p/z", finished=False)
    assert not resolve([dead, merged], {"p/c"}, made("p/c")).torn
    # ...but an unfinished one whose output exists unlisted is: it committed during the listing.
    assert resolve([dead], {"p/x"}, made("p/z")).torn


def _compacted_store(root) -> tuple[RecordStore, int]:
    store = RecordStore(str(root), auto_compact=None, durable=False)
    rng = np.random.default_rng(0)
    for index in range(4):
        store.append(synthetic_batch(rng, BATCH, round=index))
    store.compact()
    return store, 4 * BATCH


def test_the_scanner_lists_again_after_a_torn_listing(tmp_path, monkeypatch):
    store, rows = _compacted_store(tmp_path)
    real = scan.list_files
    calls = []

    def racing(location, folder):  # the first listing misses the merged file, as a racing readdir can
        calls.append(folder)
        infos = real(location, folder)
        return [i for i in infos if "compact-" not in i.base_name] if len(calls) == 1 else infos

    monkeypatch.setattr(scan, "list_files", racing)
    assert len(store.read()) == rows
    assert len(calls) == 2


def test_a_quarantined_merged_file_does_not_stop_readers(tmp_path):
    # The merged file is damaged and quarantined while its tombstone is fresh: its inputs are gone
    # and its output too, for good. Readers must carry on (listing again would not bring it back).
    _compacted_store(tmp_path)
    (merged,) = tmp_path.rglob("compact-*.parquet")
    merged.write_bytes(merged.read_bytes()[:100])
    with pytest.warns(UserWarning, match="moved 1 bad file"):
        assert len(RecordStore(str(tmp_path), on_bad_file="quarantine").read()) == 0
    assert list((tmp_path / "_quarantine").rglob("compact-*.parquet"))
