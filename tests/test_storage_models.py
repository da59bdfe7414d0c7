"""Cost models are stored as numbered versions beside the records, newest first out."""
from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np
import pytest

from tensortune.storage.models import ModelStore, ModelStoreError
from tensortune.storage.records import RecordStore
from tensortune.storage.synthetic import synthetic_batch

TARGET = "llvm -mcpu=skylake-avx512"


def test_save_load_and_list(tmp_path):
    models = ModelStore(str(tmp_path))
    assert models.load_newest(TARGET) is None
    assert models.list().empty
    first = models.save(TARGET, b"\x00model-1", {"rmse": 0.5, "pairwise_accuracy": 0.7}, 1000, "xgb")
    second = models.save(TARGET, b"\x00model-2", {"rmse": 0.25}, 5000, "xgb")
    models.save("cuda", b"other", {}, 10, "random")
    assert (first[:7], second[:7]) == ("v000001", "v000002")
    data, meta = models.load_newest(TARGET)
    assert data == b"\x00model-2"
    assert meta["version"] == second and meta["record_count"] == 5000 and meta["kind"] == "xgb"
    assert meta["metrics"] == {"rmse": 0.25} and meta["target"] == TARGET
    assert models.load(TARGET, first)[0] == b"\x00model-1"
    listed = models.list(TARGET)
    assert listed["version"].tolist() == [first, second]
    assert listed["metric.rmse"].tolist() == [0.5, 0.25]
    assert len(models.list()) == 3


def test_models_live_beside_records_without_disturbing_them(tmp_path):
    store = RecordStore(str(tmp_path))
    store.append(synthetic_batch(np.random.default_rng(0), 10, target=TARGET))
    ModelStore(str(tmp_path)).save(TARGET, b"m", {"rmse": 1.0}, 10, "xgb")
    assert (tmp_path / "_models").is_dir()
    assert len(store.read()) == 10
    store.compact()
    assert ModelStore(str(tmp_path)).load_newest(TARGET)[0] == b"m"


def test_damaged_model_is_refused(tmp_path):
    models = ModelStore(str(tmp_path))
    version = models.save(TARGET, b"good bytes", {}, 1, "xgb")
    (path,) = Path(tmp_path).rglob(f"{version}.model")
    path.write_bytes(b"bad bytes!")
    with pytest.raises(ModelStoreError, match="sha256"):
        models.load_newest(TARGET)
    path.unlink()
    with pytest.raises(ModelStoreError, match="missing"):
        models.load_newest(TARGET)
    with pytest.raises(ModelStoreError, match="no cost model"):
        models.load(TARGET, "v000009-00000000")


def test_bad_arguments(tmp_path):
    models = ModelStore(str(tmp_path))
    with pytest.raises(TypeError, match="bytes"):
        models.save(TARGET, "not bytes", {}, 1, "xgb")
    with pytest.raises(TypeError, match="JSON"):
        models.save(TARGET, b"x", {"when": object()}, 1, "xgb")


def _save(root: str, n: int) -> None:
    ModelStore(root).save(TARGET, f"model from {n}".encode(), {"n": n}, n, "xgb")


def test_concurrent_saves_keep_every_version(tmp_path):
    context = multiprocessing.get_context("spawn")
    savers = [context.Process(target=_save, args=(str(tmp_path), n)) for n in range(4)]
    for saver in savers:
        saver.start()
    for saver in savers:
        saver.join(timeout=60)
        assert saver.exitcode == 0
    listed = ModelStore(str(tmp_path)).list(TARGET)
    assert sorted(listed["metric.n"]) == [0, 1, 2, 3]  # none overwrote another
    assert ModelStore(str(tmp_path)).load_newest(TARGET) is not None
