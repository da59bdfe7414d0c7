"""DaskMeasurer on a real LocalCluster of 2 workers with resources: results in order, a crashing kernel
costs one record (never a Dask worker), timings go only to workers holding the task's resource, a worker
killed mid-round costs retries but no record, one killed holding finished results loses none of them,
and a bad cluster is a clear error."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import dask
import pytest
from distributed import Client, LocalCluster, get_task_stream

from tensortune.codegen.measure import BuildResult, LocalBuilder
from tensortune.codegen.target import make_task
from tensortune.codegen.timing import ErrorCode, TimingConfig
from tensortune.flows.dask_cluster import (
    ClusterError,
    cluster_workers,
    connect,
    dask_client,
    local_resources,
    workers_with,
)
from tensortune.flows.dask_measure import DaskMeasurer
from tensortune.schedule.state import State
from tensortune.search.sketch_policy import SearchParams, SketchPolicy
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import terminate
from tests.test_measure import SEGFAULT, _artifact

TIMING = TimingConfig(min_repeat_ms=2, repeat=1)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, resources={"measure-cpu": 1},
                      dashboard_address=None, host="127.0.0.1") as c, Client(c, set_as_default=False) as client:
        yield client


@pytest.fixture(scope="module")
def task():
    return make_task(make_dag("matmul", 48, 48, 48))


def programs(task, n: int, seed: int = 0) -> list[str]:
    policy = SketchPolicy(task, params=SearchParams(population=32, sample_init_population=32, num_iters=1),
                          seed=seed)
    return [c.steps_json for c in policy.next_batch(n)]


def test_results_come_back_in_order_with_errors_as_records(cluster, task):
    good = State(task.dag).split("C", 1, [16]).vectorize("C", 2).steps_json()
    steps = [State(task.dag).steps_json(), good, '[["SP", 99, 0, 48, [4], 1]]', "not json"]
    results = DaskMeasurer(cluster, timing=TIMING).measure(task, steps)
    assert len(results) == 4
    assert results[0].ok and results[1].ok, [r.error_msg for r in results[:2]]
    assert results[2].error_code == ErrorCode.INSTANTIATION_ERROR
    assert results[3].error_code == ErrorCode.INSTANTIATION_ERROR
    assert all(r.build_seconds > 0 for r in results[:2]) and all(r.run_seconds > 0 for r in results[:2])


def test_a_program_listed_twice_is_built_once_and_timed_twice(cluster, task):
    # how a would-be best is timed again (codegen.confirmation): one build, one timing per entry
    good = State(task.dag).split("C", 1, [16]).vectorize("C", 2).steps_json()
    plain = State(task.dag).steps_json()
    with get_task_stream(client=cluster) as stream:
        results = DaskMeasurer(cluster, timing=TIMING).measure(task, [good, plain, good])
    assert [r.ok for r in results] == [True, True, True]
    keys = [str(t["key"]) for t in stream.data]
    assert sum(k.startswith("build-") for k in keys) == 2 and sum(k.startswith("run-") for k in keys) == 3


def test_a_program_timed_again_in_a_later_call_is_timed_from_its_first_build(cluster, task):
    # and a program whose build failed is built again
    good = State(task.dag).split("C", 1, [16]).vectorize("C", 2).steps_json()
    bad = '[["SP", 99, 0, 48, [4], 1]]'
    measurer = DaskMeasurer(cluster, timing=TIMING)
    with get_task_stream(client=cluster) as stream:
        first = measurer.measure(task, [good, bad])
        again = measurer.measure(task, [good, good, bad])
    assert [r.ok for r in first + again] == [True, False, True, True, False]
    keys = [str(t["key"]) for t in stream.data]
    # builds: good once, bad in each call; a run per entry (a failed build's only passes its error on)
    assert sum(k.startswith("build-") for k in keys) == 3 and sum(k.startswith("run-") for k in keys) == 5


def test_programs_built_ahead_for_many_tasks_are_timed_from_those_builds(cluster, task):
    # a resumed network's re-timing: every task's programs built in one go, then each task timed
    other = make_task(make_dag("matmul", 32, 64, 16))
    good = State(task.dag).split("C", 1, [16]).vectorize("C", 2).steps_json()
    bad = '[["SP", 99, 0, 48, [4], 1]]'
    theirs = State(other.dag).split("C", 1, [16]).vectorize("C", 2).steps_json()
    measurer = DaskMeasurer(cluster, timing=TIMING)
    with get_task_stream(client=cluster) as ahead:
        measurer.build_ahead([(task, [good, bad, good]), (other, [theirs])])
    keys = [str(t["key"]) for t in ahead.data]
    assert sum(k.startswith("build-ahead-") for k in keys) == 3 and not any(k.startswith("run-") for k in keys)
    with get_task_stream(client=cluster) as stream:
        mine, its = measurer.measure(task, [good, good, bad]), measurer.measure(other, [theirs])
    assert [r.ok for r in mine + its] == [True, True, False, True]
    keys = [str(t["key"]) for t in stream.data]
    # no build (the failed one's error is reported from its build ahead, as from a build of the call); a run
    # per entry
    assert not any(k.startswith("build-") for k in keys) and sum(k.startswith("run-") for k in keys) == 4


def test_a_crashing_kernel_costs_one_record_not_a_worker(cluster, task):
    pids = cluster.run(os.getpid)
    builder = LocalBuilder(n_parallel=1)
    try:
        (good,) = builder.build(task, [State(task.dag).split("C", 1, [16]).steps_json()])
    finally:
        builder.close()
    crash = BuildResult(_artifact(SEGFAULT, task.dag), 0, "", 0.0)
    results = DaskMeasurer(cluster, timing=TIMING).run_builds(task, [crash, good, crash, good])
    assert [r.error_code for r in results] == [ErrorCode.RUNTIME_DEVICE, 0, ErrorCode.RUNTIME_DEVICE, 0]
    assert "SIGSEGV" in results[0].error_msg
    assert cluster.run(os.getpid) == pids                      # both Dask workers survived


def test_cuda_timings_need_a_gpu_worker(cluster):
    cuda = make_task(make_dag("matmul", 64, 64, 64), "cuda -arch=sm_90")
    with pytest.raises(ClusterError, match=r"'GPU'.*--resources GPU=1"):
        DaskMeasurer(cluster, resource_wait=0).measure(cuda, [State(cuda.dag).steps_json()])


def test_cuda_builds_need_a_worker_with_nvcc():
    cuda = make_task(make_dag("matmul", 64, 64, 64), "cuda -arch=sm_90")
    with LocalCluster(n_workers=1, threads_per_worker=1, resources={"GPU": 1}, dashboard_address=None,
                      host="127.0.0.1") as c, Client(c, set_as_default=False) as client:
        with pytest.raises(ClusterError, match=r"'nvcc'.*--resources nvcc=4.*CUDA toolkit"):
            DaskMeasurer(client, resource_wait=0).measure(cuda, [State(cuda.dag).steps_json()])


def test_the_embedded_cluster_is_one_measure_node_without_the_stack_sampler():
    import dask
    with dask_client() as client:
        (info,) = cluster_workers(client).values()
        assert info["resources"] == local_resources() and info["nthreads"] == (os.cpu_count() or 1)
        flags = client.run(lambda: dask.config.get("distributed.worker.profile.enabled"))
        assert list(flags.values()) == [False]
    assert dask.config.get("distributed.worker.profile.enabled") is True   # only the workers' config


def test_the_workers_are_asked_of_the_scheduler_not_read_from_a_cache_the_client_refreshes():
    """`client.scheduler_info(n_workers=-1)` reads the client's cached identity after updating it; the
    client's periodic refresh (every 2 s, here every 5 ms) may overwrite it between the two with one that
    lists no workers. `cluster_workers` asks the scheduler and keeps the answer."""
    with dask.config.set({"distributed.client.scheduler-info-interval": "5ms"}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as lc, \
            Client(lc, set_as_default=False) as client:
        client.wait_for_workers(2)
        assert all(len(cluster_workers(client)) == 2 for _ in range(1000))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_cluster_is_a_clear_error():
    with pytest.raises(ClusterError, match=r"cannot reach the Dask scheduler at tcp://127.0.0.1:\d+.*dask scheduler"):
        connect(f"tcp://127.0.0.1:{_free_port()}", timeout=2)
    with pytest.raises(ClusterError, match="no scheme"):
        connect("somehost:8786")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is needed to build CUDA candidates")
def test_cuda_timings_go_only_to_the_gpu_worker_and_cpu_timings_never(cluster, task):
    """A real `dask worker --resources GPU=1,nvcc=2` joins: CUDA builds and timings run there only (the
    CPU workers may have no nvcc), CPU timings never do."""
    address = cluster.scheduler.address
    gpu = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
                            "--nworkers", "1", "--resources", "GPU=1,nvcc=2", "--name", "gpu-test",
                            "--no-dashboard"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not workers_with(cluster, "GPU") and time.monotonic() < deadline:
            time.sleep(0.2)
        (gpu_worker,) = workers_with(cluster, "GPU")
        cuda = make_task(make_dag("matmul", 64, 64, 64), "cuda -arch=sm_90")
        with get_task_stream(client=cluster) as stream:
            DaskMeasurer(cluster, timing=TIMING).measure(cuda, programs(cuda, 2))
        cuda_runs = [t["worker"] for t in stream.data if str(t["key"]).startswith("run-")]
        cuda_builds = [t["worker"] for t in stream.data if str(t["key"]).startswith("build-")]
        with get_task_stream(client=cluster) as stream:
            DaskMeasurer(cluster, timing=TIMING).measure(task, programs(task, 4))
        cpu_runs = [t["worker"] for t in stream.data if str(t["key"]).startswith("run-")]
        assert len(cuda_runs) == 2 and set(cuda_runs) == {gpu_worker}
        assert len(cuda_builds) == 2 and set(cuda_builds) == {gpu_worker}
        assert len(cpu_runs) == 4 and set(cpu_runs) <= set(workers_with(cluster, "measure-cpu"))
    finally:
        terminate(gpu, timeout=20)


def kill_a_timing_worker(client: Client, pids: dict[str, int], timeout: float = 60.0) -> int:
    """SIGKILL (by pid) the first worker seen timing a candidate; returns the pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker, keys in client.processing().items():
            if any(str(k).startswith("run-") for k in keys) and worker in pids:
                os.kill(pids[worker], signal.SIGKILL)
                return pids[worker]
        time.sleep(0.02)
    raise AssertionError("no timing started on any worker")


