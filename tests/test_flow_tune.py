"""The tune-network flow against a real Prefect API (the test harness) on a real LocalCluster of 2 workers
with resources: a 2-task network (an ONNX file) is tuned for a few rounds while a worker is killed
mid-round; every record lands in Parquet, the artifacts and the Completed state are read back through the
API, cost models are stored with metrics, and a second run resumes from the history."""
from __future__ import annotations

import os
import re
import threading
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest

from tensortune.codegen.target import parse_target
from tensortune.flows.artifacts import artifact_key
from tensortune.flows.tune_flow import time_network_on_cluster, tune_network_flow
from tensortune.flows.tuning import default_programs, network_tasks
from tensortune.storage.models import ModelStore
from tensortune.storage.records import RecordStore
from tensortune.tasks.models import load_graph
from tests.test_flow_dask_measure import kill_a_timing_worker

SMALL = dict(per_round=8, retrain_every=2, model_warmup=16,
             search=dict(population=64, sample_init_population=64, num_iters=1),
             timing=dict(min_repeat_ms=40, repeat=1))


def two_task_onnx(path: str) -> str:
    """x[16,64] -> MatMul+Add+Relu -> MatMul -> y[16,32]: two tuning tasks."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)

    def init(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "two-task-mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 32])],
                              [init("w1", 64, 48), init("b1", 48), init("w2", 48, 32)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def read_back(flow_run_id):
    """The flow run and its artifacts, through the Prefect API."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    flow_run_id = UUID(str(flow_run_id))
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return run, found, task_runs


