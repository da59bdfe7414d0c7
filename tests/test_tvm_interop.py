"""TVM auto_scheduler's tuning logs in and out: the format, the step numbering, the shared workloads,
and the two commands.

The hand-written log lines below follow the lines TVM's own tutorials keep as CI logs
(gallery/how_to/tune_with_autoscheduler/ci_logs/matmul.json for `matmul_add` on llvm, conv2d.json for
`conv2d_layer` on cuda, a v0.2 line with the short task list), at smaller sizes; the stage numbers in
them are TVM's, which differ from ours wherever TVM's topological order does.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from typer.testing import CliRunner

from tensortune.codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
from tensortune.codegen.target import make_task, parse_target
from tensortune.codegen.timing import TimingConfig
from tensortune.flows.cli import app
from tensortune.flows.tuning import apply_best, tune_task
from tensortune.flows.tvm_interop import export_log, import_log
from tensortune.schedule.state import State
from tensortune.schedule.tvm_steps import UnconvertibleSteps, from_tvm, to_tvm, tvm_stage_order
from tensortune.search.sketch_policy import SearchParams
from tensortune.storage.records import MeasureRecord, RecordStore
from tensortune.storage.tvm_records import (
    TVMLogError,
    format_record,
    parse_line,
    read_log,
    target_spec,
    tvm_target,
)
from tensortune.tasks import te
from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.reference import evaluate, mismatch
from tensortune.tasks.tvm_workloads import UnsharedWorkload, from_tvm_key, to_tvm_key
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import check_state
from tests.test_cuda_simulate import check_simulated

runner = CliRunner()

# matmul_add as TVM's matmul tutorial tunes it (stages: A 0, B 1, matmul 2, C 3, out 4): a 2-level
# tiled matmul computed inside the output's tile, the outer tiles fused and parallel, inner vectorised
MATMUL_ADD_STEPS = [
    ["SP", 2, 0, 256, [2, 1, 4], 1], ["SP", 2, 4, 256, [1, 1, 8], 1], ["SP", 2, 8, 256, [4], 1],
    ["RE", 2, [0, 4, 1, 5, 8, 2, 6, 9, 3, 7]], ["FSP", 4, 0, 0, 2], ["FSP", 4, 3, 1, 2],
    ["RE", 4, [0, 3, 1, 4, 2, 5]], ["CA", 2, 4, 3], ["FU", 4, [0, 1]], ["AN", 4, 0, 3],
    ["PR", 2, 0, "auto_unroll_max_step$8"], ["AN", 2, 9, 2], ["AN", 4, 4, 2]]
MATMUL_ADD_LINE = json.dumps({
    "i": [[json.dumps(["matmul_add", 256, 256, 256, "float32"]), "llvm -keys=cpu -num-cores=2",
           [2, 64, 64, 0, 0, 0, 0, 0], "", 0, []], [[], MATMUL_ADD_STEPS]],
    "r": [[0.0044742, 0.0044801], 0, 0.335558, 1607112214], "v": "v0.6"})

# conv2d_layer (conv2d_nchw + bias + relu) as TVM's CUDA conv2d tutorial tunes it: TVM's stages are
# data 0, pad_temp 1, kernel 2, conv 3, bias 4, T_add 5, relu 6; cache reads into shared memory, the
# output's tiles bound to blockIdx.x (AN 5), vthread (AN 4) and threadIdx.x (AN 6): TVM's numbers
CONV_LAYER_STEPS = [
    ["CI", 5], ["SP", 3, 0, 1, [1, 1, 1, 1], 1], ["SP", 3, 5, 16, [1, 8, 2, 1], 1],
    ["SP", 3, 10, 7, [1, 1, 1, 1], 1], ["SP", 3, 15, 7, [1, 1, 7, 1], 1], ["SP", 3, 20, 8, [4, 2], 1],
    ["SP", 3, 23, 3, [1, 1], 1], ["SP", 3, 26, 3, [3, 1], 1],
    ["RE", 3, [0, 5, 10, 15, 1, 6, 11, 16, 2, 7, 12, 17, 20, 23, 26, 21, 24, 27, 3, 8, 13, 18, 22, 25, 28, 4, 9,
               14, 19]],
    ["FSP", 6, 0, 1, 3], ["FSP", 6, 4, 2, 3], ["FSP", 6, 8, 3, 3], ["FSP", 6, 12, 4, 3],
    ["RE", 6, [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]], ["CA", 3, 6, 11],
    ["CHR", 2, "shared", [3]], ["CA", 3, 4, 14], ["CHR", 1, "shared", [4]], ["CA", 2, 5, 14], ["CI", 1],
    ["FU", 8, [0, 1, 2, 3]], ["AN", 8, 0, 5], ["FU", 8, [1, 2, 3, 4]], ["AN", 8, 1, 4],
    ["FU", 8, [2, 3, 4, 5]], ["AN", 8, 2, 6], ["FU", 4, [0, 1, 2, 3]], ["SP", 4, 0, 48, [1], 1],
    ["AN", 4, 1, 2], ["FFSP", 4, 0, [4, 3, 2, 1], 1, 1], ["AN", 4, 1, 6], ["FU", 2, [0, 1, 2, 3]],
    ["SP", 2, 0, 504, [4], 1], ["AN", 2, 1, 2], ["FFSP", 2, 0, [4, 3, 2, 1], 1, 1], ["AN", 2, 1, 6],
    ["PR", 5, 0, "auto_unroll_max_step$512"]]
CONV_LAYER_KEY = json.dumps(["conv2d_layer", 1, 7, 7, 16, 8, 3, 3, [1, 1], [1, 1]])
CONV_LAYER_LINE = json.dumps({   # v0.2: the task is [workload_key, target] only
    "i": [[CONV_LAYER_KEY, "cuda -keys=cuda,gpu -max_num_threads=1024 -thread_warp_size=32"],
          [[], CONV_LAYER_STEPS]], "r": [[0.000429498], 0, 1.59126, 1603259147], "v": "v0.2"})


# ------------------------------------------------------------------------------ the format


def test_lines_parse_in_every_task_form_and_write_back_as_tvm_lays_them_out():
    new, old = parse_line(MATMUL_ADD_LINE), parse_line(CONV_LAYER_LINE)
    assert new.task.hardware_params == (2, 64, 64, 0, 0, 0, 0, 0) and new.costs == (0.0044742, 0.0044801)
    assert new.error_no == 0 and new.timestamp == 1607112214 and new.version == "v0.6"
    assert old.task.hardware_params is None and old.task.target.startswith("cuda") and old.version == "v0.2"
    line = format_record(new)
    assert line.startswith('{"i": [["[\\"matmul_add\\", 256, 256, 256, \\"float32\\"]", "llvm -keys=cpu')
    assert parse_line(line) == new
    # a v0.2 task written back is a full v0.6 task (zero hardware params: TVM's "not given")
    assert json.loads(format_record(old))["i"][0][2:] == [[0] * 8, "", 0, []]


def test_comments_are_skipped_and_bad_lines_say_what_is_wrong():
    text = "\n".join(["# a comment, as in TVM's CI logs", " indented lines are comments too", "",
                      MATMUL_ADD_LINE, '{"i": [], "r": []}', "not json", '{"i": [["k", "llvm"], [[], []]], '
                      '"r": [[1.0], 0, 1.0, 1], "x": 1}'])
    found = list(read_log(text))
    assert [n for n, _ in found] == [4, 5, 6, 7]
    assert not isinstance(found[0][1], TVMLogError)
    assert "\"i\" must be [task, state]" in str(found[1][1])
    assert "not JSON" in str(found[2][1])
    assert "unknown keys ['x']" in str(found[3][1])
    with pytest.raises(TVMLogError, match="costs"):
        parse_line('{"i": [["k", "llvm"], [[], []]], "r": [1.0, 0, 1.0, 1]}')
    with pytest.raises(TVMLogError, match="hardware params"):
        parse_line('{"i": [["k", "llvm", [1, 2]], [[], []]], "r": [[1.0], 0, 1.0, 1]}')


def test_targets_translate_both_ways():
    hw = (4, 64, 64, 0, 0, 0, 0, 0)
    assert tvm_target("llvm -mcpu=znver3 -num-threads=2", hw) == "llvm -keys=cpu -mcpu=znver3 -num-cores=2"
    assert tvm_target("cuda -arch=sm_80", (108, 16, 128, 49152, 0, 1024, 8, 32)) == \
        "cuda -keys=cuda,gpu -arch=sm_80 -max_num_threads=1024 -thread_warp_size=32"
    task = parse_line(MATMUL_ADD_LINE).task
    assert target_spec(task) == ("llvm -num-threads=2", False)            # no -mcpu: this machine's CPU
    pinned = parse_line(MATMUL_ADD_LINE.replace("-keys=cpu -num-cores=2", "-keys=cpu -mcpu=skylake-avx512")).task
    assert target_spec(pinned) == ("llvm -mcpu=skylake-avx512 -num-threads=2", True)   # threads: hw params
    assert target_spec(parse_line(CONV_LAYER_LINE).task) == ("cuda", False)
    assert str(parse_target(target_spec(pinned)[0])) == "llvm -mcpu=skylake-avx512 -num-threads=2"


# ------------------------------------------------------------------------------ workloads and steps


def test_shared_workloads_map_names_and_argument_orders():
    layer = from_tvm_key(CONV_LAYER_KEY)
    assert layer.name == "conv2d_relu" and layer.args == {"N": 1, "H": 7, "W": 7, "CI": 8, "CO": 16, "KH": 3,
                                                          "KW": 3, "stride": 1, "padding": 1, "bias": True,
                                                          "dtype": "float32"}
    assert to_tvm_key("conv2d_relu", layer.args) == CONV_LAYER_KEY
    tutorial = from_tvm_key('["matmul_add", 64, 32, 16, "float32"]')            # TVM's (N, L, M)
    assert tutorial.args == {"N": 64, "M": 16, "K": 32, "dtype": "float32"}
    assert [t.shape for t in tutorial.dag.inputs] == [(64, 32), (32, 16), (64, 16)]
    assert from_tvm_key('["matmul_auto_scheduler_test", 8, 4, 2]').dag.workload_key == \
        from_tvm_key('["matmul", 8, 4, 2]').dag.workload_key == make_dag("matmul", 8, 4, 2).workload_key
    conv = from_tvm_key('["conv2d_nchw", 1, 14, 14, 8, 16, 3, 3, 2, 1]')
    assert conv.dag.workload_key == make_dag("conv2d", 1, 14, 14, 8, 16, 3, 3, 2, 1).workload_key
    assert to_tvm_key("conv2d", conv.args) == '["conv2d_nchw", 1, 14, 14, 8, 16, 3, 3, 2, 1, 1]'
    for key, why in [('["0123456789abcdef0123456789abcdef", [1, 3, 8, 8]]', "hash"),
                     ('["conv2d_nchw_bn_relu_auto_scheduler_test", 1, 7, 7, 8, 8, 3, 1, 1]', "no tensortune"),
                     ('["conv2d_layer", 1, 7, 7, 16, 8, 3, 3, [1, 2], [1, 1]]', "height and width")]:
        with pytest.raises(UnsharedWorkload, match=why):
            from_tvm_key(key)


def test_tvm_stage_order_is_tvms_topological_sort():
    # the tutorials' DAG prints: matmul_add A, B, matmul, C, out; conv2d_layer data, pad_temp, kernel, ...
    for key, names in [('["matmul_add", 8, 8, 8, "float32"]', ["A", "B", "matmul", "C", "out"]),
                       (CONV_LAYER_KEY, ["data", "pad_temp", "kernel", "conv2d_nchw", "bias", "T_add", "T_relu"])]:
        dag = from_tvm_key(key).dag
        assert [dag.tensors[i].name for i in tvm_stage_order(dag)] == names
    # two matmuls sharing A (TVM's parallel_matmul test): TVM orders B, A, D, C, E; we order A, B, D, C, E
    dag = _parallel_matmul()
    assert [dag.tensors[i].name for i in tvm_stage_order(dag)] == ["B", "A", "D", "C", "E"]
    assert [t.name for t in dag.tensors] == ["A", "B", "D", "C", "E"]


def _parallel_matmul(n: int = 16) -> ComputeDAG:
    a, b, c = (te.placeholder((n, n), "float32", x) for x in "ABC")
    k1, k2 = te.reduce_axis(n, "k"), te.reduce_axis(n, "k")
    d = te.compute((n, n), lambda i, j: te.sum(a[i, k1] * b[k1, j], axis=k1), name="D")
    e = te.compute((n, n), lambda i, j: te.sum(a[i, k2] * c[k2, j], axis=k2), name="E")
    return ComputeDAG([a, b, c, d, e])


def test_stage_ids_follow_tvms_order_through_inserted_stages():
    dag = _parallel_matmul()
    # TVM: cache B (its stage 0) for D (its stage 2): the copy is TVM's stage 1, D moves to 3
    tvm_steps = [["CHR", 0, "local", [2]], ["CA", 1, 3, 1], ["SP", 3, 0, 16, [4], 1], ["AN", 3, 0, 3],
                 ["CHW", 5, "local"], ["CA", 5, 6, 1]]
    state = from_tvm(dag, tvm_steps)
    assert [s.name for s in state.stages] == ["A", "B", "B.local", "D", "C", "E.local", "E"]
    assert state.stages[2].attach[0] == "D" and state.stages[5].attach[0] == "E"
    assert state.stages[3].iters[0].annotation == "parallel"
    assert to_tvm(state) == tvm_steps
    check_state(state)


def test_a_tutorial_cpu_line_builds_and_computes_the_reference():
    record = parse_line(MATMUL_ADD_LINE)
    resolved = from_tvm_key(record.task.workload_key)
    state = from_tvm(resolved.dag, record.steps)
    assert "parallel" in str(state) and "vectorize" in str(state)
    assert to_tvm(state) == MATMUL_ADD_STEPS           # TVM's own step list comes back, numbers and all
    check_state(state)


def test_a_tutorial_cuda_line_replays_with_tvms_thread_bindings():
    record = parse_line(CONV_LAYER_LINE)
    state = from_tvm(from_tvm_key(record.task.workload_key).dag, record.steps)
    relu = state.stage_by_name("T_relu")
    assert [it.annotation for it in relu.iters[:3]] == ["blockIdx.x", "vthread", "threadIdx.x"]
    assert relu.iters[2].extent == 8                                      # the ff tile of SP level 1
    assert {s.name: s.scope for s in state.stages if s.scope == "shared"} == {
        "pad_temp.shared": "shared", "kernel.shared": "shared"}
    assert state.stage_by_name("T_add").compute_at == "inline"           # TVM's "CI 5", our stage 5 too
    back = to_tvm(state)
    # every step comes back as TVM wrote it, except a split's extent in a stage computed inside another,
    # which TVM bounds to the region and we write as 0 ("unknown")
    assert [s for s in back if s[0] != "SP"] == [s for s in CONV_LAYER_STEPS if s[0] != "SP"]
    assert [s[3] for s in back if s[0] == "SP"] == [1, 16, 7, 7, 8, 3, 3, 0, 0]
    check_simulated(state)                      # the CUDA kernels, run by the lockstep simulator


def test_topis_copy_stage_at_padding_0_is_inlined_away_and_written_back():
    # topi's conv2d keeps pad_temp (a plain copy) at padding 0; ours reads the data directly, so TVM's
    # stages are data 0, pad_temp 1, kernel 2, conv 3, bias 4, T_add 5, relu 6 and ours lack pad_temp
    key = json.dumps(["conv2d_layer", 1, 6, 6, 16, 8, 1, 1, [1, 1], [0, 0]])
    resolved = from_tvm_key(key)
    assert "pad_temp" not in [t.name for t in resolved.dag.tensors]
    assert [t.name for t in resolved.tvm_dag.tensors][:2] == ["data", "pad_temp"]
    tvm_steps = [["CI", 1], ["CI", 5], ["SP", 3, 1, 16, [4], 1], ["FSP", 6, 1, 2, 1], ["CA", 3, 6, 2],
                 ["AN", 6, 1, 3]]
    state = from_tvm(resolved.dag, tvm_steps, resolved.tvm_dag)
    assert [s.to_json()[0] for s in state.steps] == ["CI", "SP", "FSP", "CA", "AN"]
    assert state.steps[2].to_json()[3] == 1                 # TVM's step 2 is our step 1
    assert to_tvm(state, resolved.tvm_dag) == tvm_steps
    check_state(state)
    with pytest.raises(UnconvertibleSteps, match="keeps its copy stage.*pad_temp"):
        from_tvm(resolved.dag, tvm_steps[1:3], resolved.tvm_dag)
    with pytest.raises(UnconvertibleSteps, match="pad_temp, a copy stage"):
        from_tvm(resolved.dag, [["CR", 1]], resolved.tvm_dag)


def test_steps_we_cannot_take_are_refused_with_the_step_named():
    dag = make_dag("matmul", 8, 8, 8)
    with pytest.raises(UnconvertibleSteps, match=r"step 1 .*cannot fuse spatial and reduce"):
        from_tvm(dag, [["SP", 2, 0, 8, [2], 1], ["FU", 2, [2, 3]]])
    with pytest.raises(UnconvertibleSteps, match="unknown step code 'XX'"):
        from_tvm(dag, [["XX", 2]])
    with pytest.raises(UnconvertibleSteps, match="stage 7 does not exist"):
        from_tvm(dag, [["CI", 7]])
    with pytest.raises(UnconvertibleSteps, match="takes only the pragmas"):      # and back: TVM would abort
        to_tvm(State(dag).pragma(2, 0, "unroll_explicit$1"))


# ------------------------------------------------------------------------------ the store, both ways

SMALL = SearchParams(population=32, sample_init_population=32, num_iters=1, num_measures_per_round=8)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A store written by real (short) tuning runs of a matmul and a conv2d_relu with bias."""
    root = tmp_path_factory.mktemp("tvm") / "records"
    store = RecordStore(str(root))
    measurer = ProgramMeasurer(LocalBuilder(), LocalRunner(config=TimingConfig(min_repeat_ms=5, repeat=2)))
    try:
        for dag in (make_dag("matmul", 24, 20, 16), make_dag("conv2d_relu", 1, 8, 8, 4, 8, 3, 3, 1, 1, True)):
            tune_task(make_task(dag), 8, measurer=measurer, params=SMALL, records=store, seed=0)
    finally:
        measurer.close()
    return root


