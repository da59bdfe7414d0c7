"""A would-be best is timed again before it counts (codegen.confirmation): the rule on scripted timings
(real timings cannot be made lucky on purpose), then through tune_task with the real measurer."""
from __future__ import annotations

import numpy as np
import pytest

from tensortune.codegen.confirmation import confirm_new_bests
from tensortune.codegen.measure import LocalRunner, MeasureResult, ProgramMeasurer
from tensortune.codegen.target import make_task
from tensortune.codegen.timing import ErrorCode, TimingConfig
from tensortune.flows.dask_measure import DaskStats
from tensortune.flows.tuning import tune_task
from tensortune.search.sketch_policy import SearchParams
from tensortune.storage.records import RecordStore
from tensortune.tasks.workload_registry import make_dag
from tests.test_recent_builds import CountingBuilder

TASK = make_task(make_dag("matmul", 32, 32, 32))


class ScriptedTimings:
    """A Measurer whose re-timings are given: program name -> the seconds of each later timing (or an
    error code), in order. Records every call's list, and costs 1 s of building per call (`stats`)."""

    def __init__(self, later: dict[str, list[float | ErrorCode]]):
        self.later, self.calls, self.stats = later, [], DaskStats()

    def measure(self, task, steps_list):
        self.calls.append(list(steps_list))
        self.stats = DaskStats(build_s=1.0)
        out = []
        for s in steps_list:
            x = self.later[s].pop(0)
            out.append(MeasureResult([], int(x), "crashed") if isinstance(x, ErrorCode) else MeasureResult([x], 0))
        return out

    def close(self) -> None:
        pass


def first(*seconds: float) -> list[MeasureResult]:
    return [MeasureResult([s], 0) for s in seconds]


def test_a_lucky_first_timing_is_outweighed_and_the_next_program_confirmed():
    # best before the batch: 4 s. b's first timing (1 s) was lucky, it runs at 6; d runs at 2 as timed.
    steps = ["a", "b", "c", "d"]
    timings = ScriptedTimings({"b": [6.0, 6.0], "d": [2.0, 2.0]})
    stats_before = timings.stats = DaskStats(build_s=5.0)
    out = confirm_new_bests(timings, TASK, steps, first(5.0, 1.0, 3.0, 2.0), best=4.0)
    assert timings.calls == [["b", "b", "d", "d"]]          # the two fastest below the best, twice each
    assert out[1].costs == [1.0, 6.0, 6.0] and out[1].latency == pytest.approx(13 / 3)
    assert out[3].costs == [2.0, 2.0, 2.0]
    assert [r.costs for r in (out[0], out[2])] == [[5.0], [3.0]]      # slower than the best: timed once
    assert min(range(4), key=lambda k: out[k].latency) == 3
    assert timings.stats.build_s == stats_before.build_s + 1.0         # both calls' cost reported


def test_passes_go_on_until_the_fastest_result_is_confirmed():
    # each pass re-times one program; a and b turn out slow, so c (timed 3 s) must be confirmed as well
    timings = ScriptedTimings({"a": [9.0, 9.0], "b": [8.0, 8.0], "c": [3.0, 3.0]})
    out = confirm_new_bests(timings, TASK, ["a", "b", "c", "e"], first(1.0, 2.0, 3.0, 7.0), best=10.0,
                            per_pass=1)
    assert timings.calls == [["a", "a"], ["b", "b"], ["c", "c"]]
    assert min(range(4), key=lambda k: out[k].latency) == 2 and len(out[2].costs) == 3


def test_a_program_that_fails_when_timed_again_is_no_best():
    timings = ScriptedTimings({"a": [1.0, ErrorCode.RUNTIME_DEVICE], "b": [2.0, 2.0]})
    out = confirm_new_bests(timings, TASK, ["a", "b"], first(1.0, 2.0), best=3.0)
    assert out[0].error_code == ErrorCode.RUNTIME_DEVICE and not out[0].ok
    assert "timed again" in out[0].error_msg and out[0].costs == [1.0, 1.0]
    assert out[1].ok and out[1].latency == 2.0


def test_a_measurer_that_fails_while_timing_again_costs_no_result():
    class ClusterGone(ScriptedTimings):
        def measure(self, task, steps_list):
            raise RuntimeError("the Dask client lost the scheduler")
    out = confirm_new_bests(ClusterGone({}), TASK, ["a", "b"], first(1.0, 2.0), best=3.0)
    assert [r.costs for r in out] == [[1.0], [2.0]] and all(r.ok for r in out)


def test_nothing_is_timed_again_without_a_would_be_best_or_with_confirmation_off():
    timings = ScriptedTimings({})
    assert confirm_new_bests(timings, TASK, ["a"], first(5.0), best=4.0)[0].costs == [5.0]
    assert confirm_new_bests(timings, TASK, ["a"], first(1.0), best=4.0, timings=0)[0].costs == [1.0]
    assert timings.calls == []


def test_tune_task_records_its_best_with_every_timing(tmp_path):
    # the real measurer: the stored best holds its first timing's 2 repeats and 2 more timings' 2 each,
    # in one record (no record added), and its mean is theirs; every program is built once
    params = SearchParams(population=64, sample_init_population=64, num_iters=1, num_measures_per_round=8)
    store = RecordStore(str(tmp_path / "records"))
    task = make_task(make_dag("matmul", 64, 64, 64))
    builder = CountingBuilder(n_parallel=1)
    with ProgramMeasurer(builder, LocalRunner(config=TimingConfig(min_repeat_ms=5, repeat=2))) as m:
        result = tune_task(task, 16, measurer=m, params=params, records=store, seed=0)
    frame = store.read()
    assert len(frame) == 16 and result.trials == 16
    assert len(builder.built) == len(set(builder.built)) == 16     # a program timed again is not rebuilt
    best = frame.loc[frame["mean_latency"].idxmin()]
    assert len(best["latencies"]) == 6
    assert best["mean_latency"] == pytest.approx(np.mean(best["latencies"]))
    assert result.best_latency == pytest.approx(best["mean_latency"])
