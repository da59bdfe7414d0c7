"""Layout rewrite (Ansor's layout_rewrite): a constant weight stored in the order its tiled stage's loops
read it. Every rewritten kernel is checked against the NumPy reference on random inputs, with the
reference weights transformed as the network stores them: every conv shape of ResNet-18 and ResNet-50
and dense, under programs the search samples; measurement, the JIT network and the AOT library."""
from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import pytest

from tensortune import runtime
from tensortune.codegen.aot import compile_network
from tensortune.codegen.llvm_backend import LLVMKernel, build
from tensortune.codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
from tensortune.codegen.network_runtime import NETWORK_TOLERANCE, build_network, relative_errors
from tensortune.codegen.target import make_task
from tensortune.codegen.timing import ErrorCode, TimingConfig
from tensortune.flows.tuning import network_tasks
from tensortune.schedule.layout_rewrite import WeightLayout, weight_layout, weight_layouts
from tensortune.schedule.state import State
from tensortune.search.sketch_policy import SearchParams, SketchPolicy
from tensortune.tasks.extract import extract_tasks
from tensortune.tasks.graph import GraphBuilder
from tensortune.tasks.models import make_network
from tensortune.tasks.reference import evaluate, mismatch
from tensortune.tasks.search_task import SearchTask
from tensortune.tasks.workload_registry import make_dag
from tests.schedules import tiled_schedule

TARGET = "llvm -num-threads=2"


def _run_rewritten(state: State, names: tuple[str, ...], seed: int) -> LLVMKernel:
    """Build with `names` rewritten, run on random inputs (weights transformed) and compare."""
    dag = state.dag
    artifact = build(state, TARGET, rewrite=names)
    kernel = LLVMKernel(artifact)
    inputs = dag.random_inputs(seed)
    args = artifact.layout_inputs([t.name for t in dag.inputs], inputs)
    for lay in artifact.layouts:
        spec = next(a for a in artifact.args if a[0] == lay.name)
        assert spec[1] == lay.new_shape
    outs = [np.full(t.shape, np.nan, dtype=t.dtype) for t in dag.outputs]
    kernel(*args, *outs)
    for t, out, ref in zip(dag.outputs, outs, evaluate(dag, inputs)):
        bad = mismatch(out, ref)
        assert bad is None, f"{t.name}: {bad}\nsteps: {state.steps_json()}"
    return kernel


def _sampled(task: SearchTask, n: int, seed: int) -> list[State]:
    pol = SketchPolicy(task, params=SearchParams(), seed=seed)
    return [c.state for c in pol.sample(n)]


def _check_network_convs(network: str, image_size: int, per_shape: int) -> None:
    net = extract_tasks(make_network(network, image_size=image_size))
    convs = [t for t in net.tasks if t.name.startswith("conv2d")]
    assert len(convs) >= 10
    for i, t in enumerate(convs):
        assert t.layout_free == ("kernel",), t.layout_free
        states = _sampled(make_task(t.dag, TARGET, t.name, layout_rewrite=t.layout_free), per_shape, seed=i)
        assert states
        for j, state in enumerate(states):
            lay = weight_layout(state, "kernel")
            # every multi-level-tiled conv the search samples is rewritten
            assert lay is not None, f"{t.name} {t.dag.shape_signature}: no layout for {state.steps_json()}"
            _run_rewritten(state, t.layout_free, seed=j)


# ResNet-50's convs are ResNet-18's kinds (1x1, 3x3, strided, the 7x7 stem) in more shapes: -m slow.
@pytest.mark.parametrize("network", ["resnet-18", pytest.param("resnet-50", marks=pytest.mark.slow)])
def test_every_conv_of_resnet_rewritten_matches_numpy(network):
    """Each conv shape of the network (channels, kernel, stride, padding as in the model; image 32 keeps
    the spatial extents small), under three programs the search samples."""
    _check_network_convs(network, image_size=32, per_shape=3)


