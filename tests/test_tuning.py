"""Tuning end to end: a short tune beats the naive program, records land, resume skips measured programs."""
from __future__ import annotations

import math

import numpy as np
import pytest

from codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer, TimingConfig
from codegen.target import make_task
from flows.tuning import apply_best, tune_task
from search.sketch_policy import SearchParams
from search.state import State
from storage.records import RecordStore
from tasks.reference import evaluate, mismatch
from tasks.workload_registry import make_dag

PARAMS = SearchParams(population=256, sample_init_population=256, num_iters=2, num_measures_per_round=16)


@pytest.fixture(scope="module")
def measurer():
    m = ProgramMeasurer(LocalBuilder(), LocalRunner(config=TimingConfig(min_repeat_ms=10, repeat=3)))
    yield m
    m.close()


def test_short_tune_beats_the_naive_program_and_resumes(tmp_path, measurer):
    task = make_task(make_dag("matmul", 96, 96, 96))
    store = RecordStore(str(tmp_path / "records"))
    first = tune_task(task, 32, measurer=measurer, params=PARAMS, records=store, seed=1)
    (naive,) = measurer.measure(task, [State(task.dag).steps_json()])
    assert first.trials == 32 and len(first.curve) == 32
    assert first.best_latency < naive.mean, (first.best_latency, naive.mean)
    assert [r.trials for r in first.rounds] == [16, 32]
    before = store.measured_steps(task.workload_key, task.target)
    assert len(before) == 32
    second = tune_task(task, 16, measurer=measurer, params=PARAMS, records=store, seed=2)
    after = store.measured_steps(task.workload_key, task.target)
    assert len(after) == 48                                   # 16 new programs, none measured twice
    assert second.best_latency <= first.best_latency          # starts from the stored best
    kernel = apply_best(task, store)
    inputs = task.dag.random_inputs(5)
    out = np.empty((96, 96), np.float32)
    kernel(*inputs, out)
    assert mismatch(out, evaluate(task.dag, inputs)[0]) is None


def test_failures_are_recorded_not_fatal(tmp_path, measurer):
    task = make_task(make_dag("softmax", 8, 64))
    store = RecordStore(str(tmp_path / "records"))
    res = tune_task(task, 16, measurer=measurer, params=PARAMS, records=store, seed=0)
    frame = store.records_of(task.workload_key)
    assert len(frame) == 16 and math.isfinite(res.best_latency)
    assert set(frame["error_code"]) <= {0, 1, 2, 4, 5, 6, 7, 8}
