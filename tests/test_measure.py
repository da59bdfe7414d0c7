"""Builders and runners: errors come back as results, and the pool keeps measuring correctly after."""
from __future__ import annotations

import types

import numpy as np
import pytest

from tensortune.codegen import timing
from tensortune.codegen.artifact import Artifact
from tensortune.codegen.llvm_backend import cold_start, compile_ir, pool_waker
from tensortune.codegen.measure import BuildResult, LocalBuilder, LocalRunner, MeasureResult, ProgramMeasurer
from tensortune.codegen.target import make_task, parse_target
from tensortune.codegen.timing import NETWORK_TIMING, ErrorCode, TimingConfig, time_runs
from tensortune.schedule.state import State
from tensortune.tasks.workload_registry import make_dag


def _artifact(body: str, dag) -> Artifact:
    """A hand-written kernel `k(A, B, C)` with the packed/repeat wrappers the runner calls."""
    ir = f"""
define void @k(ptr %a, ptr %b, ptr %c) {{
{body}
}}
define void @k_packed(ptr %args) {{
  call void @k(ptr null, ptr null, ptr null)
  ret void
}}
define void @k_repeat(ptr %args, i64 %n) {{
  call void @k(ptr null, ptr null, ptr null)
  ret void
}}
"""
    obj = compile_ir(ir, parse_target("llvm"))
    return Artifact("llvm", "k", obj, tuple((t.name, t.shape, t.dtype) for t in dag.args))


SEGFAULT = "  store volatile float 1.0, ptr null\n  ret void"
HANG = "  %x = alloca float\n  br label %spin\nspin:\n  store volatile float 1.0, ptr %x\n  br label %spin"
NOTHING = "  ret void"


@pytest.fixture(scope="module")
def task():
    return make_task(make_dag("matmul", 32, 32, 32))


# A job's clock starts when it is sent, so a job sent to a fresh runner process (the first one, or the
# replacement of a crashed or hung one) also pays that interpreter's start-up (importing numpy and
# llvmlite), which a loaded 2-core machine has stretched past a few seconds. Jobs that must succeed get a
# budget no start-up reaches; only the hang, sent to a runner that has just finished a job, gets a short one.
PATIENT_S, HANG_S = 120.0, 3.0


@pytest.fixture(scope="module")
def runner():
    r = LocalRunner(timeout=PATIENT_S, config=TimingConfig(min_repeat_ms=5))
    yield r
    r.close()


def test_crash_and_hang_cost_one_result_each(task, runner):
    good = State(task.dag).split("C", 1, [16]).vectorize("C", 2)
    builder = LocalBuilder(n_parallel=1)
    try:
        (good_build,) = builder.build(task, [good.steps_json()])
    finally:
        builder.close()
    assert good_build.error_code == 0, good_build.error_msg
    segfault, hang = (BuildResult(_artifact(body, task.dag), 0, "", 0.0) for body in (SEGFAULT, HANG))
    restarts = runner.pool.restarts
    # a crash costs its own result; the next program of the same batch is timed by the replacement
    (first_pid,) = runner.pool.pids()
    crashed, after_crash = runner.run(task, [segfault, good_build])
    assert crashed.error_code == ErrorCode.RUNTIME_DEVICE and "SIGSEGV" in crashed.error_msg
    assert runner.pool.restarts == restarts + 1 and runner.pool.pids() != [first_pid]
    # a hang is cut off at the timeout (the runner is warm: it has just timed a program)
    runner.pool.timeout = HANG_S
    try:
        (hung,) = runner.run(task, [hang])
    finally:
        runner.pool.timeout = PATIENT_S
    assert hung.error_code == ErrorCode.RUN_TIMEOUT and f"timed out after {HANG_S:.1f} s" in hung.error_msg
    assert runner.pool.restarts == restarts + 2
    (after_hang,) = runner.run(task, [good_build])                # by the hung runner's replacement
    for r in (after_crash, after_hang):
        assert r.error_code == ErrorCode.NO_ERROR and 0 < r.latency < 1.0, r.error_msg
    assert runner.pool.restarts == restarts + 2


def test_wrong_answer_is_detected(task, runner):
    (res,) = runner.run(task, [BuildResult(_artifact(NOTHING, task.dag), 0, "", 0.0)])
    assert res.error_code == ErrorCode.WRONG_ANSWER and "elements differ" in res.error_msg