@pytest.mark.slow
@pytest.mark.parametrize("network", ["resnet-18", "resnet-50"])
def test_every_conv_of_resnet_at_224_rewritten_matches_numpy(network):
    _check_network_convs(network, image_size=224, per_shape=2)


@pytest.mark.parametrize("args", [(1, 512, 1000), (2, 24, 20), (4, 768, 3072)], ids=["resnet-fc", "odd", "bert-ffn"])
def test_dense_rewritten_matches_numpy(args):
    dag = make_dag("dense", *args)
    weight = dag.inputs[1].name
    states = _sampled(make_task(dag, TARGET, layout_rewrite=(weight,)), 4, seed=sum(args))
    assert states
    for j, state in enumerate(states):
        lay = weight_layout(state, weight)
        assert lay is not None and lay.shape == dag.inputs[1].shape
        _run_rewritten(state, (weight,), seed=j)


def test_layout_maps_every_index_to_its_value():
    """transform() stores w[orig] at index(orig) for every original index (a bijection onto the data)."""
    dag = make_dag("conv2d", 1, 10, 10, 12, 20, 3, 3, 1, 1)
    state = tiled_schedule(dag, tile=4, vec=8)
    lay = weight_layout(state, "kernel")
    assert lay is not None and len(lay.dims) > 4
    w = np.random.default_rng(0).standard_normal(lay.shape).astype("float32")
    stored = lay.transform(w)
    assert stored.shape == lay.new_shape and stored.flags.c_contiguous
    grids = np.meshgrid(*[np.arange(s) for s in lay.shape], indexing="ij")
    new = []
    for d in lay.dims:
        v = grids[d.axis] // d.stride
        new.append(v if d.outer else v % d.extent)
    np.testing.assert_array_equal(stored[tuple(new)], w)
    assert np.count_nonzero(stored) == w.size           # padding (none here) holds zeros
    assert WeightLayout.from_json(json.loads(json.dumps(lay.to_json()))) == lay


def test_layout_is_determined_by_the_record():
    dag = make_dag("conv2d", 1, 14, 14, 32, 64, 3, 3, 1, 1)
    for state in _sampled(make_task(dag, TARGET, layout_rewrite=("kernel",)), 3, seed=5):
        again = State.from_json(dag, state.steps_json())
        assert weight_layout(again, "kernel") == weight_layout(state, "kernel")


def test_rewritten_kernel_reads_the_new_layout():
    """The check can fail: the rewritten kernel given the plain weight's bytes (zero-padded to the new
    shape) instead of the transformed weight computes a wrong result."""
    dag = make_dag("conv2d", 1, 8, 8, 16, 16, 3, 3, 1, 1)
    state = tiled_schedule(dag, tile=4, vec=8)
    artifact = build(state, TARGET, rewrite=("kernel",))
    (lay,) = artifact.layouts
    inputs = dag.random_inputs(0)
    plain = np.zeros(lay.new_shape, "float32")
    plain.reshape(-1)[:inputs[1].size] = inputs[1].reshape(-1)
    kernel, ref = LLVMKernel(artifact), evaluate(dag, inputs)[0]
    out = np.zeros(dag.outputs[0].shape, "float32")
    kernel(inputs[0], plain, out)
    assert mismatch(out, ref) is not None
    kernel(inputs[0], lay.transform(inputs[1]), out)
    assert mismatch(out, ref) is None


def test_standalone_tasks_keep_plain_layouts():
    dag = make_dag("conv2d", 1, 8, 8, 16, 16, 3, 3, 1, 1)
    plain = make_task(dag, TARGET)
    assert plain.layout_rewrite == () and "layout_rewrite" not in plain.to_json()
    opted = make_task(dag, TARGET, layout_rewrite=("kernel",))
    assert SearchTask.from_json(opted.to_json()).layout_rewrite == ("kernel",)
    assert make_task(dag, "cuda -arch=sm_80", layout_rewrite=("kernel",)).layout_rewrite == ()
    assert build(tiled_schedule(dag), TARGET).layouts == ()


