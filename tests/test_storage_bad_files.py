"""A corrupt or foreign file in a store is reported by name (or quarantined with a warning), never
skipped in silence; writes in flight are ignored."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tensortune.storage.integrity import BadFileError
from tensortune.storage.records import RecordStore
from tensortune.storage.synthetic import synthetic_batch


def _store(root: Path, batches: int = 3) -> tuple[RecordStore, list[str]]:
    store = RecordStore(str(root), auto_compact=None)
    rng = np.random.default_rng(0)
    return store, [store.append(synthetic_batch(rng, 10, round=i)) for i in range(batches)]


def _truncate(path: str) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])


def test_truncated_part_file_is_named_in_the_error(tmp_path):
    store, paths = _store(tmp_path)
    _truncate(paths[1])
    with pytest.raises(BadFileError) as caught:
        store.read()
    assert paths[1] in str(caught.value)
    assert "on_bad_file='quarantine'" in str(caught.value)
    assert list(caught.value.problems) == [paths[1]]
    with pytest.raises(BadFileError):
        store.best_per_task()
    with pytest.raises(BadFileError):
        store.compact()


def test_quarantine_moves_the_file_and_warns(tmp_path):
    store, paths = _store(tmp_path)
    _truncate(paths[0])
    store = RecordStore(str(tmp_path), on_bad_file="quarantine", auto_compact=None)
    with pytest.warns(UserWarning, match="_quarantine"):
        frame = store.read()
    assert len(frame) == 20  # the two good batches
    assert not os.path.exists(paths[0])
    quarantined = list((tmp_path / "_quarantine").rglob("*.parquet"))
    assert [p.name for p in quarantined] == [os.path.basename(paths[0])]
    assert len(store.read()) == 20  # and now without a warning


def test_damage_inside_a_file_is_found(tmp_path):
    store, paths = _store(tmp_path)
    data = bytearray(Path(paths[2]).read_bytes())
    # footer intact, the header of a data page in the middle garbled (garbled compressed bytes may still
    # decode, to other strings: where a file's middle third falls moves with its columns)
    middle = pq.ParquetFile(paths[2]).metadata.row_group(0).column(
        pq.ParquetFile(paths[2]).schema_arrow.get_field_index("steps")).data_page_offset
    data[middle: middle + 64] = b"\xff" * 64
    Path(paths[2]).write_bytes(bytes(data))
    problems = RecordStore(str(tmp_path), on_bad_file="quarantine", auto_compact=None)
    with pytest.warns(UserWarning):
        found = problems.check()
    assert list(found) == [paths[2]]


def test_foreign_files_are_refused(tmp_path):
    store, paths = _store(tmp_path)
    partition = Path(paths[0]).parent
    for stray in (tmp_path / "notes.txt", partition / "data.csv", partition / "part-1.parquet.bak"):
        stray.write_text("not records")
        with pytest.raises(BadFileError, match="not a tensortune record file"):
            store.read()
        stray.unlink()
    assert len(store.read()) == 30


def test_foreign_parquet_with_our_name_is_refused(tmp_path):
    store, paths = _store(tmp_path)
    alien = Path(paths[0]).parent / ("part-" + "0" * 32 + ".parquet")
    pq.write_table(pa.table({"x": [1, 2, 3]}), alien)
    with pytest.raises(BadFileError, match="no column"):
        store.read()
    with pytest.raises(BadFileError, match="no column"):  # also when a filter would hide its rows
        store.measured_steps("nothing", "llvm -mcpu=test")
    wrong_type = Path(paths[0]).parent / ("part-" + "1" * 32 + ".parquet")
    alien.unlink()
    table = pq.read_table(paths[0]).drop_columns(["round"]).append_column(
        "round", pa.array(["one"] * 10))
    pq.write_table(table, wrong_type)
    with pytest.raises(BadFileError, match="column 'round' has type string"):
        store.read()


def test_writes_in_flight_and_private_folders_are_ignored(tmp_path):
    store, paths = _store(tmp_path)
    partition = Path(paths[0]).parent
    (partition / (".part-" + "a" * 32 + ".parquet.0123abcd.tmp")).write_bytes(b"PAR1 half a file")
    (partition / "_SUCCESS").write_text("")
    (tmp_path / "_scratch").mkdir()
    (tmp_path / "_scratch" / "x.csv").write_text("1,2")
    assert len(store.read()) == 30
    assert store.compact(stale_seconds=0).temporaries_removed == 1
