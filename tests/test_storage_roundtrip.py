"""Every column of a MeasureRecord survives append + read, and the dataset is plain hive Parquet."""
from __future__ import annotations

import math
from dataclasses import fields
from datetime import datetime, timedelta, timezone

import pandas as pd
import pytest

from tensortune.storage.records import MeasureRecord, RecordStore
from tensortune.storage.schema import RECORD_COLUMNS, SCHEMA_VERSION


def _assert_same(a: MeasureRecord, b: MeasureRecord) -> None:
    for f in fields(MeasureRecord):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, float) and math.isnan(x):
            assert isinstance(y, float) and math.isnan(y), f.name
        else:
            assert x == y, f"{f.name}: {x!r} != {y!r}"
            assert type(x) is type(y), f.name


def _odd_records() -> list[MeasureRecord]:
    moment = datetime(2026, 3, 1, 12, 30, 45, 123456, tzinfo=timezone.utc)
    return [
        MeasureRecord(
            record_id="a" * 32, flow_run_id="flow-1", round=7, timestamp=moment,
            workload_key='["matmul",512,512,512,"float32"]', task_name="matmul_512", network="bert",
            target="llvm -mcpu=skylake-avx512 -mattr=+avx2,+fma", host="node-7",
            steps='[["SP",2,0,512,[8,16,4],1],["RE",2,[0,3,1,4,2,5]],["AN",2,6,2]]',
            latencies=[1.5e-3, 1.25e-3, 1.75e-3], mean_latency=1.5e-3, gflops=178.9,
            error_code=0, error_msg="", build_seconds=0.83, run_seconds=0.12,
            model_version="v000003-0123abcd", predicted_score=0.875, tool_version="0.1.0",
            flops=268435456.0),
        MeasureRecord(  # an error: infinite latency, no repeats, unicode and newlines in the message
            flow_run_id="flow-1", round=-1, timestamp=moment + timedelta(microseconds=1),
            workload_key="k2", task_name="", network="", target="llvm -mcpu=skylake-avx512 -mattr=+avx2,+fma",
            host="", steps="[]", latencies=[], mean_latency=math.inf, error_code=7,
            error_msg="RUN_TIMEOUT: kernel ran > 10 s\n  ünïcödé ✓", build_seconds=math.nan,
            run_seconds=10.0, predicted_score=-3.5, flops=0.0),
        MeasureRecord(  # NaN latency, huge round, long steps
            round=2**31 - 1, workload_key="k3", target="llvm -mcpu=skylake-avx512 -mattr=+avx2,+fma",
            steps="[" + ",".join(['["SP",2,0,1024,[1,2,3],1]'] * 2000) + "]", error_code=8,
            mean_latency=math.nan, latencies=[math.inf, 0.0]),
    ]


def test_every_column_round_trips(tmp_path):
    store = RecordStore(str(tmp_path))
    records = _odd_records()
    store.append(records)
    frame = store.read()
    assert list(frame.columns) == list(RECORD_COLUMNS)
    back = {r.record_id: r for r in store.load_records()}
    assert set(back) == {r.record_id for r in records}
    for record in records:
        _assert_same(record, back[record.record_id])
        assert back[record.record_id].schema_version == SCHEMA_VERSION


def test_defaults_are_filled_in():
    record = MeasureRecord(workload_key="k", target="llvm", steps="[]", latencies=[1e-3, 3e-3], flops=4e6)
    assert len(record.record_id) == 32
    assert record.mean_latency == pytest.approx(2e-3)
    assert record.gflops == pytest.approx(2.0)
    assert record.timestamp.tzinfo is not None


def test_bad_input_is_refused_with_a_clear_message(tmp_path):
    store = RecordStore(str(tmp_path))
    with pytest.raises(ValueError, match="time zone"):
        MeasureRecord(workload_key="k", target="llvm", steps="[]", timestamp=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="append them per target"):
        store.append([MeasureRecord(workload_key="k", target="llvm", steps="[]"),
                      MeasureRecord(workload_key="k", target="cuda", steps="[]")])
    with pytest.raises(TypeError, match="MeasureRecord.steps"):
        store.append([MeasureRecord(workload_key="k", target="llvm", steps=[["SP"]])])
    with pytest.raises(ValueError, match="target is empty"):
        store.append([MeasureRecord(workload_key="k", target="", steps="[]")])
    assert store.append([]) == ""
    assert store.read().empty


def test_part_files_are_hive_parquet_that_pandas_reads(tmp_path):
    store = RecordStore(str(tmp_path))
    path = store.append(_odd_records()[:2])
    relative = path[len(str(tmp_path)) + 1:]
    assert relative.startswith("target=llvm%20-mcpu%3Dskylake-avx512%20-mattr%3D%2Bavx2%2C%2Bfma/date=")
    assert relative.split("/")[-1].startswith("part-")
    frame = pd.read_parquet(tmp_path)
    assert len(frame) == 2
    assert set(frame["target"].astype(str)) == {"llvm -mcpu=skylake-avx512 -mattr=+avx2,+fma"}


def test_read_filters(tmp_path):
    store = RecordStore(str(tmp_path))
    base = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for i, (target, network) in enumerate([("llvm", "bert"), ("llvm", "resnet"), ("cuda", "bert")]):
        store.append([MeasureRecord(workload_key=f"k{j}", target=target, network=network, steps=f"[{i},{j}]",
                                    flow_run_id=f"run{i}", timestamp=base + timedelta(hours=i),
                                    latencies=[1e-3]) for j in range(3)])
    assert len(store.read()) == 9
    assert len(store.read(target="llvm")) == 6
    assert len(store.read(network="bert")) == 6
    assert len(store.read(network=["bert", "resnet"], target="cuda")) == 3
    assert len(store.read(workload_key="k1")) == 3
    assert len(store.read(flow_run_id="run1")) == 3
    assert len(store.read(since=base + timedelta(hours=1))) == 6
    assert len(store.read(until=base + timedelta(hours=1))) == 3
    assert list(store.read(columns=["steps", "round"]).columns) == ["steps", "round"]
    assert store.read(target="nothing-here").empty
    assert store.targets() == ["cuda", "llvm"]
    with pytest.raises(ValueError, match="unknown record columns"):
        store.read(columns=["latency"])