def test_interleaved_passes_time_the_fast_programs_again_and_keep_their_fastest_timing(task):
    good = State(task.dag).split("C", 1, [16]).vectorize("C", 2)
    plain = State(task.dag)
    builder = LocalBuilder(n_parallel=1)
    try:
        builds = builder.build(task, [good.steps_json(), plain.steps_json()])
    finally:
        builder.close()
    wrong = BuildResult(_artifact(NOTHING, task.dag), 0, "", 0.0)
    failed = BuildResult(None, int(ErrorCode.COMPILE_HOST), "no object", 0.0)
    runner = LocalRunner(timeout=PATIENT_S, config=TimingConfig(min_repeat_ms=6, passes=3))
    try:
        a, w, b, f = runner.run(task, [builds[0], wrong, builds[1], failed])
    finally:
        runner.close()
    for r in (a, b):                 # one repeat a pass: later passes only within 2x of the fastest
        assert r.ok and r.fastest and 1 <= len(r.costs) <= 3, r.error_msg
        assert r.latency == min(r.costs) <= float(np.mean(r.costs))
    assert len(min(a, b, key=lambda r: r.latency).costs) == 3      # the fastest is timed in every pass
    assert w.error_code == ErrorCode.WRONG_ANSWER and w.costs == [] and w.latency == float("inf")
    assert f.error_code == ErrorCode.COMPILE_HOST and f.costs == [] and f.run_seconds == 0.0


def test_a_result_of_one_pass_is_the_mean_of_its_repeats():
    assert MeasureResult([1.0, 2.0, 6.0], 0).latency == 3.0
    assert MeasureResult([1.0, 2.0, 6.0], 0, fastest=True).latency == 1.0
    assert MeasureResult([1.0], int(ErrorCode.RUNTIME_DEVICE), fastest=True).latency == float("inf")


def test_bad_steps_are_instantiation_errors(task):
    with ProgramMeasurer(LocalBuilder(n_parallel=1), LocalRunner(config=TimingConfig(min_repeat_ms=5))) as m:
        ok, bad = m.measure(task, [State(task.dag).steps_json(), '[["SP",2,0,32,[64],1]]'])
    assert ok.error_code == ErrorCode.NO_ERROR
    assert bad.error_code == ErrorCode.INSTANTIATION_ERROR and "do not fit" in bad.error_msg


def test_timing_protocol_raises_number_to_fill_min_repeat():
    calls = []

    def run(n: int) -> None:
        calls.append(n)
    costs = time_runs(run, TimingConfig(number=2, repeat=3, min_repeat_ms=1.0))
    assert len(costs) == 3
    assert calls[:2] == [1, 1]                         # warm-up, then one run to estimate
    # an empty run takes microseconds: `number` is raised far past cfg.number to fill 1 ms (and raised
    # again if the estimate fell short); the three repeats run the same number
    assert calls[2:] == sorted(calls[2:]) and calls[-1] == calls[-2] == calls[-3] and calls[-1] > 2


def test_a_slow_first_run_does_not_shorten_the_repeats():
    """The first run estimates `number`; when it was slow (a descheduled process, a cold page), the
    repeat it sizes falls short of min_repeat_ms, and is run again with more until one lasts it."""
    import time
    calls = []

    def run(n: int) -> None:
        calls.append(n)
        time.sleep(0.005 if len(calls) == 1 else 0.0001 * n)     # 5 ms once, then 0.1 ms a run
    costs = time_runs(run, TimingConfig(number=1, repeat=2, min_repeat_ms=10.0), warm=True)
    assert calls[0] == 1 and calls[1] <= 2                      # 10 ms / (5 ms or more): too few
    assert calls[-1] == calls[-2] >= 100 and len(costs) == 2    # every kept repeat lasted >= 10 ms


def test_far_slower_kernels_are_timed_once():
    calls = []

    def run(n: int) -> None:
        calls.append(n)
    costs = time_runs(run, TimingConfig(number=3, repeat=3, min_repeat_ms=10.0), warm=True, cutoff_s=-1.0)
    assert calls == [1] and len(costs) == 1


def test_slow_kernels_run_once_per_repeat():
    calls = []

    def run(n: int) -> None:
        calls.append(n)
        import time
        time.sleep(0.02 * n)
    costs = time_runs(run, TimingConfig(number=3, repeat=2, min_repeat_ms=10.0), warm=True)
    # the run that showed it fills a repeat is the first repeat: two runs for two repeats
    assert calls == [1, 1] and len(costs) == 2 and all(c >= 0.02 for c in costs)


def _huge(task) -> str:
    """Every loop unrolled: millions of statements, a build that takes far longer than any timeout here."""
    return State(task.dag).unroll("C", 0).unroll("C", 1).unroll("C", 2).steps_json()