def test_flow_tunes_a_two_task_network_loses_no_record_and_resumes(tmp_path, prefect_api, flow_cluster):
    network = two_task_onnx(str(tmp_path / "mlp.onnx"))
    records = str(tmp_path / "records")
    address = flow_cluster.scheduler.address
    pids = flow_cluster.run(os.getpid)

    # first run: 32 trials in 4 rounds of 8, one Dask worker killed by its pid while it times a candidate
    out = {}
    run = threading.Thread(target=lambda: out.setdefault("state", tune_network_flow(
        network, trials=32, records=records, cluster=address, return_state=True, **SMALL)))
    run.start()
    killed = kill_a_timing_worker(flow_cluster, pids, timeout=120)
    run.join(timeout=600)
    state = out["state"]
    assert state.is_completed(), state
    first = state.result()
    assert killed not in flow_cluster.run(os.getpid).values()

    # records: real Parquet, one row per measured program, none lost to the kill (the store's private
    # folders, '_models', '_features', hold no records: Parquet readers skip them)
    files = [os.path.join(d, f) for d, _, fs in os.walk(records) for f in fs if f.endswith(".parquet")
             and not any(p.startswith("_") for p in os.path.relpath(d, records).split(os.sep))]
    assert files and sum(pq.read_metadata(f).num_rows for f in files) == 32
    store = RecordStore(records)
    frame = store.read()
    assert len(frame) == 32 and frame["workload_key"].nunique() == 2
    assert set(frame["flow_run_id"]) == {str(state.state_details.flow_run_id)}
    assert not frame["error_msg"].str.startswith("dask:").any()
    assert (frame["error_code"] == 0).sum() >= 30, frame[["error_code", "error_msg"]]
    assert first["trials"] == 32 and first["rounds"] == 4
    # every record says the configuration it was timed in: the target's thread count, not the worker's
    threads = parse_target("llvm").num_threads
    assert (frame["num_threads"] == threads).all() and (frame["target"] == str(parse_target("llvm"))).all()
    # the run ends with the network built from its best records, checked, timed beside the estimate
    timing = first["network_timing"]
    assert timing["passed"] and timing["tuned_tasks"] == 2 and timing["target"] == str(parse_target("llvm"))
    assert timing["estimate_s"] == pytest.approx(first["estimate_after_s"], rel=1e-9)
    assert timing["measured_s"] > 0 and timing["gap"] == pytest.approx(
        timing["measured_s"] / timing["estimate_s"] - 1)

    # and with the night's library, compiled from the same records, checked, written beside them
    library = first["library"]
    assert library["passed"] and library["tuned"] == 2 and library["folder"].startswith(records + "/_compiled/mlp/")
    assert sorted(os.listdir(library["folder"])) == ["manifest.json", "two_task_mlp.so", "two_task_mlp.weights.bin"]

    # the flow run and its artifacts, read back through the Prefect API
    flow_run, found, task_runs = read_back(state.state_details.flow_run_id)
    assert flow_run.state.is_completed() and re.fullmatch(r"mlp-llvm-\d{4}-\d\d-\d\d-\d{4}", flow_run.name)
    # one Prefect task run per step and per round (not per candidate), all Completed
    names = sorted(t.name for t in task_runs)
    assert all(t.state.is_completed() for t in task_runs), [(t.name, t.state.type) for t in task_runs]
    assert any(n.startswith("extract-tasks") for n in names) and any(n.startswith("load-history") for n in names)
    assert {"retrain-start", "retrain-r2", "retrain-r4"} <= set(names), names
    assert sum(n.startswith("search-r") for n in names) == 4 and sum(n.startswith("measure-r") for n in names) == 4
    assert any(n.startswith("build-and-time-network") for n in names)
    assert any(n.startswith("compile-network") for n in names)
    by_key = {a.key: a for a in found}
    network_md = by_key[artifact_key(network, "llvm", "network")].data
    assert "measured end to end" in network_md and "2/2" in network_md and "OK" in network_md
    assert by_key[artifact_key(network, "llvm", "library")].data.endswith("](file://" + library["folder"] + ")")
    # the round timeline: one line per round, where its time went
    timeline = by_key[artifact_key(network, "llvm", "rounds")].data
    timeline = timeline if isinstance(timeline, list) else __import__("json").loads(timeline)
    assert [r["round"] for r in timeline] == [0, 1, 2, 3] and all(r["programs"] == 8 for r in timeline)
    assert all(r["search s"] > 0 and r["build s"] > 0 and r["timing s"] > 0 for r in timeline), timeline
    assert [r["retrain s"] > 0 for r in timeline] == [False, True, False, True]     # retrained every 2 rounds
    searches = sorted(r["search s"] for r in timeline)
    assert first["round_median_s"]["search_s"] == pytest.approx((searches[1] + searches[2]) / 2, abs=2e-3)
    by_type = {a.type: a for a in found if a.key not in (artifact_key(network, "llvm", "network"),
                                                         artifact_key(network, "llvm", "library"),
                                                         artifact_key(network, "llvm", "rounds"))}
    assert set(by_type) >= {"progress", "table", "markdown"}
    assert float(by_type["progress"].data) == 100.0
    assert by_type["table"].key == artifact_key(network, "llvm", "tasks")
    rows = by_type["table"].data
    rows = rows if isinstance(rows, list) else __import__("json").loads(rows)
    assert len(rows) == 2 and all(r["GFLOP/s"] > 0 and r["trials (this run)"] > 0 for r in rows)
    assert "runtime default schedules" in by_type["markdown"].data and "after this run" in by_type["markdown"].data

    # cost models: retrained every 2 rounds from the store, versioned, with metrics
    models = ModelStore(records).list()
    assert len(models) == 2 and (models["record_count"] == [16, 32]).all()
    assert "metric.pairwise_accuracy" in models
    # the second model's figures, of the first model on rounds 2-3's programs, per task (8 a round, one task
    # a round; the first training held none out: too few a task) and their mean; the task table shows each
    # task's latest
    second_model = models.loc[models["record_count"] == 32].iloc[0]
    per_task = second_model["metric.per_task"]
    assert per_task and all(0 <= a <= 1 and 0 <= r <= 1 and n in (8, 16) for a, r, n in per_task.values()), per_task
    assert second_model["metric.pairwise_accuracy"] == pytest.approx(np.mean([a for a, _, _ in per_task.values()]))
    keys = [t.workload_key for t in network_tasks(load_graph(network), str(parse_target("llvm")))[1]]
    assert {keys[r["#"]]: r["model accuracy (latest)"] for r in rows if r["model accuracy (latest)"] is not None} \
        == {key: round(a, 3) for key, (a, _, _) in per_task.items()}
    # rounds 0-1 ran before any model existed; rounds 2-3 used the one trained from their 16 records
    first_model = models.loc[models["record_count"] == 16, "version"].iloc[0]
    assert set(frame.loc[frame["round"] < 2, "model_version"]) == {""}
    assert set(frame.loc[frame["round"] >= 2, "model_version"]) == {first_model}

    assert (models["metric.n_programs"] == models["record_count"]).all()     # 16 a task at most: all trained

    # second run: resumes; times each task's three best stored programs again first, measures no new
    # program twice, and starts from the stored bests as timed now; its models train on at most 12 programs
    # of a task (--train-programs)
    state2 = tune_network_flow(network, trials=16, records=records, cluster=address, return_state=True,
                               train_programs=12, **SMALL)
    assert state2.is_completed(), state2
    second = state2.result()
    frame2 = store.read()
    retimed = frame2[frame2["retiming"]]
    assert len(frame2) == 48 + 6 and len(retimed) == 6
    assert set(retimed["flow_run_id"]) == {str(state2.state_details.flow_run_id)}
    assert (retimed.groupby("workload_key")["timestamp"].nunique() == 1).all()
    assert set(zip(retimed["workload_key"], retimed["steps"])) <= set(zip(frame["workload_key"], frame["steps"]))
    assert not frame2[~frame2["retiming"]].duplicated(["workload_key", "steps"]).any()
    assert second["estimate_stored_s"] == pytest.approx(first["estimate_after_s"], rel=1e-9)
    now = retimed.query("error_code == 0").groupby("workload_key")["mean_latency"].min()
    _, tasks = network_tasks(load_graph(network), str(parse_target("llvm")))
    assert second["estimate_before_s"] == pytest.approx(sum(t.weight * now[t.workload_key] for t in tasks),
                                                        rel=1e-9)
    assert second["estimate_after_s"] <= second["estimate_before_s"]
    # "speedup vs default" is against each default schedule's newest timing: its re-timing, where it was
    # among the programs timed again
    defaults = {t.workload_key: default_programs(t)[0].steps_json() for t in tasks}
    ran = frame2[frame2["error_code"] == 0]
    newest = {key: ran[(ran["workload_key"] == key) & (ran["steps"] == steps)]["mean_latency"].iloc[-1]
              for key, steps in defaults.items()}
    assert second["estimate_default_s"] == pytest.approx(sum(t.weight * newest[t.workload_key] for t in tasks),
                                                         rel=1e-9)
    names2 = [t.name for t in read_back(state2.state_details.flow_run_id)[2]]
    assert any(n.startswith("retime-stored-bests") for n in names2), names2
    assert [r["trials (total)"] for r in second["tasks"]] == [
        a["trials (total)"] + b["trials (this run)"] for a, b in zip(first["tasks"], second["tasks"])]
    models2 = ModelStore(records).list().iloc[len(models):]
    assert len(models2) >= 2 and models2["record_count"].iloc[0] == 32     # retrained at the start from the history
    assert (models2["metric.n_programs"] == 2 * 12).all()                  # ... on 12 of each task's 24 or more

    # third run: every task has a stored program (no warm-up round is owed) and the estimate already meets
    # the latency target, so the run measures nothing of its 64 trials
    state3 = tune_network_flow(network, trials=64, records=records, cluster=address, return_state=True,
                               latency_target_ms=1e6, **SMALL)
    assert state3.is_completed(), state3
    third = state3.result()
    assert third["trials"] == 0 and third["rounds"] == 0
    assert third["estimate_stored_s"] == pytest.approx(second["estimate_after_s"], rel=1e-9)
    assert third["estimate_after_s"] == third["estimate_before_s"]
    # programs, not records: the re-timings of the second run count no trial
    assert [r["trials (total)"] for r in third["tasks"]] == [r["trials (total)"] for r in second["tasks"]]
    assert (~store.read()["retiming"]).sum() == 48