def test_measurement_times_and_checks_the_rewritten_kernel():
    """Measuring an opted-in task builds the rewritten kernel and checks it against the reference with the
    reference weight transformed the same way; every sampled program measures without a wrong answer."""
    dag = make_dag("conv2d", 1, 14, 14, 16, 32, 3, 3, 1, 1)
    task = make_task(dag, TARGET, layout_rewrite=("kernel",))
    states = _sampled(task, 4, seed=3)
    cfg = TimingConfig(number=1, repeat=1, min_repeat_ms=0)
    with ProgramMeasurer(LocalBuilder(n_parallel=1), LocalRunner(config=cfg)) as m:
        builds = m.builder.build(task, [s.steps_json() for s in states])
        assert all(b.artifact is not None and len(b.artifact.layouts) == 1 for b in builds)
        results = m.runner.run(task, builds)
    assert [r.error_code for r in results] == [ErrorCode.NO_ERROR] * len(states), [r.error_msg for r in results]


def _sampled_records(net, seed: int) -> dict[str, str]:
    """One program the search samples per task (what a short tuning run would store)."""
    recs = {}
    for i, t in enumerate(net.tasks):
        states = _sampled(make_task(t.dag, TARGET, t.name, layout_rewrite=t.layout_free), 1, seed=seed + i)
        if states:
            recs[t.workload_key] = states[0].steps_json()
    return recs


def test_network_with_rewritten_weights_equals_the_reference():
    """ResNet-18 (image 32) built from sampled programs with every conv and dense weight rewritten."""
    net = extract_tasks(make_network("resnet-18", image_size=32))
    records = _sampled_records(net, seed=11)
    compiled = build_network(net, records, TARGET)
    rewritten = [k for k in compiled.kernels if k.kernel.artifact.layouts]
    assert len(rewritten) == sum(bool(t.layout_free) for t in net.tasks) >= 10
    assert all(k.source == "record" for k in compiled.kernels if k.workload_key in records)
    for kernel, _, args in compiled._calls:       # every array at a 64-byte boundary (codegen.alignment)
        assert [a.ctypes.data % 64 for a in args] == [0] * len(args), kernel.artifact.func_name
    for seed in (0, 1):
        result = compiled.check(seed=seed)
        assert result.passed, str(result)
    plain = build_network(net, records, TARGET, layout_rewrite=False)
    assert not any(k.kernel.artifact.layouts for k in plain.kernels)
    inputs = net.source.random_inputs(2)
    errors = relative_errors(compiled.run(inputs), plain.run(inputs))
    assert all(e <= NETWORK_TOLERANCE for e in errors.values()), errors


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to link with")
def test_aot_library_stores_rewritten_weights(tmp_path):
    graph = make_network("resnet-18", image_size=32, base_width=8, num_classes=10)
    net = extract_tasks(graph)
    records = _sampled_records(net, seed=21)
    compile_network(net, records, str(tmp_path / "out"), TARGET)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    layouts = list(itertools.chain.from_iterable(k["layouts"] for k in manifest["kernels"]))
    # every weight the rule gives a layout for its record's program (an rfactor dense keeps it plain)
    assert len(layouts) == sum(len(weight_layouts(State.from_json(t.dag, records[t.workload_key]), t.layout_free))
                               for t in net.tasks if t.layout_free) >= 10
    m = runtime.load(str(tmp_path / "out"))
    for seed in (0, 1):
        inputs = graph.random_inputs(seed)
        errors = relative_errors(m.run(inputs), graph.run_reference(inputs))
        assert all(e <= NETWORK_TOLERANCE for e in errors.values()), errors


