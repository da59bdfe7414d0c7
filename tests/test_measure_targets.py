"""The target is the measuring machines' (issue 21): a bare `llvm` resolves from what the measure workers
report, nodes that differ are a clear error, and an explicit target is timed only on its own nodes.

Two "nodes" here are two `dask worker` processes on this machine, started the way the deployment starts
workers; one states another CPU through TENSORTUNE_MEASURE_TARGET, as an operator would on a node."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from distributed import Client, LocalCluster, get_task_stream

from tensortune.codegen.target import make_task, parse_target
from tensortune.codegen.timing import TimingConfig
from tensortune.flows.dask_cluster import CPU_RESOURCE, ClusterError, cluster_workers, workers_with
from tensortune.flows.dask_measure import DaskMeasurer
from tensortune.flows.measure_targets import TARGET_ENV, resolve_measure_target
from tensortune.flows.measure_targets import measure_node_targets as node_targets
from tensortune.schedule.state import State
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import terminate

HOST = parse_target("llvm")
OTHER_CPU = "sapphirerapids" if HOST.cpu != "sapphirerapids" else "znver4"


def test_a_bare_llvm_is_the_nodes_target_with_their_features():
    node = f"llvm -mcpu={HOST.cpu} -mattr={HOST.features} -num-threads=3"
    got = resolve_measure_target("llvm", {"tcp://a:1": node, "tcp://b:1": node})
    assert parse_target(got.target) == parse_target(node) and got.workers == ("tcp://a:1", "tcp://b:1")
    assert parse_target(got.target).num_threads == 3                       # the nodes' cores, not ours
    assert parse_target(got.target).hardware == parse_target(node).hardware   # vector width from their features
    assert parse_target(resolve_measure_target("llvm -num-threads=1", {"tcp://a:1": node}).target).num_threads == 1


def test_nodes_that_differ_are_named_in_the_error():
    nodes = {"tcp://a:1": f"llvm -mcpu={HOST.cpu} -num-threads=2",
             "tcp://b:1": f"llvm -mcpu={OTHER_CPU} -num-threads=2"}
    with pytest.raises(ClusterError, match="different machines") as err:
        resolve_measure_target("llvm", nodes)
    assert "tcp://a:1" in str(err.value) and OTHER_CPU in str(err.value) and "-mcpu=" in str(err.value)
    assert resolve_measure_target(f"llvm -mcpu={OTHER_CPU}", nodes).workers == ("tcp://b:1",)
    with pytest.raises(ClusterError, match="no measure worker has the CPU"):
        resolve_measure_target("llvm -mcpu=cortex-a72", nodes)


def _worker(address: str, name: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nworkers", "1",
                             "--nthreads", "1", "--resources", f"{CPU_RESOURCE}=1", "--name", name, "--no-dashboard"],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_two_nodes_of_different_cpus_on_a_real_cluster():
    with LocalCluster(n_workers=0, dashboard_address=None, host="127.0.0.1") as cluster, \
            Client(cluster, set_as_default=False) as client:
        procs = [_worker(cluster.scheduler_address, "here", {}),
                 _worker(cluster.scheduler_address, "other", {TARGET_ENV: f"llvm -mcpu={OTHER_CPU} -num-threads=2"})]
        try:
            deadline = time.monotonic() + 120
            while len(workers_with(client, CPU_RESOURCE)) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            names = {info["name"]: addr for addr, info in cluster_workers(client).items()}
            assert set(names) == {"here", "other"}, "the workers did not join within 120 s"
            reported = node_targets(client)
            assert parse_target(reported[names["here"]]).cpu == HOST.cpu
            assert parse_target(reported[names["other"]]).cpu == OTHER_CPU
            with pytest.raises(ClusterError, match="different machines"):
                resolve_measure_target("llvm", reported)

            where = resolve_measure_target(f"llvm -mcpu={HOST.cpu} -num-threads=1", reported)
            assert where.workers == (names["here"],)
            task = make_task(make_dag("matmul", 32, 32, 32), where.target)
            steps = [State(task.dag).steps_json(), State(task.dag).split("C", 1, [16]).steps_json()] * 3
            measurer = DaskMeasurer(client, timing=TimingConfig(min_repeat_ms=2), workers=where.workers)
            with get_task_stream(client) as stream:
                results = measurer.measure(task, steps)
            assert all(r.ok for r in results), [r.error_msg for r in results]
            timed_on = {t["worker"] for t in stream.data if str(t["key"]).startswith("run-")}
            assert timed_on == {names["here"]}
        finally:
            for p in procs:
                terminate(p)
