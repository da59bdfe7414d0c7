"""ONNX's own backend test data (shipped in the installed `onnx` package) through the path a user takes:
import -> extract -> build with default schedules (LLVM) -> run -> compare with the expected outputs at
ONNX's tolerances (issue 22).

The `pytorch-converted` and `pytorch-operator` suites (small graphs, random inputs stored with their
expected outputs), the `light` model zoo (nine CNNs at 224x224 with light weights, run on ONNX's
dummy inputs; 1-9 s each) and ONNX's node test cases with float32 inputs and outputs (built by
onnx's own `expect` functions) all run in the default suite. The cases expected to fail are listed with the
error each must give: a clear OnnxImportError, never a crash or a wrong answer.
"""
from __future__ import annotations

import pathlib
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.backend.test.case.node import collect_testcases
from onnx.reference import ReferenceEvaluator

from tensortune.codegen.network_runtime import build_network
from tensortune.codegen.target import make_task
from tensortune.search.sketch_policy import SearchParams, SketchPolicy
from tensortune.tasks.extract import ExtractError, extract_tasks
from tensortune.tasks.onnx_import import OnnxImportError, import_onnx
from tests.conftest import check_state

DATA = pathlib.Path(onnx.__file__).parent / "backend" / "test" / "data"
RTOL, ATOL = 1e-3, 1e-7          # onnx.backend.test's defaults for these suites (TestCase.rtol/atol)

# case -> what its error must say; every other case must import, build and match
EXPECTED_FAIL = {
    "test_MaxPool1d_stride_padding_dilation": "dilations",
    "test_MaxPool2d_stride_padding_dilation": "dilations",
}


@pytest.fixture(scope="module", autouse=True)
def compile_each_kernel_once():
    """Each distinct kernel compiled once for the module: ONNX's cases repeat their graphs (an op's
    `_expanded` twin, the attention cases' common softmax and matmuls), so their 2 000 kernels are a few
    hundred distinct LLVM modules, and compiling each again cost 60 of the node cases' 80 s. Every kernel
    is still LLVM's own object code, run on the case's inputs; only a repeat compilation is skipped."""
    from functools import lru_cache

    from tensortune.codegen import llvm_backend
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llvm_backend, "compile_ir", lru_cache(maxsize=None)(llvm_backend.compile_ir))
        yield


def _cases(suite: str) -> list[str]:
    return sorted(p.name for p in (DATA / suite).iterdir() if (p / "model.onnx").exists())


def _tensor(path: pathlib.Path) -> np.ndarray:
    t = onnx.TensorProto()
    t.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(t)