def _programs(store: RecordStore) -> set:
    frame = store.read()
    return {(r.workload_key, r.target, r.task_name, r.task_label, r.steps, tuple(r.latencies), r.error_code)
            for r in frame.itertuples()}


def test_export_then_import_gives_the_same_programs_and_latencies(tuned, tmp_path):
    log = tmp_path / "log.json"
    exported = export_log(RecordStore(str(tuned)), str(log))
    assert exported.done == 16 and not exported.skipped
    keys = {json.loads(json.loads(line)["i"][0][0])[0] for line in log.read_text().splitlines()}
    assert keys == {"matmul", "conv2d_layer"}
    target = parse_target("llvm")
    assert all(json.loads(line)["i"][0][1] == f"llvm -keys=cpu -mcpu={target.cpu} -num-cores={target.num_threads}"
               for line in log.read_text().splitlines())
    back = RecordStore(str(tmp_path / "back"))
    imported = import_log(str(log), back)
    assert imported.done == 16 and imported.already == 0 and not imported.skipped
    assert _programs(back) == _programs(RecordStore(str(tuned)))
    again = import_log(str(log), back)                  # the same log twice adds nothing
    assert again.done == 0 and again.already == 16
    # the imported best builds and computes the reference
    task = make_task(make_dag("conv2d_relu", 1, 8, 8, 4, 8, 3, 3, 1, 1, True))
    kernel = apply_best(task, back)
    inputs = task.dag.random_inputs(3)
    out = np.empty(task.dag.outputs[0].shape, np.float32)
    kernel(*inputs, out)
    assert mismatch(out, evaluate(task.dag, inputs)[0]) is None