def test_a_build_timeout_costs_one_result():
    """A build past the timeout is killed, reported, and its worker replaced; the next build succeeds in
    the replacement. The next build gets a budget of its own: a job's clock starts when it is sent, so
    in one 2 s batch the replacement's start-up (a fresh interpreter importing llvmlite) counted against
    it, which a loaded 2-core machine could exceed."""
    task = make_task(make_dag("matmul", 128, 128, 128))
    builder = LocalBuilder(n_parallel=1, timeout=2.0)
    try:
        (first_pid,) = builder.pool.pids()
        (slow,) = builder.build(task, [_huge(task)])
        assert slow.error_code == ErrorCode.BUILD_TIMEOUT and slow.artifact is None
        assert "timed out after 2.0 s" in slow.error_msg
        assert builder.pool.restarts == 1 and builder.pool.pids() != [first_pid]
        builder.pool.timeout = 120.0
        (fine,) = builder.build(task, [State(task.dag).steps_json()])
        assert fine.error_code == ErrorCode.NO_ERROR and fine.artifact is not None
        assert builder.pool.restarts == 1                  # the replacement built it
    finally:
        builder.close()


def test_a_builder_killed_mid_build_costs_one_result():
    import os
    import signal
    import threading
    task = make_task(make_dag("matmul", 128, 128, 128))
    builder = LocalBuilder(n_parallel=1, timeout=60.0)
    try:
        (pid,) = builder.pool.pids()
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        killed, fine = builder.build(task, [_huge(task), State(task.dag).steps_json()])
        assert killed.error_code == ErrorCode.COMPILE_HOST and "SIGKILL" in killed.error_msg
        assert fine.error_code == ErrorCode.NO_ERROR
        assert builder.pool.pids() != [pid]
    finally:
        builder.close()


def test_cache_flush_comes_before_every_timed_run():
    events = []
    costs = time_runs(lambda n: events.append(("run", n)), TimingConfig(number=2, repeat=3, flush_cache=True),
                      flush=lambda: events.append(("flush",)), warm=True)
    assert len(costs) == 3
    assert events == [("flush",), ("run", 1)] * 6


def test_a_cold_repeat_is_the_median_of_its_runs_so_one_preempted_run_does_not_count(monkeypatch):
    clock = [0.0]
    durations = iter([1e-3, 40e-3, 1e-3, 2e-3, 2e-3, 50e-3])     # seconds each cold run takes

    def run(n: int) -> None:
        clock[0] += next(durations)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    costs = time_runs(run, TimingConfig(number=3, repeat=2, flush_cache=True), flush=lambda: None, warm=True)
    assert costs == pytest.approx([1e-3, 2e-3])


def test_a_cold_repeat_that_a_stall_covers_mostly_is_timed_longer(monkeypatch):
    """Two of three cold runs inside one stall: the median alone would record the stall. The repeat gets
    three runs more (and then three more while the median still sits above twice the fastest run)."""
    clock = [0.0]
    durations = [45e-6, 8.2e-3, 8.3e-3, 46e-6, 8.0e-3, 47e-6, 45e-6, 48e-6, 46e-6]
    taken = iter(durations)

    def run(n: int) -> None:
        clock[0] += next(taken)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    costs = time_runs(run, TimingConfig(number=3, repeat=1, flush_cache=True), flush=lambda: None, warm=True)
    assert costs == pytest.approx([float(np.median(durations))]) and costs[0] < 50e-6
    assert next(taken, None) is None                     # all nine runs, and no more
    # a small kernel's two slow runs (69 us for an 8.5 us conv): three runs more settle it
    clock[0], taken = 0.0, iter([8.5e-6, 69e-6, 70e-6, 8.6e-6, 8.4e-6, 8.7e-6, 99.0])
    assert time_runs(run, TimingConfig(number=3, repeat=1, flush_cache=True), flush=lambda: None,
                     warm=True) == pytest.approx([8.65e-6])
    # runs that agree within twice the fastest, or differ by microseconds only, are timed as before
    for agreeing, median in (([1.0e-3, 1.9e-3, 1.5e-3], 1.5e-3), ([5e-6, 12e-6, 11e-6], 11e-6)):
        clock[0], taken = 0.0, iter(agreeing + [99.0])
        assert time_runs(run, TimingConfig(number=3, repeat=1, flush_cache=True), flush=lambda: None,
                         warm=True) == pytest.approx([median])