def test_a_worker_killed_mid_round_costs_retries_not_records(cluster, task):
    steps = programs(task, 10, seed=3)
    pids = cluster.run(os.getpid)
    # a retried timing lands on the nanny's new worker, whose runner process starts (a fresh interpreter
    # importing llvmlite) inside the job's timeout: on a loaded 2-core machine that once took past the
    # default 10 s, so the timeouts here are ones no start-up reaches; what is checked is the retry
    measurer = DaskMeasurer(cluster, timing=TimingConfig(min_repeat_ms=150, repeat=1), build_timeout=120,
                            run_timeout=120)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("results", measurer.measure(task, steps)))
    thread.start()
    killed = kill_a_timing_worker(cluster, pids)
    thread.join(timeout=300)
    results = out["results"]
    assert len(results) == len(steps)
    assert all(r.ok for r in results), [r.error_msg for r in results if not r.ok]
    assert killed not in cluster.run(os.getpid).values()        # that worker is gone (the nanny made a new one)


class KillsAWorkerHoldingResults(DaskMeasurer):
    """Fault injection at the measurer's weakest moment: right after a wait for timings returns (some
    have finished, their results still on the workers), SIGKILL the worker holding the most of them,
    once. A measurer that collects results after that moment without re-timing the lost ones records
    finished measurements as errors."""

    def __init__(self, *args, pids: dict[str, int], **kw):
        super().__init__(*args, **kw)
        self.pids, self.killed, self.held = pids, None, 0

    def _wait(self, futures, deadline, return_when="ALL_COMPLETED"):
        super()._wait(futures, deadline, return_when)
        runs = [f for f in futures if str(f.key).startswith("run-") and f.status == "finished"]
        if self.killed is None and runs:
            holders: dict[str, int] = {}
            for workers in self.client.who_has(runs).values():
                for w in workers:
                    holders[w] = holders.get(w, 0) + 1
            worker = max((w for w in holders if w in self.pids), key=holders.get, default=None)
            if worker is not None:
                os.kill(self.pids[worker], signal.SIGKILL)
                self.killed, self.held = self.pids[worker], holders[worker]
                until = time.monotonic() + 30       # return once the client knows those results are gone
                while time.monotonic() < until and not any(f.status == "lost" for f in runs):
                    time.sleep(0.01)