def test_import_counts_what_it_skips_and_keeps_the_rest(tmp_path):
    known = parse_line(MATMUL_ADD_LINE)
    lines = [MATMUL_ADD_LINE,
             MATMUL_ADD_LINE.replace('\\"matmul_add\\"', '\\"softmax_nm_auto_scheduler_test\\"'),
             MATMUL_ADD_LINE.replace(json.dumps(json.dumps(["matmul_add", 256, 256, 256, "float32"])),
                                     json.dumps(json.dumps(["d41d8cd98f00b204e9800998ecf8427e", [256, 256]]))),
             MATMUL_ADD_LINE.replace('["FU", 4, [0, 1]]', '["FU", 2, [6, 7]]'),     # fuses j.2 with k.1
             json.dumps({"i": [[known.task.workload_key, known.task.target], [[], MATMUL_ADD_STEPS[:3]]],
                         "r": [[1e10], 4, 0.2, 1607112215], "v": "v0.6"})]          # a failed measurement
    log = tmp_path / "mixed.json"
    log.write_text("\n".join(lines) + "\n")
    store = RecordStore(str(tmp_path / "records"))
    summary = import_log(str(log), store)
    assert summary.done == 2 and sum(summary.skipped.values()) == 3
    reasons = " | ".join(summary.skipped)
    assert "softmax_nm_auto_scheduler_test" in reasons and "hash" in reasons and "step 8" in reasons
    frame = store.read()
    assert sorted(frame["error_code"]) == [0, 4]
    ok = frame[frame["error_code"] == 0].iloc[0]
    assert math.isclose(ok["mean_latency"], (0.0044742 + 0.0044801) / 2)
    assert ok["task_name"] == "matmul_add" and ok["flow_run_id"] == "tvm-import:mixed.json"
    assert ok["target"] == str(parse_target("llvm -num-threads=2"))
    assert math.isinf(frame[frame["error_code"] == 4].iloc[0]["mean_latency"])
    cuda = tmp_path / "cuda.json"
    cuda.write_text(CONV_LAYER_LINE + "\n")
    onto_cpu = import_log(str(cuda), store, target="llvm")
    assert onto_cpu.done == 0 and "a cuda program cannot be stored under the llvm target" in " ".join(
        onto_cpu.skipped)