def test_cold_runs_come_after_flush_and_run_cycles_that_settle(monkeypatch):
    """A kernel whose data settle into the caches over several runs (a network's steady state) is timed
    once it no longer gets faster: untimed flush-and-run cycles until two in a row are no faster than
    0.95 of the fastest so far. One already settled stops after three; none runs more than cold_warmup;
    a run slower than the cutoff ends them; flush comes before every run, cycle or timed."""
    clock, flushes = [0.0], [0]
    taken = iter([])

    def run(n: int) -> None:
        clock[0] += next(taken)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cfg = TimingConfig(number=3, repeat=1, flush_cache=True, cold_warmup=12)

    def timed(durations: list[float], cutoff: float | None = None) -> list[float]:
        nonlocal taken
        taken, flushes[0] = iter(durations + [99.0]), 0
        costs = time_runs(run, cfg, flush=lambda: flushes.__setitem__(0, flushes[0] + 1), warm=True,
                          cutoff_s=cutoff)
        return costs
    # settling: 97 -> 73 -> 66 -> 58 -> 52 us, then 53 and 54 (no faster than 0.95 x 52): timed after them
    assert timed([97e-6, 73e-6, 66e-6, 58e-6, 52e-6, 53e-6, 54e-6, 50e-6, 51e-6, 52e-6]) == pytest.approx([51e-6])
    assert flushes[0] == 10
    # already settled: three cycles (the first has nothing to be faster than), then the three timed runs
    assert timed([50e-6, 51e-6, 49e-6, 50e-6, 52e-6, 51e-6]) == pytest.approx([51e-6]) and flushes[0] == 6
    # never settling: cold_warmup cycles at most
    assert timed([100e-6 * 0.9 ** i for i in range(12)] + [30e-6, 30e-6, 30e-6]) == pytest.approx([30e-6])
    assert flushes[0] == 15
    # a hopeless candidate (slower than the cutoff): no more cycles
    assert timed([5e-3, 5e-3, 5e-3, 5e-3], cutoff=1e-3) == pytest.approx([5e-3]) and flushes[0] == 4
    # NETWORK_TIMING runs them; other configurations (single-operator tuning, benchmarks) do not
    assert NETWORK_TIMING.cold_warmup == timing.COLD_WARMUP > 0 and TimingConfig().cold_warmup == 0


def test_a_runner_with_cache_flush_times_correct_kernels(task):
    good = State(task.dag).split("C", 1, [16]).vectorize("C", 2)
    with ProgramMeasurer(LocalBuilder(n_parallel=1),
                         LocalRunner(config=TimingConfig(number=2, repeat=2, flush_cache=True))) as m:
        (res,) = m.measure(task, [good.steps_json()])
    assert res.error_code == ErrorCode.NO_ERROR and len(res.costs) == 2 and all(c > 0 for c in res.costs)


def _parallel_matmul(threads: int):
    from tests.schedules import tiled_schedule
    task = make_task(make_dag("matmul", 64, 64, 64), f"llvm -num-threads={threads}")
    return task, tiled_schedule(task.dag, parallel=True).steps_json()


def test_kernels_run_on_the_targets_threads_whatever_the_runner_environment():
    """A Dask nanny sets OMP_NUM_THREADS=1 in its workers; the runner's kernels still run on the target's
    thread count (compiled in), and a runner that cannot give them that many is an error, not a timing."""
    from tensortune.codegen.llvm_backend import LLVMKernel
    from tensortune.codegen.measure import build_job
    task, steps = _parallel_matmul(2)
    kernel = LLVMKernel(build_job((task.to_json(), steps, False)))
    kernel(*task.dag.random_inputs(0), *task.dag.empty_outputs())
    assert kernel.threads_seen == 2
    cfg = TimingConfig(min_repeat_ms=1)
    with ProgramMeasurer(runner=LocalRunner(config=cfg, env={"OMP_NUM_THREADS": "1"})) as m:
        (ok,) = m.measure(task, [steps])
    assert ok.ok, ok.error_msg
    with ProgramMeasurer(runner=LocalRunner(config=cfg, env={"OMP_THREAD_LIMIT": "1"})) as m:
        (limited,) = m.measure(task, [steps])
    assert limited.error_code == ErrorCode.RUNTIME_DEVICE and "ran on 1 threads" in limited.error_msg


def test_cold_start_wakes_the_pool_on_the_tasks_threads():
    """Cold network timing prepares each run as the network would leave it: the pool woken on the
    target's threads (the waker's parallel loop ran on all of them)."""
    waker = pool_waker(2)
    cold_start([np.ones(8, np.float32), np.zeros(3, bool)], 2)()
    assert waker.kernel.threads_seen == 2 and pool_waker(2) is waker