def test_a_bad_cluster_address_fails_the_run_with_what_to_do(tmp_path, prefect_api):
    from tensortune.flows.dask_cluster import ClusterError
    network = two_task_onnx(str(tmp_path / "mlp.onnx"))
    state = tune_network_flow(network, trials=8, records=str(tmp_path / "r"), cluster="tcp://127.0.0.1:9",
                              return_state=True, **SMALL)
    assert state.is_failed()
    with pytest.raises(ClusterError, match="cannot reach the Dask scheduler at tcp://127.0.0.1:9"):
        state.result()


def test_a_large_network_goes_to_the_measure_worker_ahead_of_its_timing_job(tmp_path, flow_cluster):
    """The network's last step times it on a measure worker: the network is scattered to the cluster
    ahead of the job, not pickled into the task graph the scheduler holds (Dask warns of graphs over
    10 MB; this network's weight is 16 MB), and still built, checked against NumPy and timed there."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    w = (np.random.default_rng(0).standard_normal((64, 61440)) * 0.1).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "wide-matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 61440])],
                              [numpy_helper.from_array(w, "w")])
    path = str(tmp_path / "wide.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    target = "llvm -num-threads=1"
    net, _ = network_tasks(load_graph(path), target)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        timing = time_network_on_cluster(flow_cluster, net, str(tmp_path / "records"), target, repeat=2)
    assert timing.passed, timing.check
    assert timing.measured_s > 0
    assert not [w for w in seen if "large graph" in str(w.message)], [str(w.message) for w in seen]