def test_export_counts_the_tasks_tvm_does_not_share(tmp_path):
    store = RecordStore(str(tmp_path / "records"))
    dag = make_dag("softmax", 4, 20)
    store.append([MeasureRecord(workload_key=dag.workload_key, target=str(parse_target("llvm")), steps="[]",
                                task_name="softmax", task_label=f"softmax {dag.shape_signature}",
                                latencies=[1e-6])])
    summary = export_log(store, str(tmp_path / "log.json"))
    assert summary.done == 0 and dict(summary.skipped) == {
        "tasks of softmax: no TVM workload is shared for it": 1}
    assert not (tmp_path / "log.json").exists()


def test_export_writes_only_what_competes_for_a_tasks_best_unless_asked_for_history(tuned, tmp_path):
    """A program timed fast on an earlier night and timed again, slower, when a later run resumed must
    not be TVM's best: ApplyHistoryBest takes the fastest successful line of a log."""
    night = datetime(2026, 11, 1, 22, tzinfo=timezone.utc)
    older = [replace(r, timestamp=night) for r in RecordStore(str(tuned)).load_records(task_name="matmul")]
    fastest = min((r for r in older if r.error_code == 0), key=lambda r: r.mean_latency)
    resumed = night + timedelta(days=1)
    retimed = replace(fastest, record_id="", timestamp=resumed, retiming=True, mean_latency=math.nan,
                      latencies=[3 * x for x in fastest.latencies])
    found = replace(fastest, record_id="", timestamp=resumed + timedelta(minutes=5), steps=older[0].steps,
                    mean_latency=math.nan, latencies=[2 * x for x in fastest.latencies])
    store = RecordStore(str(tmp_path / "records"))
    store.append(older)
    store.append([retimed, found])

    def tvm_best(log):           # what ApplyHistoryBest would pick: the lowest mean cost of a line that ran
        lines = [r for _, r in read_log(log.read_text()) if r.ok]
        return len(lines), min(sum(r.costs) / len(r.costs) for r in lines)

    log = tmp_path / "live.json"
    summary = export_log(store, str(log))
    assert summary.done == 2 and list(summary.skipped.values()) == [len(older)]
    assert "older than its newest re-timing" in next(iter(summary.skipped))
    assert tvm_best(log) == (2, pytest.approx(found.mean_latency))
    assert found.mean_latency == pytest.approx(store.best_per_task().iloc[0]["mean_latency"])
    everything = tmp_path / "history.json"
    summary = export_log(store, str(everything), history=True)
    assert summary.done == len(older) + 2 and not summary.skipped
    assert tvm_best(everything)[1] == pytest.approx(fastest.mean_latency)     # the stale figure wins again
    out = runner.invoke(app, ["export-tvm", "--records", str(tmp_path / "records"), "--out", str(log)])
    assert out.exit_code == 0 and "wrote 2 record(s)" in out.output and f"skipped {len(older)}" in out.output
    out = runner.invoke(app, ["export-tvm", "--records", str(tmp_path / "records"), "--out", str(log), "--history"])
    assert out.exit_code == 0 and f"wrote {len(older) + 2} record(s)" in out.output, out.output


