"""The DSL and ComputeDAG: analysis, FLOPs, stable keys, JSON, the reference, and clear errors."""
from __future__ import annotations

import numpy as np
import pytest

from tensortune.tasks import ops, te
from tensortune.tasks.compute_dag import ComputeDAG, DAGError
from tensortune.tasks.reference import evaluate, mismatch
from tensortune.tasks.workload_registry import UnknownWorkload, make_dag, workload_names
from tensortune.tasks.workloads import PAPER_SHAPES


def test_matmul_dag_text_flops_and_analysis():
    dag = make_dag("matmul", 64, 48, 32)
    assert dag.to_text().splitlines()[2] == "C(i, j) += (A[i, k]*B[k, j])  [k:32]"
    assert dag.flop_ct == 2 * 64 * 48 * 32
    c = dag.tensor("C")
    assert dag.analysis.needs_multi_level_tiling[c] and dag.analysis.is_output[c]
    assert not dag.analysis.is_strictly_inlineable[c]


def test_conv_analysis_marks_pad_not_inlineable_and_relu_inlineable():
    dag = make_dag("conv2d_relu", 1, 8, 8, 4, 8, 3, 3, 1, 1, True)
    an = dag.analysis
    assert not an.is_strictly_inlineable[dag.tensor("pad_temp")]        # it has a branch
    assert an.is_strictly_inlineable[dag.tensor("T_add")]              # bias add is elementwise
    assert an.needs_multi_level_tiling[dag.tensor("conv2d_nchw")]
    assert an.elementwise_match(dag.tensor("conv2d_nchw"), dag.tensor("T_relu"))
    assert an.num_common_outer_iterators(dag.tensor("conv2d_nchw"), dag.tensor("T_relu")) == 4


def test_workload_key_is_stable_across_versions():
    """Stored records and models are found by this key: a change to the canonical text would orphan
    every record ever written. Pinned values; change them only with a migration of the history."""
    assert make_dag("matmul", 64, 64, 64).workload_key == "17997285f8b98616949e"
    assert make_dag("conv2d_relu", 1, 56, 56, 64, 64, 3, 3, 1, 1).workload_key == "a0ee5f29cf826a6b0b9a"


def test_workload_key_ignores_names_but_not_shapes():
    def build(n, names):
        a = te.placeholder((n, 8), name=names[0])
        b = te.placeholder((8, 8), name=names[1])
        return ComputeDAG([a, b, ops.matmul(a, b, name=names[2])])
    assert build(4, "ABC").workload_key == build(4, "XYZ").workload_key
    assert build(4, "ABC").workload_key != build(5, "ABC").workload_key


def test_json_round_trip_keeps_key_and_semantics():
    dag = make_dag("conv2d_transpose", 1, 4, 4, 4, 3, 4, 4, 2, 1)
    back = ComputeDAG.from_json(dag.to_json())
    assert back.workload_key == dag.workload_key
    x = dag.random_inputs(3)
    np.testing.assert_array_equal(evaluate(dag, x)[0], evaluate(back, x)[0])


def test_reference_matches_numpy_on_known_ops():
    dag = make_dag("matmul", 20, 30, 10)
    a, b = dag.random_inputs()
    assert mismatch(evaluate(dag, [a, b])[0], a.astype(np.float64) @ b) is None
    sm = make_dag("softmax", 3, 7)
    (x,) = sm.random_inputs()
    e = np.exp(x - x.max(1, keepdims=True))
    assert mismatch(evaluate(sm, [x])[0], e / e.sum(1, keepdims=True)) is None


def test_mismatch_reports_wrong_values():
    ref = np.arange(6, dtype=np.float32).reshape(2, 3)
    bad = ref.copy()
    bad[1, 2] += 1
    assert "worst at (1, 2)" in mismatch(bad, ref)


def test_every_paper_op_has_its_shapes():
    names = set(workload_names())
    assert set(PAPER_SHAPES) == {"C1D", "C2D", "C3D", "GMM", "GRP", "DIL", "DEP", "T2D", "CAP", "NRM"}
    for code, (name, shapes) in PAPER_SHAPES.items():
        assert name in names and len(shapes) == 4
        assert make_dag(name, *shapes[0]).flop_ct > 0


def test_unknown_workload_names_the_known_ones():
    with pytest.raises(UnknownWorkload, match="unknown workload 'gemmm'.*matmul"):
        make_dag("gemmm")


def test_bad_arguments_name_the_signature():
    with pytest.raises(TypeError, match="matmul"):
        make_dag("matmul", 1, 2, 3, 4, 5, 6)


@pytest.mark.parametrize("fn, match", [
    (lambda: ops.matmul(te.placeholder((4, 5)), te.placeholder((6, 7))), r"do not chain"),
    (lambda: ops.conv2d_nchw(te.placeholder((1, 3, 8, 8)), te.placeholder((8, 4, 3, 3))), r"channels"),
    (lambda: ops.conv2d_nchw(te.placeholder((1, 3, 2, 2)), te.placeholder((8, 3, 5, 5))), r"does not fit"),
    (lambda: te.placeholder((3, 0)), r"positive integers"),
    (lambda: te.placeholder((3,), dtype="float8"), r"unknown dtype"),
    (lambda: te.placeholder((3,), "float32") [0] + te.placeholder((3,), "float64")[0], r"dtype mismatch"),
    (lambda: te.placeholder((3, 3))[1], r"2 dimensions"),
])
def test_bad_shapes_and_dtypes_fail_clearly(fn, match):
    with pytest.raises((ValueError, TypeError, IndexError), match=match):
        fn()


