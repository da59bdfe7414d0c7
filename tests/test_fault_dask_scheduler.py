"""The Dask scheduler of a real `dask scheduler` process is killed while DaskMeasurer measures a round.

Restarted on the same port (and its worker by a supervisor, since Dask workers shut down with their
scheduler): the round starts over for the candidates whose results had not been fetched, and every
candidate ends with one successful result. Not restarted: the fetched results stay successes, the rest
become error records saying what happened, and the next round fails at once with one clear line."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tensortune.codegen.target import make_task
from tensortune.codegen.timing import ErrorCode, TimingConfig
from tensortune.flows.dask_cluster import ClusterError, connect, workers_with
from tensortune.flows.dask_measure import DaskMeasurer
from tensortune.search.sketch_policy import SearchParams, SketchPolicy
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import terminate

TIMING = TimingConfig(min_repeat_ms=100, repeat=1)
N = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scheduler(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                             "--port", str(port), "--no-dashboard"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _worker(address: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
                             "--nworkers", "1", "--resources", "measure-cpu=1", "--no-dashboard"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _programs(n: int) -> tuple:
    task = make_task(make_dag("matmul", 48, 48, 48))
    policy = SketchPolicy(task, params=SearchParams(population=32, sample_init_population=32, num_iters=1),
                          seed=7)
    return task, [c.steps_json for c in policy.next_batch(n)]


class KillsTheScheduler(DaskMeasurer):
    """At the second wait for timings that returns finished ones (the first's results are fetched by
    then, this one's are not), SIGKILL the scheduler, then call `after` (restart it, or not)."""

    def __init__(self, *args, scheduler: subprocess.Popen, after, **kw):
        super().__init__(*args, **kw)
        self.scheduler, self.after, self.seen, self.killed_at = scheduler, after, 0, None

    def _wait(self, futures, deadline, return_when="ALL_COMPLETED"):
        super()._wait(futures, deadline, return_when)
        finished = [f for f in futures if str(f.key).startswith("run-") and f.status == "finished"]
        if self.killed_at is None and finished:
            self.seen += 1
            if self.seen == 2:
                os.kill(self.scheduler.pid, signal.SIGKILL)
                self.scheduler.wait()
                self.killed_at = time.monotonic()
                self.after()


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            terminate(process, timeout=20)


def _cluster(processes: list, timeout: float):
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    processes.append(_scheduler(port))
    processes.append(_worker(address))
    deadline = time.monotonic() + 60
    while True:
        try:
            client = connect(address, timeout=timeout)
            break
        except ClusterError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    while not workers_with(client, "measure-cpu") and time.monotonic() < deadline:
        time.sleep(0.2)
    return client, port, address


def test_a_scheduler_restarted_mid_round_costs_a_restart_not_a_measurement(processes):
    client, port, address = _cluster(processes, timeout=30)
    task, steps = _programs(N)

    def restart():  # what a supervisor (compose restart policy, systemd, Kubernetes) does
        processes.append(_scheduler(port))
        processes.append(_worker(address))

    measurer = KillsTheScheduler(client, timing=TIMING, build_timeout=120, run_timeout=120,
                                 resource_wait=90, scheduler=processes[0], after=restart)
    try:
        results = measurer.measure(task, steps)
        assert measurer.killed_at is not None                               # the fault happened
        assert len(results) == N
        assert all(r.ok for r in results), [r.error_msg for r in results if not r.ok]
        assert measurer.stats.restarts == 1 and measurer.stats.lost == 0
        # the timings fetched before the loss were kept: only the others ran again, on the new worker
        again = client.run(lambda dask_worker: sorted({str(e[0]) for e in dask_worker.state.log
                                                       if str(e[0]).startswith("run-")}))
        rerun = [key for keys in again.values() for key in keys]
        assert 0 < len(rerun) < N, rerun
    finally:
        client.close()


def test_a_scheduler_gone_for_good_ends_the_round_with_records_and_one_clear_error(processes):
    client, _, address = _cluster(processes, timeout=3)   # the client gives up reconnecting after 3 s
    task, steps = _programs(N)
    measurer = KillsTheScheduler(client, timing=TIMING, build_timeout=120, run_timeout=120,
                                 resource_wait=10, scheduler=processes[0], after=lambda: None)
    try:
        results = measurer.measure(task, steps)
        assert measurer.killed_at is not None and time.monotonic() - measurer.killed_at < 30
        assert len(results) == N
        ok = [r for r in results if r.ok]
        failed = [r for r in results if not r.ok]
        assert ok and failed                          # fetched ones kept, the others not measured
        for r in failed:
            assert r.error_code == ErrorCode.UNKNOWN_ERROR
            assert r.error_msg.startswith(f"dask: the Dask scheduler at {address} went away mid-round"), r.error_msg
            assert "not measured" in r.error_msg
        started = time.monotonic()
        with pytest.raises(ClusterError, match=f"lost the scheduler at {address} and could not reconnect") as err:
            measurer.measure(task, steps)
        assert "\n" not in str(err.value) and time.monotonic() - started < 5
    finally:
        client.close()
