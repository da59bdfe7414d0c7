"""The store on filesystems other than a local folder: S3 (a moto server on loopback) and fsspec URLs."""
from __future__ import annotations

import uuid

import numpy as np
import pytest
from pyarrow.fs import FileSelector

from tensortune.storage.integrity import BadFileError
from tensortune.storage.models import ModelStore
from tensortune.storage.records import RecordStore
from tensortune.storage.synthetic import row_multiset, synthetic_batch, workload_key


@pytest.fixture(scope="module")
def s3_endpoint():
    moto_server = pytest.importorskip("moto.server", reason="S3 tests need moto[server]")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_url(s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = f"tt-{uuid.uuid4().hex[:12]}"
    query = f"endpoint_override={s3_endpoint}&scheme=http&region=us-east-1&allow_bucket_creation=true"
    RecordStore(f"s3://{bucket}?{query}").location.fs.create_dir(bucket)
    return f"s3://{bucket}/records?{query}"


def _exercise(url: str) -> RecordStore:
    store = RecordStore(url, auto_compact=3)
    rng = np.random.default_rng(0)
    for index in range(7):
        store.append(synthetic_batch(rng, 20, target="cuda -arch=sm_90", tasks=4, round=index))
    frame = store.read()
    assert len(frame) == 140 and frame["record_id"].is_unique
    best = store.best_per_task()
    assert len(best) == 4
    steps = store.measured_steps(workload_key(1), "cuda -arch=sm_90")
    store.compact()
    assert row_multiset(store.read()) == row_multiset(frame)
    assert store.best_per_task()["record_id"].tolist() == best["record_id"].tolist()
    assert store.measured_steps(workload_key(1), "cuda -arch=sm_90") == steps
    return store


def test_s3_round_trip_and_compaction(s3_url):
    store = _exercise(s3_url)
    assert store.location.object_store and store.location.fs.type_name == "s3"
    files = [i.path for i in store.location.fs.get_file_info(FileSelector(store.root, recursive=True))]
    assert any("/compact-" in p for p in files)
    assert not any(p.endswith(".tmp") for p in files)  # object stores are written straight to the key


def test_s3_bad_object_is_reported_then_quarantined(s3_url):
    store = RecordStore(s3_url, auto_compact=None)
    store.append(synthetic_batch(np.random.default_rng(1), 5, target="llvm"))
    bad = store.location.path("target=llvm", "date=2026-01-01", "part-" + "f" * 32 + ".parquet")
    with store.location.fs.open_output_stream(bad) as out:
        out.write(b"PAR1 this is not parquet")
    with pytest.raises(BadFileError, match="f" * 32):
        store.read()
    with pytest.warns(UserWarning, match="_quarantine"):
        assert len(RecordStore(s3_url, on_bad_file="quarantine").read()) == 5
    assert len(store.read()) == 5


def test_s3_models(s3_url):
    models = ModelStore(s3_url)
    assert models.load_newest("cuda") is None
    models.save("cuda", b"first", {"rmse": 0.5}, 100, "xgb")
    models.save("cuda", b"second", {"rmse": 0.25}, 200, "xgb")
    data, meta = models.load_newest("cuda")
    assert data == b"second" and meta["record_count"] == 200 and meta["number"] == 2


def test_fsspec_memory_filesystem():
    store = _exercise(f"memory://tensortune-{uuid.uuid4().hex[:8]}/records")
    assert not store.location.local and not store.location.object_store  # temp name + move