def test_a_worker_killed_holding_finished_results_loses_no_measurement(cluster, task):
    steps = programs(task, 8, seed=5)
    measurer = KillsAWorkerHoldingResults(cluster, timing=TIMING, build_timeout=120, run_timeout=120,
                                          pids=cluster.run(os.getpid))
    results = measurer.measure(task, steps)
    assert measurer.killed is not None and measurer.held >= 1        # the fault happened
    assert len(results) == len(steps)
    assert all(r.ok for r in results), [r.error_msg for r in results if not r.ok]
    assert measurer.stats.lost == 0
    assert measurer.killed not in cluster.run(os.getpid).values()


def _executing(log: list, prefix: str) -> list[tuple[int, int]]:
    """(position in the worker's transition log, number of `prefix` tasks executing just after it) at
    every task of that kind entering or leaving `executing`, in the log's order."""
    running: set = set()
    out = []
    for pos, entry in enumerate(log):
        if len(entry) < 3 or not str(entry[0]).startswith(prefix):
            continue
        key, start, finish = entry[:3]
        if finish == "executing":
            running.add(key)
        elif start == "executing":
            running.discard(key)
        else:
            continue
        out.append((pos, len(running)))
    return out


def test_one_timing_at_a_time_per_node_while_builds_run_in_parallel(task):
    """One worker with two threads and measure-cpu=1 (the deploy spec of a CPU node): the resource
    keeps timings apart (a timing must not share the node), while builds use both threads.

    Checked on the worker's own log of task transitions, which is in the order they happened: the
    task stream's wall-clock stamps are taken a few ms after a task's resource was freed, so a timing
    could look as if it overlapped the next one on a busy machine."""
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=True, resources={"measure-cpu": 1},
                      dashboard_address=None, host="127.0.0.1") as c, Client(c, set_as_default=False) as client:
        slow = TimingConfig(min_repeat_ms=30, repeat=2)
        results = DaskMeasurer(client, timing=slow).measure(task, programs(task, 8, seed=5))
        assert sum(r.ok for r in results) >= 6, [r.error_msg[:200] for r in results]
        (log,) = client.run(lambda dask_worker: [tuple(e[:3]) for e in dask_worker.state.log]).values()
        runs, builds = _executing(log, "run-"), _executing(log, "build-")
        assert len(runs) == len(builds) == 2 * 8                          # each started and finished once
        assert max(n for _, n in runs) == 1, runs                          # never two timings at once
        assert max(n for _, n in builds) == 2, builds                      # builds ran two at a time
        assert builds[-1][0] < runs[0][0]                                  # no build beside a timing
