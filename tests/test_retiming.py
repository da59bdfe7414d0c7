"""A resumed run times its tasks' stored bests again, so a figure from a faster night does not stay the
best: with the real LLVM measurer, on a store whose timings were made five times too fast."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tensortune.codegen.confirmation import confirm_new_bests
from tensortune.codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
from tensortune.codegen.target import make_task
from tensortune.codegen.timing import ErrorCode, TimingConfig
from tensortune.flows.tuning import NetworkTuner, apply_best, default_programs, tune_task
from tensortune.search.sketch_policy import SearchParams
from tensortune.storage.records import RecordStore
from tensortune.tasks.reference import evaluate, mismatch
from tensortune.tasks.workload_registry import make_dag

PARAMS = SearchParams(population=128, sample_init_population=128, num_iters=1, num_measures_per_round=8)
FAST_NIGHT = 0.2          # the stored timings, as if made on a machine five times faster


@pytest.fixture(scope="module")
def measurer():
    m = ProgramMeasurer(LocalBuilder(), LocalRunner(config=TimingConfig(min_repeat_ms=5, repeat=3)))
    yield m
    m.close()


def _fast_night(source: RecordStore, path: str) -> RecordStore:
    """A copy of `source` whose successful timings are FAST_NIGHT times what they were (new records)."""
    store = RecordStore(path)
    store.append([dataclasses.replace(r, record_id="", latencies=[x * FAST_NIGHT for x in r.latencies],
                                      mean_latency=r.mean_latency * FAST_NIGHT, gflops=float("nan"))
                  for r in source.load_records()])
    return store


def test_a_resumed_task_is_compared_with_its_stored_bests_timed_again(tmp_path, measurer):
    task = make_task(make_dag("matmul", 64, 64, 64))
    tune_task(task, 16, measurer=measurer, params=PARAMS, records=RecordStore(str(tmp_path / "night1")), seed=0)
    night1 = RecordStore(str(tmp_path / "night1"))
    stored = _fast_night(night1, str(tmp_path / "trusted"))
    fastest_stored = stored.best_per_task()["mean_latency"].item()

    # TVM's way (retime=0): the fast night's figure stays the best, whatever tonight measures
    trusted = tune_task(task, 8, measurer=measurer, params=PARAMS, records=stored, seed=1, retime=0)
    assert trusted.best_latency == fastest_stored
    assert stored.best_per_task()["mean_latency"].item() == fastest_stored

    # timed again first: the three fastest stored programs, each three times, as new records at one time
    store = _fast_night(night1, str(tmp_path / "retimed"))
    # ranked as stored before tonight: a resumed run times only what was stored, and tonight's programs
    # can beat the fast night's second or third (a fresh clone's run failed on ranking them together)
    ranked = store.read().sort_values("mean_latency")["steps"].drop_duplicates()
    result = tune_task(task, 8, measurer=measurer, params=PARAMS, records=store, seed=1)
    frame = store.read()
    retimed = frame[frame["retiming"]]
    assert list(retimed["steps"]) == list(ranked[:3]) and retimed["timestamp"].nunique() == 1
    # three timings each, of up to repeat=3 runs (a run 20 times slower than the best seen cuts one short)
    assert (retimed["error_code"] == 0).all() and retimed["latencies"].map(len).between(3, 9).all()
    assert len(frame) == 16 + 3 + 8 and (~frame["retiming"]).sum() == 24       # nothing stored was rewritten
    # the best is now tonight's: at least a timing made tonight, not the fast night's figure
    tonight = frame[frame["timestamp"] >= retimed["timestamp"].iloc[0]].query("error_code == 0")
    assert result.best_latency == tonight["mean_latency"].min() > fastest_stored
    best = store.best_per_task()
    assert best["mean_latency"].item() == result.best_latency and best["n_records"].item() == 27
    # and the program deployed from the store is tonight's best, and computes the matmul
    assert best["steps"].item() == result.best_steps
    kernel = apply_best(task, store)
    inputs = task.dag.random_inputs(3)
    out = np.empty((64, 64), np.float32)
    kernel(*inputs, out)
    assert mismatch(out, evaluate(task.dag, inputs)[0]) is None


def test_a_default_schedule_timed_again_is_what_speedups_are_counted_from(tmp_path, measurer):
    """The flow's "speedup vs default" takes the default schedule's newest timing: its re-timing, when the
    default is among the stored bests a resumed run times again, not the figure of a faster night."""
    task = make_task(make_dag("matmul", 64, 64, 64))
    default = default_programs(task)[0].steps_json()
    night1 = RecordStore(str(tmp_path / "night1"))
    tune_task(task, 8, measurer=measurer, params=PARAMS, records=night1, seed=0, measure_default=True)
    store = RecordStore(str(tmp_path / "resumed"))
    # the default as stored by a faster night (whatever tonight's first timing of it gave, on a loaded
    # machine even a failure): the fastest stored program, so the first one timed again. A nanosecond,
    # which no timing tonight reaches: a fifth of night 1's fastest was not enough when night 1 was timed
    # in a stall (6.6 ms for this matmul, then 0.58 ms timed again, in a fresh clone's test run)
    store.append([dataclasses.replace(r, record_id="", latencies=[1e-9], mean_latency=math.nan,
                                      gflops=float("nan"), error_code=0, error_msg="")
                  if r.steps == default else r for r in night1.load_records()])
    stored = store.read().query("steps == @default")["mean_latency"].item()
    tuner = NetworkTuner([task], 8, measurer, params=PARAMS, records=store)
    retimed = store.read().query("retiming and steps == @default")
    assert len(retimed) == 1 and tuner.incumbents[0][0].steps == default
    assert tuner.default_latency[0] == retimed["mean_latency"].item() > stored
    resumed_only = NetworkTuner([task], 8, None, params=PARAMS, records=store)    # nothing timed again:
    assert resumed_only.default_latency[0] == retimed["mean_latency"].item()      # the newest timing


def test_a_stored_program_that_no_longer_replays_is_passed_over_for_the_next(tmp_path, measurer):
    """An older rule set's program that today's rules refuse (here: steps that do not parse) cannot be
    timed again; the next fastest are, so three stored programs are still tonight's figures."""
    task = make_task(make_dag("matmul", 64, 64, 64))
    night1 = RecordStore(str(tmp_path / "night1"))
    tune_task(task, 8, measurer=measurer, params=PARAMS, records=night1, seed=0)
    store = _fast_night(night1, str(tmp_path / "resumed"))
    fastest = store.best_per_task().iloc[0]
    store.append([dataclasses.replace(store.load_records()[0], record_id="", steps="[[\"an older rule\"]]",
                                      mean_latency=fastest["mean_latency"] / 2, latencies=[], error_code=0,
                                      error_msg="")])
    ranked = store.read().query("error_code == 0").sort_values("mean_latency")["steps"].drop_duplicates()
    assert ranked.iloc[0] == "[[\"an older rule\"]]"
    tune_task(task, 0, measurer=measurer, params=PARAMS, records=store, seed=1)
    retimed = store.read().query("retiming")
    assert list(retimed["steps"]) == list(ranked[1:4]) and (retimed["error_code"] == 0).all()