def test_out_of_bounds_access_is_caught_at_dag_construction():
    a = te.placeholder((8,), name="A")
    b = te.compute((8,), lambda i: a[i + 1], name="B")
    with pytest.raises(DAGError, match=r"B reads A out of bounds .* \[1, 8\]"):
        ComputeDAG([a, b])


def test_missing_input_is_named():
    a = te.placeholder((8,), name="A")
    b = te.compute((8,), lambda i: a[i] * 2.0, name="B")
    with pytest.raises(DAGError, match="placeholder 'A'"):
        ComputeDAG([b])


def test_malformed_dag_json_is_a_clear_error():
    with pytest.raises(DAGError, match="malformed ComputeDAG JSON"):
        ComputeDAG.from_json('{"tensors": [{"name": 1}]}')


@pytest.mark.parametrize("bias", [False, True])
def test_the_nhwc_conv_layer_is_the_nchw_layer_transposed(bias):
    """bench tune's conv2d_nhwc_relu is the ResNet-18 layer channels-last: the same numbers as the NCHW
    layer with its data, kernel and output transposed."""
    args = (1, 9, 7, 5, 6, 3, 3, 1, 1, bias)
    nchw, nhwc = make_dag("conv2d_relu", *args), make_dag("conv2d_relu", *args, "float32", "NHWC")
    x, w, *b = nchw.random_inputs(seed=3)
    want = evaluate(nchw, [x, w, *b])[0]
    got = evaluate(nhwc, [x.transpose(0, 2, 3, 1).copy(), w.transpose(2, 3, 1, 0).copy(), *b])[0]
    np.testing.assert_allclose(got, want.transpose(0, 2, 3, 1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layout must be NCHW or NHWC"):
        make_dag("conv2d_relu", *args, "float32", "NCWH")


def test_the_benchmarks_channels_last_torch_call_computes_the_nhwc_layer():
    torch = pytest.importorskip("torch")
    from bench.tune import WORKLOADS, library_fn
    name, args, _ = WORKLOADS["conv2d_nhwc_relu"]
    small = make_dag(name, 1, 10, 12, 16, 32, 3, 3, 1, 1, *args[9:])
    _, fn = library_fn("conv2d_nhwc_relu", small, threads=1)
    out = fn()
    assert out.is_contiguous(memory_format=torch.channels_last)
    want = evaluate(small, small.random_inputs())[0]
    np.testing.assert_allclose(out.permute(0, 2, 3, 1).numpy(), want, rtol=1e-4, atol=1e-4)


def test_walk_distinct_visits_a_shared_subtree_once():
    """An expression is a DAG where a subtree object is used twice; `walk_distinct` (what codegen and
    lowering ask "which nodes are there" with) yields each object once, `walk` once per path, and both
    see the same nodes."""
    x = te.placeholder((8,), "float32", "x")
    i = te.Var("i")
    s = x[i] * 2.0 + 1.0
    e = s * s + s
    walked, distinct = list(te.walk(e)), list(te.walk_distinct(e))
    assert sum(n is s for n in walked) == 3 and sum(n is s for n in distinct) == 1
    assert {id(n) for n in walked} == {id(n) for n in distinct}
    assert len(distinct) == len({id(n) for n in distinct})
    assert distinct[0] is e                      # pre-order, as walk


def test_shared_makes_equal_subtrees_one_object_and_keeps_the_tree():
    """`te.shared` (every compute body passes it): structurally equal subtrees become one object, the
    tree it prints stays the same, constants that differ only in a zero's sign stay apart, a variable is
    never merged with another of its name, and sharing a shared expression changes nothing."""
    x = te.placeholder((8,), "float32", "x")
    i, j = te.Var("i"), te.Var("i")
    e = (x[i + 1] * -0.0 + x[i + 1] * 0.0) + (x[j + 1] + x[i + 1])
    s = te.shared(e)
    assert te.to_text(s) == te.to_text(e)
    loads = {id(n): n for n in te.walk(s) if isinstance(n, te.Load)}
    assert len([n for n in te.walk(s) if isinstance(n, te.Load)]) == 4 and len(loads) == 2   # x[i+1] thrice, x[j+1]
    zeros = [n for n in te.walk_distinct(s) if isinstance(n, te.Const) and n.value == 0.0]
    assert sorted(repr(z.value) for z in zeros) == ["-0.0", "0.0"]
    assert te.shared(s) is s


def test_a_body_is_shared_wherever_it_comes_from():
    """A compute's body and the same body read back from JSON have the same objects: as many distinct
    nodes, and the same text. A Winograd F(4) input transform reads its tile's 36 values once each."""
    dag = make_dag("conv2d_winograd", 1, 14, 14, 16, 16, 1, 4, layout="NHWC")
    back = ComputeDAG.from_json(dag.to_json())
    for t, u in zip(dag.tensors, back.tensors):
        if t.body is None:
            continue
        assert te.to_text(t.body) == te.to_text(u.body)
        assert len(list(te.walk_distinct(t.body))) == len(list(te.walk_distinct(u.body))), t.name
    pack = dag.tensor("data_pack").body
    loads = {id(n) for n in te.walk_distinct(pack) if isinstance(n, te.Load)}
    assert len(loads) == 36 and len([n for n in te.walk(pack) if isinstance(n, te.Load)]) > 300
