"""The benchmarks' timing discipline (issue 23): one timing protocol, paired comparisons that alternate,
failed pairs counted and never in a median, and no speedup for a wrong answer.

The first test reads bench/*.py and fails if a benchmark reads a clock or times anything outside
bench/common.py's timing code; the rest drive the pairing function with deterministic fake sides.
No test here times anything or depends on this machine's speed.
"""
from __future__ import annotations

import ast
import math
import pathlib

import numpy as np
import pytest

from bench import common
from bench.common import Comparison, compare, fmt_ratio, measure

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"

# a call of one of these reads a clock or times something: time.perf_counter(), time.time(),
# CompiledNetwork.benchmark(), torch.cuda.Event(...).elapsed_time(...), timeit ...
TIMING_CALLS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time", "process_time_ns",
                "thread_time", "thread_time_ns", "time", "time_ns", "default_timer", "elapsed_time", "time_till",
                "Event", "benchmark", "profile", "timeit", "autorange"}
TIMING_MODULES = {"timeit"}

# (file, outermost function or class) -> why it may read a clock
ALLOWED = {
    ("common.py", "_perf_clock"): "the host clock of bench.common.measure (the one protocol)",
    ("common.py", "cuda_clock"): "the CUDA-event clock of bench.common.measure on the GPU",
    ("common.py", "Stopwatch"): "wall time of one event (a tuning run, a query), never a compared speed",
    ("network.py", "layer_breakdown"): "per-task time inside the tuned network and inside ORT's (its own "
                                       "profile), in alternating blocks: where the time goes, set beside the "
                                       "tuner's estimate and ORT's kernels; never a compared speed of networks",
    ("tune_cuda.py", "verify_job"): "the tuned CUDA kernel timed in its worker process by CUDAKernel.time, "
                                     "the same protocol (median of batches of >= 200 ms, CUDA events)",
}