class CountingBuilder(LocalBuilder):
    """The real builder, noting how many programs each call built."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def build_many(self, programs, keep_source=False):
        self.calls.append(len(programs))
        return super().build_many(programs, keep_source)


def test_a_resumed_network_builds_every_tasks_stored_bests_in_one_go(tmp_path, measurer):
    """Each task's three programs to time again used to be built as a batch of their own, leaving cores
    idle; the network's are built at once (build_ahead), and the re-timings build nothing more."""
    tasks = [make_task(make_dag("matmul", 64, 64, 64)), make_task(make_dag("matmul", 96, 96, 48))]
    night1 = RecordStore(str(tmp_path / "night1"))
    for i, task in enumerate(tasks):
        tune_task(task, 8, measurer=measurer, params=PARAMS, records=night1, seed=i)
    store = _fast_night(night1, str(tmp_path / "resumed"))
    builder = CountingBuilder()
    counted = ProgramMeasurer(builder, LocalRunner(config=TimingConfig(min_repeat_ms=5, repeat=3)))
    try:
        tuner = NetworkTuner(tasks, 0, counted, params=PARAMS, records=store)
    finally:
        counted.close()
    assert [len(batch) for batch in tuner.incumbents] == [3, 3]
    assert builder.calls == [6]                     # one call built all six; measure() found them built
    retimed = store.read().query("retiming")
    assert len(retimed) == 6 and (retimed["error_code"] == 0).all() and retimed["workload_key"].nunique() == 2


@pytest.fixture(scope="module")
def node_down():
    """A real cluster on which the target's measure node is down tonight: the measurer may time only on
    a worker that never joined, so every timing waits out the round's deadline and is lost
    (UNKNOWN_ERROR), as when a cluster loses its workers."""
    from distributed import Client, LocalCluster

    from tensortune.flows.dask_measure import DaskMeasurer
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, resources={"measure-cpu": 1},
                      dashboard_address=None, host="127.0.0.1") as c, Client(c, set_as_default=False) as client:
        yield DaskMeasurer(client, timing=TimingConfig(min_repeat_ms=5, repeat=3), workers=["tcp://127.0.0.1:9"],
                           round_timeout=2.0)


def test_retimings_the_cluster_lost_leave_the_stored_best_standing(tmp_path, measurer, node_down):
    """A re-timing the measuring lost says nothing about the program: stored as an ordinary failed
    record, it cuts no history off, so a night with a broken cluster neither takes the tuned kernels
    from the best-record query (the deployed network) nor sends the task back to the warm-up; the next
    night times the same programs again."""
    task = make_task(make_dag("matmul", 64, 64, 64))
    store = RecordStore(str(tmp_path / "store"))
    tune_task(task, 8, measurer=measurer, params=PARAMS, records=store, seed=0)
    before = store.best_per_task().iloc[0]

    tuner = NetworkTuner([task], 0, node_down, params=PARAMS, records=store)
    frame = store.read()
    tonight = frame.iloc[8:]
    assert len(tonight) == 3 and (tonight["error_code"] == ErrorCode.UNKNOWN_ERROR).all()
    assert not frame["retiming"].any()
    after = store.best_per_task().iloc[0]
    assert (after["steps"], after["mean_latency"]) == (before["steps"], before["mean_latency"])
    assert tuner.policies[0].best_cost == before["mean_latency"] == tuner.sched.best_costs[0]

    NetworkTuner([task], 0, measurer, params=PARAMS, records=store)       # the node is back
    retimed = store.read().query("retiming")
    assert list(retimed["steps"]) == list(tonight["steps"]) and (retimed["error_code"] == 0).all()
    assert store.best_per_task()["mean_latency"].item() == retimed["mean_latency"].min()


def test_a_confirmation_the_cluster_lost_leaves_the_first_timing(measurer, node_down):
    """A would-be best whose confirming timings were lost keeps its first timing; were the loss the
    program's failure, a program that ran well would be recorded as failed."""
    task = make_task(make_dag("matmul", 64, 64, 64))
    steps = [default_programs(task)[0].steps_json()]
    first = measurer.measure(task, steps)
    assert first[0].ok
    confirmed = confirm_new_bests(node_down, task, steps, first, math.inf)
    assert confirmed[0].ok and confirmed[0].costs == first[0].costs
