"""Overlapped rounds (issue 19): where a builder shares no node with a timing worker, the next round is
searched and built while this one is timed. Two nodes are stood in for by two loopback addresses: a
measure worker on 127.0.0.1 and a build-only worker on 127.0.0.2, both real `dask worker` processes; the
flow process is said to run on a third node (`here`), as on a deployment's flow host. On one machine
(`here` the default), nothing overlaps: the embedded LocalCluster keeps its rounds as they were."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from distributed import Client, LocalCluster
from prefect import flow

from tensortune.codegen.target import make_task
from tensortune.codegen.timing import TimingConfig
from tensortune.flows.dask_cluster import CPU_RESOURCE, cluster_workers, workers_with
from tensortune.flows.dask_measure import DaskMeasurer
from tensortune.flows.tune_flow import tune_tasks
from tensortune.search.sketch_policy import SearchParams, SketchPolicy
from tensortune.search.task_scheduler import TaskScheduler
from tensortune.storage.records import RecordStore
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import terminate

TIMING = TimingConfig(min_repeat_ms=40, repeat=1)
ELSEWHERE = frozenset({"10.255.255.1"})        # the flow process's node: neither worker's


def _worker(address: str, host: str, resources: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--host", host,
                             "--nworkers", "1", "--nthreads", "1", "--no-dashboard", *resources],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def two_nodes():
    """(client, measure worker, build worker): a scheduler, a measure node and a build-only node."""
    with LocalCluster(n_workers=0, dashboard_address=None, host="127.0.0.1") as cluster, \
            Client(cluster, set_as_default=False) as client:
        procs = [_worker(cluster.scheduler_address, "127.0.0.1", ["--resources", f"{CPU_RESOURCE}=1"]),
                 _worker(cluster.scheduler_address, "127.0.0.2", [])]
        try:
            deadline = time.monotonic() + 120
            while len(cluster_workers(client)) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            workers = cluster_workers(client)
            assert len(workers) == 2, "the workers did not join within 120 s"
            (timer,) = workers_with(client, CPU_RESOURCE)
            (builder,) = set(workers) - {timer}
            assert workers[builder]["host"] == "127.0.0.2"
            client.get_task_stream()        # the scheduler records task streams from the first call on
            yield client, timer, builder
        finally:
            for p in procs:
                terminate(p)


def _batch(task, n: int, seed: int) -> list[str]:
    policy = SketchPolicy(task, params=SearchParams(population=64, sample_init_population=64, num_iters=1),
                          seed=seed)
    return [c.steps_json for c in policy.next_batch(n)]


def _compute(stream: list[dict], prefix: str) -> list[tuple[str, str, float, float]]:
    """(key, worker, start, stop) of each computation whose key starts with `prefix`."""
    out = []
    for rec in stream:
        key = rec["key"] if isinstance(rec["key"], str) else str(rec["key"])
        for ss in rec["startstops"]:
            if key.startswith(prefix) and ss["action"] == "compute":
                out.append((key, rec["worker"], ss["start"], ss["stop"]))
    return out


def test_a_batch_is_built_off_the_timing_node_while_another_is_timed(two_nodes):
    client, timer, builder = two_nodes
    assert DaskMeasurer(client).prebuild_workers(make_task(make_dag("matmul", 8, 8, 8))) == []   # one machine
    measurer = DaskMeasurer(client, timing=TIMING, here=ELSEWHERE)
    task = make_task(make_dag("matmul", 64, 64, 64))
    assert measurer.prebuild_workers(task) == [builder]
    first, second = _batch(task, 8, seed=1), _batch(task, 8, seed=2)
    start = time.time()
    out: dict[str, list] = {}
    timing = threading.Thread(target=lambda: out.setdefault("first", measurer.measure(task, first)))
    timing.start()
    deadline = time.monotonic() + 120
    while not _compute(client.get_task_stream(start=start), f"run-{task.name}") and time.monotonic() < deadline:
        time.sleep(0.05)                     # the first batch's timings have begun
    assert measurer.prebuild(task, second)
    timing.join(timeout=300)
    results = measurer.measure(task, second)
    assert all(r.ok for r in out["first"] + results), [r.error_msg for r in out["first"] + results if not r.ok]

    stream = client.get_task_stream(start=start)
    prebuilt, runs = _compute(stream, "prebuild-"), _compute(stream, f"run-{task.name}")
    assert len(prebuilt) == len(second) and {w for _, w, _, _ in prebuilt} == {builder}
    assert {w for _, w, _, _ in runs} == {timer} and len(runs) == len(first) + len(second)
    assert len(_compute(stream, f"build-{task.name}")) == len(first)   # the second batch was built once
    first_runs_end = max(stop for key, _, _, stop in sorted(runs, key=lambda r: r[2])[:len(first)])
    assert min(s for _, _, s, _ in prebuilt) < first_runs_end            # built while the first was timed


@flow(name="overlap-test", persist_result=False)
def _tune(tasks, records, measurer):
    return tune_tasks(tasks, network="two-matmuls", trials=24, records=records, measurer=measurer, per_round=4,
                      search={"population": 64, "sample_init_population": 64, "num_iters": 1})


def test_overlapped_rounds_lose_no_trial_and_never_measure_a_program_twice(two_nodes, tmp_path, prefect_api):
    """The flow's loop with overlap: the warm-up still gives each task its first round in order, every
    trial of the budget is measured once, and the rounds after the first were built on the build node."""
    client, timer, builder = two_nodes
    tasks = [make_task(make_dag("matmul", 32, 32, 32)), make_task(make_dag("matmul", 48, 32, 16))]
    records = str(tmp_path / "records")
    start = time.time()
    summary = _tune(tasks, records, DaskMeasurer(client, timing=TIMING, here=ELSEWHERE))
    assert summary["trials"] == 24 and summary["rounds"] == 6
    frame = RecordStore(records).read()
    assert len(frame) == 24 and not frame.duplicated(["workload_key", "steps"]).any()
    first_rounds = frame.groupby("round")["workload_key"].first()
    assert [first_rounds[0], first_rounds[1]] == [t.workload_key for t in tasks]     # the warm-up, in order
    stream = client.get_task_stream(start=start)
    prebuilt = _compute(stream, "prebuild-")
    # the first round and the one after the warm-up's last task waited for results; the rest overlapped
    assert len(prebuilt) >= 8 and {w for _, w, _, _ in prebuilt} == {builder}


def test_a_policy_never_proposes_a_program_still_in_flight():
    task = make_task(make_dag("matmul", 4, 4, 4))        # a small space: two rounds would share programs
    policy = SketchPolicy(task, params=SearchParams(population=64, sample_init_population=64, num_iters=1), seed=3)
    first = policy.next_batch(16)
    second = policy.next_batch(16)                # searched while the first is being measured
    assert len(first) == len(second) == 16 and not {c.key for c in first} & {c.key for c in second}
    assert set(policy.in_flight) == {c.key for c in first + second}
    policy.update(first, [1e-4] * len(first))
    assert set(policy.in_flight) == {c.key for c in second}


def test_the_round_chosen_ahead_keeps_the_warm_up_order():
    """While task 0's first round is measured, task 1 gets its first; while the warm-up's last task is
    measured there is nothing to choose ahead (the gradient needs its result); after the warm-up, the
    strategy chooses from what is known, the busy task included."""
    tasks = [make_task(make_dag("matmul", n, 32, 32)) for n in (16, 32)]
    sched = TaskScheduler(tasks, strategy="round-robin")
    assert sched.choose_ahead(busy=0) == 1
    sched.record(0, [1e-4])
    assert sched.choose_ahead(busy=1) is None
    sched.record(1, [2e-4])
    assert sched.choose_ahead(busy=0) in (0, 1)