def _violations(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node: ast.AST, owner: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and owner is None:
            owner = node.name
        allowed = (path.name, owner) in ALLOWED
        where = f"{path.name}:{getattr(node, 'lineno', '?')} (in {owner or 'module level'})"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in TIMING_MODULES:
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in TIMING_MODULES:
                found.append(f"{where}: from {node.module} import ...")
            if node.module == "time":
                found.extend(f"{where}: from time import {a.name}" for a in node.names if a.name in TIMING_CALLS)
        elif isinstance(node, ast.Call) and not allowed:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
            if name in TIMING_CALLS:
                found.append(f"{where}: {ast.unparse(fn)}(...)")
        for child in ast.iter_child_nodes(node):
            visit(child, owner)

    visit(tree, None)
    return found


def test_benchmarks_time_only_through_the_common_protocol():
    files = sorted(BENCH.glob("*.py"))
    assert any(f.name == "network.py" for f in files)
    bad = [v for f in files for v in _violations(f)]
    assert not bad, ("benchmarks must time through bench.common (measure / compare / Stopwatch):\n  "
                     + "\n  ".join(bad))


def test_the_checker_catches_a_stray_clock(tmp_path):
    stray = tmp_path / "network.py"
    stray.write_text("import time\nfrom time import perf_counter\n\ndef f(net):\n"
                     "    t0 = time.perf_counter()\n    net.benchmark(repeat=5)\n    return time.time() - t0\n")
    found = _violations(stray)
    assert len(found) == 4, found          # the import, perf_counter(), benchmark(), time()


def test_every_allowance_names_existing_code():
    for file, owner in ALLOWED:
        tree = ast.parse((BENCH / file).read_text())
        names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert owner in names, (file, owner)


# ---------------------------------------------------------------------------------- fake sides

class Fake:
    """A side that returns the given milliseconds in turn (an exception instance is raised) and logs its
    calls in a shared list."""

    def __init__(self, name: str, values: list, log: list):
        self.name, self.values, self.log, self.i = name, list(values), log, 0

    def __call__(self) -> float:
        self.log.append(self.name)
        v = self.values[self.i]
        self.i += 1
        if isinstance(v, BaseException):
            raise v
        return v


def test_pairs_alternate_which_side_goes_first():
    log: list[str] = []
    cmp = compare({"ours": Fake("ours", [1.0] * 4, log), "lib": Fake("lib", [2.0] * 4, log)}, pairs=4)
    assert log == ["ours", "lib", "lib", "ours", "ours", "lib", "lib", "ours"]
    assert [p.order for p in cmp.pairs] == [("ours", "lib"), ("lib", "ours")] * 2


def test_with_more_sides_every_two_sides_swap_order_each_pair():
    log: list[str] = []
    names = ["tuned", "default", "torch", "ort"]
    cmp = compare({n: Fake(n, [1.0] * 6, log) for n in names}, pairs=6)
    assert log[:8] == names + names[::-1]
    for a in names:
        for b in names:
            if a < b:
                first = [p.order.index(a) < p.order.index(b) for p in cmp.pairs]
                assert first.count(True) == first.count(False) == 3


def test_ratio_of_medians_and_median_of_ratios():
    log: list[str] = []
    ours = [5.0, 5.0, 10.0]          # medians: ours 5, lib 20
    lib = [10.0, 20.0, 30.0]         # per-pair lib/ours: 2, 4, 3
    cmp = compare({"ours": Fake("ours", ours, log), "lib": Fake("lib", lib, log)}, pairs=3)
    assert cmp.median_ms("ours") == 5.0 and cmp.median_ms("lib") == 20.0
    r = cmp.ratio("lib", "ours")
    assert r.median_of_ratios == pytest.approx(3.0)
    assert r.ratio_of_medians == pytest.approx(4.0)
    f = cmp.fields("ours", ["lib"])
    assert f["ours_ms"] == 5.0 and f["lib_ms"] == 20.0
    assert f["ours_vs_lib"] == pytest.approx(4.0) and f["ours_vs_lib_pairwise"] == pytest.approx(3.0)
    assert f["ours_vs_lib"] == pytest.approx(f["lib_ms"] / f["ours_ms"])     # recomputable from the ms
    assert f["pairs"] == 3 and f["failed_pairs"] == 0 and f["pair_errors"] == []


def test_failed_pairs_are_counted_and_left_out_of_every_median():
    log: list[str] = []
    # pair 0: ok; pair 1 (lib first): ours NaN; pair 2: ours raises, lib not timed; pair 3 (lib first):
    # lib returns 0; pair 4: ok
    ours = Fake("ours", [4.0, float("nan"), RuntimeError("wrong answer"), 8.0], log)
    lib = Fake("lib", [8.0, 1000.0, 0.0, 8.0], log)
    cmp = compare({"ours": ours, "lib": lib}, pairs=5)
    assert cmp.failed == 3 and len(cmp.ok) == 2
    assert log == ["ours", "lib", "lib", "ours", "ours", "lib", "ours", "lib"]
    assert any("wrong answer" in e for e in cmp.errors) and any("nan" in e for e in cmp.errors)
    assert cmp.median_ms("ours") == 6.0 and cmp.median_ms("lib") == 8.0      # 1000 and 0 left out
    r = cmp.ratio("lib", "ours")
    assert r.median_of_ratios == pytest.approx(1.5) and r.ratio_of_medians == pytest.approx(8 / 6)
    for v in cmp.fields("ours", ["lib"]).values():
        assert not (isinstance(v, float) and math.isnan(v))
    assert cmp.fields("ours", ["lib"])["failed_pairs"] == 3


def test_all_pairs_failed_gives_no_figure_not_nan():
    cmp = compare({"ours": lambda: float("nan"), "lib": lambda: 1.0}, pairs=2)
    assert cmp.failed == 2
    assert cmp.median_ms("ours") is None and cmp.ratio("lib", "ours") is None
    f = cmp.fields("ours", ["lib"])
    assert f["ours_ms"] is None and f["ours_vs_lib"] is None and f["ours_vs_lib_pairwise"] is None


def test_measure_batches_last_at_least_the_minimum_and_take_the_median():
    calls = []
    # seconds per call: the warm-up, two calibration batches (1 call: 10 ms < 200; 23 calls, 1.1 x enough: 230 ms),
    # then the three timed batches
    per_call = iter([0.010, 0.010, 0.010, 0.012, 0.010, 0.011])
    numbers = []

    def clock(fn, number):
        numbers.append(number)
        for _ in range(number):
            fn()
        return number * next(per_call)

    t = measure(lambda: calls.append(1), min_batch_ms=200, batches=3, clock=clock)
    assert numbers == [1, 1, 23, 23, 23, 23]
    assert t.number == 23 and t.batch_ms == pytest.approx([12.0, 10.0, 11.0])
    assert all(b * t.number >= 200 for b in t.batch_ms)
    assert t.ms == pytest.approx(11.0)            # the median batch
    assert len(calls) == sum(numbers)


def test_protocol_constants_are_shared_by_the_runner_timings():
    src = (BENCH / "tune.py").read_text() + (BENCH / "codegen.py").read_text()
    assert "TimingConfig(repeat=BATCHES, min_repeat_ms=MIN_BATCH_MS)" in src
    assert common.PAIRS % 2 == 0          # each side first in half the pairs


# ---------------------------------------------------------------------------------- wrong answers

def test_a_failed_check_prints_failed_not_a_speedup():
    from bench.network import printed
    row = {"checked": {"tuned": False, "default": True}, "pairs": 6, "failed_pairs": 0,
           "tuned_vs_torch": None, "tuned_vs_torch_pairwise": None, "tuned_vs_ort": None,
           "tuned_vs_ort_pairwise": None, "default_vs_torch": 0.5, "default_vs_torch_pairwise": 0.6,
           "default_vs_ort": 0.4, "default_vs_ort_pairwise": 0.45}
    out = printed(row)
    assert out["tuned_vs_torch"] == out["tuned_vs_ort_pairwise"] == "failed" and out["tuned_check"] == "FAILED"
    assert out["default_vs_torch"] == "0.5x"
    assert fmt_ratio(None) == "-" and fmt_ratio(2.0, failed=True) == "failed"


def test_a_network_that_failed_its_check_keeps_its_times_but_loses_its_ratios():
    from bench.network import printed, withhold_failed
    log: list[str] = []
    cmp = compare({n: Fake(n, [v, v], log) for n, v in (("tuned", 2.0), ("default", 4.0), ("torch", 3.0),
                                                          ("ort", 1.0))}, pairs=2)
    row = {"checked": {"tuned": False, "default": True}, **cmp.fields(["tuned", "default"], ["torch", "ort"])}
    assert row["tuned_vs_torch"] == pytest.approx(1.5)           # computed before the check is applied
    withhold_failed(row)
    assert row["tuned_ms"] == 2.0                                 # the time stays, the speedup goes
    assert all(row[f"tuned_vs_{r}{s}"] is None for r in ("torch", "ort") for s in ("", "_pairwise"))
    assert row["default_vs_torch"] == pytest.approx(0.75) and row["default_vs_ort_pairwise"] == pytest.approx(0.25)
    assert printed(row)["tuned_vs_ort"] == "failed" and printed(row)["default_vs_torch"] == "0.75x"


def test_cuda_row_ratios_come_from_the_pairs_and_a_failed_check_has_none():
    from bench.tune_cuda import timed_fields
    log: list[str] = []
    sides = {"tuned": Fake("tuned", [1.0, 2.0], log), "torch": Fake("torch", [2.0, 3.0], log),
             "torch_eager": Fake("torch_eager", [4.0, 4.0], log)}
    f = timed_fields(3e9, True, compare(sides, pairs=2))
    assert log == ["tuned", "torch", "torch_eager", "torch_eager", "torch", "tuned"]
    assert f["tuned_ms"] == 1.5 and f["torch_ms"] == 2.5 and f["torch_eager_ms"] == 4.0
    assert f["tuned/torch"] == pytest.approx(2.5 / 1.5)           # ratio of the medians
    assert f["tuned/torch_pairwise"] == pytest.approx(1.75)       # median of 2.0 and 1.5
    assert f["tuned_tflops"] == pytest.approx(2.0) and f["pairs_ok"] == "2/2"
    # a kernel that failed its check is not a side: PyTorch is still timed, the row has no speedup
    log.clear()
    wrong = timed_fields(3e9, False, compare({"torch": Fake("torch", [2.0, 2.0], log),
                                              "torch_eager": Fake("torch_eager", [3.0, 3.0], log)}, pairs=2))
    assert "tuned" not in log and wrong["torch_ms"] == 2.0
    assert wrong["tuned_ms"] is None and wrong["tuned/torch"] is None and wrong["tuned_tflops"] is None


def test_resnet50_total_leaves_out_rows_that_failed_verification():
    from bench.tune_cuda import resnet50_total
    rows = [{"task": "matmul 4096^3", "verified": True},
            {"task": "r50.0", "layers": 2, "trials": 10, "tuned_ms": 1.0, "torch_ms": 2.0, "torch_eager_ms": 3.0,
             "verified": True},
            {"task": "r50.1", "layers": 1, "trials": 10, "tuned_ms": None, "torch_ms": 5.0, "torch_eager_ms": 6.0,
             "verified": False},
            {"task": "r50.2", "layers": 3, "trials": 10, "tuned_ms": 0.5, "torch_ms": 0.5, "torch_eager_ms": 1.0,
             "verified": True}]
    tot = resnet50_total(rows)
    assert tot["layers"] == 5 and tot["tuned_ms"] == pytest.approx(3.5) and tot["torch_ms"] == pytest.approx(5.5)
    assert tot["tuned/torch"] == pytest.approx(5.5 / 3.5)
    assert tot["excluded_failed"] == ["r50.1"] and "2 of 3 verified" in tot["task"]
    assert resnet50_total([rows[0], rows[2]]) is None
    untimed = {"task": "r50.3", "layers": 4, "trials": 10, "tuned_ms": None, "torch_ms": None,
               "torch_eager_ms": None, "verified": True}
    tot = resnet50_total(rows + [untimed])
    assert tot["layers"] == 5 and tot["excluded_failed"] == ["r50.1", "r50.3"]


def test_resnet50_total_counts_each_layer_once_at_its_fastest_form():
    """A layer tuned direct and in Winograd form counts once, at the faster verified one; a failed
    form does not hide the layer's other form."""
    from bench.tune_cuda import resnet50_total
    row = {"layers": 3, "trials": 64, "torch_ms": 2.0, "torch_eager_ms": 3.0, "verified": True}
    rows = [{**row, "task": "r50.10 128x28x28->128 k3 s1", "tuned_ms": 1.5},
            {**row, "task": "r50.10 128x28x28->128 k3 s1 winograd F4", "tuned_ms": 1.0},
            {**row, "task": "r50.16 256x14x14->256 k3 s1", "tuned_ms": 0.8, "layers": 5},
            {**row, "task": "r50.16 256x14x14->256 k3 s1 winograd F2", "tuned_ms": None, "verified": False}]
    tot = resnet50_total(rows)
    assert tot["layers"] == 8 and tot["trials"] == 4 * 64
    assert tot["tuned_ms"] == pytest.approx(3 * 1.0 + 5 * 0.8) and tot["torch_ms"] == pytest.approx(8 * 2.0)
    assert tot["forms"] == [rows[1]["task"], rows[2]["task"]] and tot["excluded_failed"] == []


def test_cuda_bench_winograd_items_are_the_3x3_stride1_layers_only():
    from bench.tune_cuda import workloads
    items = workloads("r50w4:9-12,r50:10")
    assert [i["label"] for i in items] == ["r50.10 128x28x28->128 k3 s1 winograd F4", "r50.10 128x28x28->128 k3 s1"]
    wino, direct = items
    assert wino["workload"] == "conv2d_winograd" and wino["args"] == (1, 28, 28, 128, 128, 1, 4)
    assert wino["conv"] == direct["conv"] == direct["args"] == (1, 28, 28, 128, 128, 3, 3, 1, 1)
    for bad in ("r50w4:6", "r50:99", "r50w3:10", "resnet"):
        with pytest.raises(SystemExit):
            workloads(bad)


@pytest.mark.parametrize("m", [2, 4])
def test_cuda_bench_checks_a_winograd_kernel_against_the_direct_conv(m):
    """The inputs the GPU check gives a Winograd kernel (U transformed from a weight) make the Winograd
    DAG compute exactly what PyTorch's direct conv of that weight computes, so a kernel that matches
    the check computes the conv; an untransformed U would not."""
    from bench.tune_cuda import checked_inputs
    from tensortune.tasks.reference import evaluate, mismatch
    from tensortune.tasks.workload_registry import make_dag
    dag = make_dag("conv2d_winograd", 1, 8, 8, 4, 6, 1, m)
    inputs, reference = checked_inputs(dag, (1, 1, m))
    (out,) = evaluate(dag, inputs)
    assert mismatch(out, reference().astype(np.float64)) is None
    raw = dag.random_inputs(seed=99)
    (wrong,) = evaluate(dag, raw)
    assert mismatch(wrong, reference().astype(np.float64)) is not None


# ---------------------------------------------------------------------------------- the ablation

def test_ablation_random_model_evolves_as_many_generations_as_xgb():
    """Random exactly while an XGBModel given the same programs is (default warm-up and TVM's 100)."""
    from bench.tune import SameGenerationsRandomModel
    from tensortune.codegen.target import make_task
    from tensortune.search.cost_model import XGBModel
    from tensortune.search.sketch_policy import SketchPolicy
    from tensortune.tasks.workload_registry import make_dag
    task = make_task(make_dag("matmul", 32, 32, 32))
    cands = SketchPolicy(task, seed=0).sample(110)
    costs = [1e-6 * (1 + i % 7) for i in range(len(cands))]
    for warmup in (XGBModel().num_warmup_sample, 100):
        model, xgb = SameGenerationsRandomModel(0, warmup), XGBModel(num_warmup_sample=warmup, max_rounds=5)
        assert model.is_random and xgb.is_random    # before any program: 2 generations for both
        done = 0
        for n in (4, 3, 1, 91, 1, 10):
            model.update(task, cands[done:done + n], costs[done:done + n])
            xgb.update(task, cands[done:done + n], costs[done:done + n])
            done += n
            assert model.is_random == xgb.is_random, (warmup, done)


def test_comparison_is_a_plain_record():
    cmp = Comparison(("a", "b"))
    assert cmp.failed == 0 and cmp.median_ms("a") is None


def test_builtin_agreement_names_the_tasks_that_differ():
    from types import SimpleNamespace as T

    from bench.network import builtin_agreement
    conv, dense = T(workload_key="k-conv", weight=2, name="conv"), T(workload_key="k-dense", weight=1, name="dense")
    assert builtin_agreement([conv, dense], [dense, conv])["same"]
    got = builtin_agreement([conv, T(workload_key="k-div", weight=1, name="matmul_div")],
                            [T(workload_key="k-conv", weight=3, name="conv"), T(workload_key="k-mul", weight=1,
                                                                                name="matmul_mul")])
    assert not got["same"] and got["imported_only"] == ["matmul_div"] and got["builtin_only"] == ["matmul_mul"]
    assert got["weights_differ"] == ["conv"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet-18", "resnet-50", "mobilenet-v2"])
def test_the_network_benchmarks_pytorch_models_import_to_the_builtin_networks_tasks(name, tmp_path):
    """bench network times the PyTorch model's ONNX export as imported; its records carry over to the
    built-in network a user tunes (`tensortune tune NAME`) only if both have the same tasks and weights
    (the BERT layer differs and says so in its row). Slow: exporting ResNet-50 takes ten seconds."""
    from bench.common import limit_threads, llvm_target
    from bench.network import NETWORK_OPTIONS, builtin_agreement, export_onnx, torch_model
    from tensortune.flows.tuning import network_tasks
    from tensortune.tasks.onnx_import import import_onnx
    with limit_threads(2) as torch:
        model, example = torch_model(name, torch, NETWORK_OPTIONS[name])
        graph = import_onnx(export_onnx(model, example, str(tmp_path / f"{name}.onnx"), torch), name=name)
    target = llvm_target(2)
    agreement = builtin_agreement(network_tasks(graph, target, (2, 4))[1],
                                  network_tasks(name, target, (2, 4), **NETWORK_OPTIONS[name])[1])
    assert agreement["same"], agreement


def test_retime_without_the_records_of_a_run_is_one_line_before_anything_starts(tmp_path, monkeypatch, capsys):
    from bench.network import main
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "resnet-18" / "gradient").mkdir(parents=True)       # one network's records, not the other's
    with pytest.raises(SystemExit) as exit_:
        main(["resnet-18", "bert-base", "--retime", "--records", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"--retime needs the records of an earlier run: no {tmp_path}/<network>/gradient for "
                        f"bert-base, and {tmp_path} is no record store")
    with pytest.raises(SystemExit):
        main(["resnet-18", "--retime"])
    assert "no --records DIR/<network>/gradient for resnet-18" in capsys.readouterr().err


def test_space_and_tune_benches_refuse_bad_params_in_one_line(capsys):
    from bench.space import main
    assert main(["--workloads", "matmul,resnet"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --workloads resnet: not one of matmul, matmul_bias_relu, "
                                               "conv2d_relu, conv2d_nhwc_relu, depthwise_conv2d, softmax")
    assert main(["--params", "max_vectorize_size=64", "vector_width=8"]) == 2
    assert (capsys.readouterr().err.strip()
            == "error: --params 'vector_width=8': SearchParams has no field 'vector_width'")
    assert main(["--programs", "0"]) == 2
    from bench.tune import main as tune_main
    assert tune_main(["--param", "max_vectorize_size=wide"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "error: --param 'max_vectorize_size=wide': max_vectorize_size must be of type int")
    assert tune_main(["--confirm", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --confirm -1: give 0 or more timings"


def test_space_bench_summary_ranks_the_programs_it_timed():
    from bench.space import parse_setting, summary
    got = summary([float(g) for g in [0, 50, 10, 40, 20, 30, 60, 70, 80, 90, 100, 5]], peak=200.0)
    assert got["programs"] == 12 and got["failed"] == 1
    assert got["best_gflops"] == 100 and got["top10_mean_gflops"] == sum(range(10, 101, 10)) / 10
    assert got["p90_gflops"] == 90 and got["median_gflops"] == 40 and got["best_peak_frac"] == 0.5
    assert parse_setting("max_vectorize_size=16,crossover_prob=0.5") == {"max_vectorize_size": 16,
                                                                         "crossover_prob": 0.5}
    assert parse_setting("") == {}
    assert parse_setting("disable_cpu_packing=false,disable_change_compute_location=1") == {
        "disable_cpu_packing": False, "disable_change_compute_location": True}