def _run(model: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    graph = import_onnx(model)
    net = build_network(extract_tasks(graph))
    inits = {i.name for i in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    out = net.run(dict(zip(names, inputs)))
    return [out[o] for o in graph.outputs]


@pytest.mark.parametrize("case", [("pytorch-converted", c) for c in _cases("pytorch-converted")]
                         + [("pytorch-operator", c) for c in _cases("pytorch-operator")], ids=lambda c: c[1])
def test_backend_case(case):
    suite, name = case
    folder = DATA / suite / name
    model = onnx.load(str(folder / "model.onnx"))
    data = folder / "test_data_set_0"
    inputs = [_tensor(p) for p in sorted(data.glob("input_*.pb"))]
    expected = [_tensor(p) for p in sorted(data.glob("output_*.pb"))]
    if name in EXPECTED_FAIL:
        with pytest.raises(OnnxImportError, match=EXPECTED_FAIL[name]):
            _run(model, inputs)
        return
    got = _run(model, inputs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL)


def test_the_expected_failures_exist():
    """The list names real cases (a renamed case would otherwise hide a new failure)."""
    everything = set(_cases("pytorch-converted")) | set(_cases("pytorch-operator"))
    assert set(EXPECTED_FAIL) <= everything


# ----------------------------------------------------------------- ops the suites above do not reach

def _vi(name: str, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """onnx's reference evaluator's outputs; the model's outputs get their shapes from them (a model
    built here names its outputs without shapes, which onnx.checker refuses)."""
    outs = ReferenceEvaluator(model).run(None, feeds)
    names = [o.name for o in model.graph.output]
    del model.graph.output[:]
    model.graph.output.extend(_vi(n, o.shape) for n, o in zip(names, outs))
    return outs


OP_CASES = {
    "HardSigmoid": (dict(alpha=0.3, beta=0.4), [(3, 40)]),
    "HardSwish": ({}, [(3, 40)]),
    "Reciprocal": ({}, [(3, 40)]),
    "Mean": ({}, [(2, 3, 4), (3, 4), (1, 4)]),
    "Sum": ({}, [(2, 3, 4)]),
    "LeakyRelu": (dict(alpha=0.2), [(2, 3, 8)]),
}


@pytest.mark.parametrize("op", list(OP_CASES))
def test_op_against_onnx_reference(op):
    """Each op on random inputs against onnx's own reference evaluator."""
    attrs, shapes = OP_CASES[op]
    rng = np.random.default_rng(sum(map(ord, op)))
    names = [f"x{i}" for i in range(len(shapes))]
    node = helper.make_node(op.split("-")[0], names, ["y"], **attrs)
    model = helper.make_model(helper.make_graph([node], op, [_vi(n, s) for n, s in zip(names, shapes)],
                                                [_vi("y", None)]), opset_imports=[helper.make_opsetid("", 17)])
    feeds = {n: rng.uniform(0.2, 2.0, s).astype(np.float32) * rng.choice([-1, 1], s).astype(np.float32)
             for n, s in zip(names, shapes)}
    if op == "Reciprocal":
        feeds = {n: np.abs(v) + 0.1 for n, v in feeds.items()}
    (expected,) = _reference(model, feeds)
    (got,) = _run(model, [feeds[n] for n in names])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def _lrn_as_the_spec_says(x: np.ndarray, size: int, alpha: float, beta: float, bias: float) -> np.ndarray:
    """ONNX's LRN text, literally: for channel c, the squares over [c - floor((size-1)/2),
    c + ceil((size-1)/2)] clipped to the channels. (onnx.reference's LRN loops over the batch axis
    instead of the channels, onnx 1.23, so it is not the oracle here.)"""
    out = np.empty_like(x)
    channels = x.shape[1]
    for c in range(channels):
        lo, hi = max(0, c - (size - 1) // 2), min(channels - 1, c + -(-(size - 1) // 2))
        square_sum = (x[:, lo:hi + 1].astype(np.float64) ** 2).sum(axis=1)
        out[:, c] = x[:, c] / (bias + alpha / size * square_sum) ** beta
    return out


@pytest.mark.parametrize("size,shape,attrs", [(5, (2, 7, 5, 4), dict(alpha=2e-4, beta=0.75, bias=2.0)),
                                              (4, (1, 6, 3, 3), {}), (3, (2, 5, 6), dict(alpha=0.5, beta=0.5))])
def test_lrn_against_the_spec(size, shape, attrs):
    rng = np.random.default_rng(size)
    node = helper.make_node("LRN", ["x"], ["y"], size=size, **attrs)
    model = helper.make_model(helper.make_graph([node], "lrn", [_vi("x", shape)], [_vi("y", shape)]),
                              opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal(shape).astype(np.float32) * 3
    full = {"alpha": 1e-4, "beta": 0.75, "bias": 1.0, **attrs}
    (got,) = _run(model, [x])
    np.testing.assert_allclose(got, _lrn_as_the_spec_says(x, size, **full), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad_modes_against_onnx_reference(mode):
    rng = np.random.default_rng(3)
    pads = np.array([0, 1, 2, 0, 0, 2, 1, 3], np.int64)           # begins of 4 axes, then ends
    node = helper.make_node("Pad", ["x", "pads", "value"], ["y"], mode=mode)
    model = helper.make_model(helper.make_graph(
        [node], "pad", [_vi("x", (2, 3, 4, 5))], [_vi("y", None)],
        [numpy_helper.from_array(pads, "pads"), numpy_helper.from_array(np.array(1.5, np.float32), "value")]),
        opset_imports=[helper.make_opsetid("", 18)])
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    (expected,) = _reference(model, {"x": x})
    (got,) = _run(model, [x])
    np.testing.assert_array_equal(got, expected)


def test_split_into_uneven_parts_feeds_two_consumers():
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Split", ["x", "sizes"], ["a", "b", "c"], axis=1),
             helper.make_node("Mul", ["a", "c"], ["y"]), helper.make_node("Relu", ["b"], ["z"])]
    model = helper.make_model(helper.make_graph(
        nodes, "split", [_vi("x", (2, 7, 3))], [_vi("y", None), _vi("z", None)],
        [numpy_helper.from_array(np.array([2, 3, 2], np.int64), "sizes")]), opset_imports=[helper.make_opsetid("", 18)])
    x = rng.standard_normal((2, 7, 3)).astype(np.float32)
    expected = _reference(model, {"x": x})
    got = _run(model, [x])
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-6)


# ----------------------------------------------------------------- the light model zoo

LIGHT = sorted(p.name[len("light_"):-len(".onnx")] for p in (DATA / "light").glob("light_*.onnx"))


def _dummy(vi: onnx.ValueInfoProto) -> np.ndarray:
    """onnx.backend.test's input for the light models: arange(n) / n in the input's shape."""
    shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim)
    n = int(np.prod(shape))
    return (np.arange(n).reshape(shape) / n).astype(np.float32)


@pytest.mark.parametrize("name", LIGHT)
def test_light_model(name):
    model = onnx.load(str(DATA / "light" / f"light_{name}.onnx"))
    inits = {i.name for i in model.graph.initializer}
    inputs = [_dummy(vi) for vi in model.graph.input if vi.name not in inits]
    (expected,) = [_tensor(DATA / "light" / f"light_{name}_output_0.pb")]
    (got,) = _run(model, inputs)[:1]
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------- the search schedules the new ops

SEARCHED = {
    "LRN": (dict(size=5), [(1, 8, 6, 6)], []),
    "LogSoftmax": (dict(axis=-1), [(4, 33)], []),
    "Conv3d": (dict(pads=[1, 0, 1, 1, 0, 1], group=2), [(1, 4, 5, 6, 6)], [("w", (6, 2, 3, 2, 3))]),
    "MaxPool3d": (dict(kernel_shape=[2, 2, 2], strides=[2, 1, 2]), [(1, 3, 4, 5, 6)], []),
    "AveragePool3d": (dict(kernel_shape=[3, 3, 3], pads=[1, 1, 1, 1, 1, 1]), [(1, 2, 4, 5, 5)], []),
    "PadReflect": (dict(mode="reflect"), [(1, 3, 6, 7)], [("pads", np.array([0, 0, 2, 1, 0, 0, 1, 3]))]),
    "Tile": ({}, [(2, 3, 5)], [("repeats", np.array([1, 3, 2]))]),
    "Selu": ({}, [(3, 64)], []),
}


@pytest.mark.parametrize("case", list(SEARCHED))
def test_search_programs_of_the_new_ops_are_correct(case):
    """Sampled sketches with random annotations of each new op's task, built and run against the
    task's NumPy reference (tests/conftest.check_state)."""
    attrs, shapes, consts = SEARCHED[case]
    op = {"Conv3d": "Conv", "MaxPool3d": "MaxPool", "AveragePool3d": "AveragePool", "PadReflect": "Pad"}.get(case, case)
    rng = np.random.default_rng(len(case))
    inits = [numpy_helper.from_array(v.astype(np.int64) if v.dtype.kind == "i" else v, n) if isinstance(v, np.ndarray)
             else numpy_helper.from_array(rng.standard_normal(v).astype(np.float32), n) for n, v in consts]
    model = helper.make_model(helper.make_graph(
        [helper.make_node(op, ["x"] + [n for n, _ in consts], ["y"], **attrs)], case, [_vi("x", shapes[0])],
        [_vi("y", None)], inits), opset_imports=[helper.make_opsetid("", 18)])
    _reference(model, {"x": rng.standard_normal(shapes[0]).astype(np.float32)})
    (task,) = extract_tasks(import_onnx(model)).tasks
    policy = SketchPolicy(make_task(task.dag), params=SearchParams(), seed=0)
    programs = policy.sample(4)
    assert programs, f"no program could be sampled for {case}"
    for k, c in enumerate(programs):
        check_state(c.state, seed=k)


# ----------------------------------------------------------------- ONNX's node test cases

def _float32_only(case) -> bool:
    values = list(case.model.graph.input) + list(case.model.graph.output)
    return all(v.type.HasField("tensor_type") and v.type.tensor_type.elem_type == TensorProto.FLOAT for v in values)


def _node_cases() -> list:
    """onnx's node test cases (built by their `expect` functions, as onnx's own backend test does) whose
    inputs and outputs are all float32: 751 with onnx 1.23."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the expect functions divide by zero on purpose
        return [c for c in collect_testcases(None) if c.model is not None and _float32_only(c)]


NODE_CASES = _node_cases()
NODE_EXPECTED_FAIL = {line.strip() for line in (pathlib.Path(__file__).parent / "data" /
                                                 "onnx_node_expected_failures.txt").read_text().splitlines()
                      if line.strip() and not line.startswith("#")}


@pytest.mark.parametrize("case", NODE_CASES, ids=lambda c: c.name)
def test_node_case(case):
    inputs, outputs = case.data_sets[0]
    arrays = [np.asarray(x) for x in inputs]
    if case.name in NODE_EXPECTED_FAIL:
        with pytest.raises((OnnxImportError, ExtractError)) as err:
            _run(case.model, arrays)
        assert "\n" not in str(err.value)
        return
    got = _run(case.model, arrays)
    for g, e in zip(got, outputs):
        np.testing.assert_allclose(g, np.asarray(e), rtol=case.rtol, atol=case.atol)


def test_node_expected_failures_are_real_cases_and_few_enough():
    names = {c.name for c in NODE_CASES}
    assert NODE_EXPECTED_FAIL <= names
    assert len(names - NODE_EXPECTED_FAIL) >= 500        # issue 22's bar: 500 of the 751 pass