# ------------------------------------------------------------------------------ the commands


def test_commands_round_trip_and_report(tuned, tmp_path):
    log = tmp_path / "out.json"
    out = runner.invoke(app, ["export-tvm", "--records", str(tuned), "--out", str(log), "--workload", "matmul"])
    assert out.exit_code == 0, out.output
    assert "wrote 8 record(s) of 1 task(s)" in out.output and len(log.read_text().splitlines()) == 8
    back = tmp_path / "back"
    out = runner.invoke(app, ["import-tvm", str(log), "--records", str(back)])
    assert out.exit_code == 0, out.output
    assert "imported 8 record(s) of 1 task(s)" in out.output and "matmul 24x16, 16x20 -> 24x20" in out.output


@pytest.mark.parametrize("argv, code, message", [
    (["import-tvm", "missing.json"], 2, "no TVM log at missing.json"),
    (["import-tvm", "{tmp}"], 2, "is not a file"),
    (["import-tvm", "{bad}"], 2, "line 2: not JSON"),
    (["import-tvm", "{empty}"], 2, "holds no records"),
    (["import-tvm", "{short}"], 2, "line 1: the task must be [workload_key, target, ...] (two strings first)"),
    (["import-tvm", "{good}", "--target", "tpu"], 2, "unknown target 'tpu'"),
    (["import-tvm", "{cuda}", "--records", "{store}", "--target", "llvm"], 1,
     "has a tensortune counterpart; nothing imported"),
    (["export-tvm", "--records", "{tmp}/nothing", "--out", "{tmp}/x.json"], 2, "no record store at"),
    (["export-tvm", "--records", "{store}", "--out", "{tmp}"], 2, "is a folder"),
    (["export-tvm", "--records", "{store}", "--out", "{tmp}/x.json", "--workload", "softmax"], 2,
     "not shared with TVM; shared: conv2d, conv2d_relu, matmul, matmul_add"),
    (["export-tvm", "--records", "{store}", "--out", "{tmp}/x.json"], 1, "has a TVM counterpart"),
])
def test_bad_input_gets_one_clear_line(tmp_path, argv, code, message):
    (tmp_path / "bad.json").write_text(MATMUL_ADD_LINE + "\n{not json\n")
    (tmp_path / "empty.json").write_text("# nothing here\n\n")
    (tmp_path / "good.json").write_text(MATMUL_ADD_LINE + "\n")
    (tmp_path / "cuda.json").write_text(CONV_LAYER_LINE + "\n")
    (tmp_path / "short.json").write_text('{"i": [["k"], [[], []]], "r": [[1.0], 0, 1.0, 1]}\n')
    (tmp_path / "store").mkdir()
    paths = {name: str(tmp_path / file) for name, file in [
        ("tmp", ""), ("store", "store"), ("cuda", "cuda.json"), ("bad", "bad.json"), ("empty", "empty.json"),
        ("good", "good.json"), ("short", "short.json")]}
    out = runner.invoke(app, [a.format(**paths) for a in argv], env={"COLUMNS": "300"})
    assert out.exit_code == code, out.output
    assert "error:" in out.output and message in out.output, out.output
    assert "Traceback" not in out.output
    assert not (tmp_path / "x.json").exists()