def test_a_rewritten_weight_gets_no_packing_stage():
    """matmul's B[k, j] is packed per reduce tile in one of its sketches; rewritten at build time it is
    stored in the tiled order already, so no sketch copies it at run time."""
    dag = make_dag("matmul", 64, 64, 64)
    b = dag.inputs[1].name
    packed = SketchPolicy(make_task(dag, TARGET), params=SearchParams(), seed=0).sketches
    assert any(st.origin == "cache_read" for sk in packed for st in sk.state.stages)
    task = make_task(dag, TARGET, layout_rewrite=(b,))
    pol = SketchPolicy(task, params=SearchParams(), seed=0)
    assert not any(st.origin == "cache_read" for sk in pol.sketches for st in sk.state.stages)
    for j, c in enumerate(pol.sample(3)):
        assert weight_layout(c.state, b) is not None
        _run_rewritten(c.state, (b,), seed=j)


def test_extraction_names_weights_constant_in_every_occurrence():
    """Two dense ops of one workload: the weight is layout-free only while every occurrence reads a
    constant (here the second reads a graph input), and network tuning tasks opt in with those names."""
    g = GraphBuilder("two_dense")
    x, w_in = g.input("x", (2, 16)), g.input("w", (16, 16))
    rng = np.random.default_rng(0)
    a = g.add("dense", [x, g.constant(rng.standard_normal((16, 16)).astype("float32"))], name="d0")
    both = g.add("dense", [a, w_in], name="d1")
    net = extract_tasks(g.build([both]))
    assert [t.weight for t in net.tasks] == [2] and net.tasks[0].layout_free == ()
    g = GraphBuilder("one_dense")
    x = g.input("x", (2, 16))
    d = g.add("dense", [x, g.constant(rng.standard_normal((16, 16)).astype("float32"))], name="d0")
    net = extract_tasks(g.build([g.add("relu", [d], name="r")]))
    assert net.tasks[0].layout_free == (net.tasks[0].dag.inputs[1].name,)
    _, tasks = network_tasks("resnet-18", TARGET, image_size=32)
    assert all(t.layout_rewrite == ("kernel",) for t in tasks if t.name.startswith("conv2d"))
    assert all(t.layout_rewrite == () for t in tasks if "pool" in t.name)


def test_the_runner_and_the_network_hand_kernels_64_byte_aligned_arrays(monkeypatch):
    """What the tuner times is what the network runs: the runner (run_artifact, called here in this
    process) packs every argument of the timed kernel at a 64-byte boundary, as the network runtime
    stores its inputs, constants, rewritten weights and planned buffers (codegen.alignment)."""
    from tensortune.codegen import llvm_backend
    from tensortune.codegen.alignment import aligned, aligned_empty
    dag = make_dag("conv2d", 1, 14, 14, 16, 32, 3, 3, 1, 1)
    task = make_task(dag, TARGET, layout_rewrite=("kernel",))
    (state,) = _sampled(task, 1, seed=3)
    artifact = llvm_backend.build(state, TARGET, rewrite=("kernel",))
    packed_offsets = []
    pack = llvm_backend.LLVMKernel.pack

    def recording_pack(self, arrays):
        packed_offsets.append([a.ctypes.data % 64 for a in arrays])
        return pack(self, arrays)
    monkeypatch.setattr(llvm_backend.LLVMKernel, "pack", recording_pack)
    costs, code, msg = llvm_backend.run_artifact(task, artifact, TimingConfig(number=1, repeat=1, min_repeat_ms=0))
    assert code == ErrorCode.NO_ERROR and costs, msg
    n_args = len(dag.inputs) + len(dag.outputs)
    timed = [offsets for offsets in packed_offsets if len(offsets) == n_args][-1]   # (the pool waker packs 2)
    assert timed == [0] * n_args
    monkeypatch.undo()

    # (the network runtime's arrays: test_network_with_rewritten_weights_equals_the_reference)
    # the helpers: a copy only where needed, the values kept
    a = np.arange(10, dtype=np.float32)[1:]
    b = aligned(a)
    assert b.ctypes.data % 64 == 0 and np.array_equal(a, b) and aligned(b) is b
    assert aligned_empty((3, 5), "float64").shape == (3, 5) and aligned_empty((), np.int32).shape == ()
