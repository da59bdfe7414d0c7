"""The graph IR: shape inference, validation errors that name the culprit, and the NumPy reference's
semantics checked against independent definitions (direct loops, adjoint identities)."""
from __future__ import annotations

import numpy as np
import pytest

from tensortune.tasks.graph import Graph, GraphBuilder
from tensortune.tasks.graph_ops import GraphError, Node, TensorInfo, run_node


def _run(op: str, xs: list[np.ndarray], **attrs) -> np.ndarray:
    node = Node("n", op, tuple(f"x{i}" for i in range(len(xs))), "y", attrs)
    from tensortune.tasks.graph_ops import infer_node
    infer_node(node, [TensorInfo(x.shape, str(x.dtype)) for x in xs])
    return run_node(node, xs)


def _conv_loops(x, w, stride, pads, dil, groups):
    """conv2d by its definition, one output element at a time."""
    n, c, h, wd = x.shape
    co, cig, kh, kw = w.shape
    pt, pl, pb, pr = pads
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    oh = (h + pt + pb - dil[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + pl + pr - dil[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, co, oh, ow))
    cog = co // groups
    for b in range(n):
        for f in range(co):
            g = f // cog
            for y in range(oh):
                for xx in range(ow):
                    acc = 0.0
                    for ci in range(cig):
                        for ky in range(kh):
                            for kx in range(kw):
                                acc += xp[b, g * cig + ci, y * stride[0] + ky * dil[0], xx * stride[1] + kx * dil[1]] \
                                    * w[f, ci, ky, kx]
                    out[b, f, y, xx] = acc
    return out


@pytest.mark.parametrize("groups,stride,pads,dil", [(1, (1, 1), (1, 1, 1, 1), (1, 1)),
                                                    (2, (2, 1), (0, 1, 2, 0), (1, 2)),
                                                    (4, (1, 2), (2, 2, 2, 2), (2, 1))])
def test_conv2d_reference_matches_the_definition(groups, stride, pads, dil):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 7, 6))
    w = rng.standard_normal((8, 4 // groups, 3, 2))
    b = rng.standard_normal(8)
    got = _run("conv2d", [x, w, b], strides=stride, pads=pads, dilations=dil, groups=groups)
    want = _conv_loops(x, w, stride, pads, dil, groups) + b.reshape(1, -1, 1, 1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("stride,pads,out_pad", [((1, 1), (0, 0, 0, 0), (0, 0)), ((2, 2), (1, 1, 1, 1), (1, 1)),
                                                 ((2, 3), (1, 0, 2, 1), (0, 2))])
def test_conv_transpose_is_the_adjoint_of_conv(stride, pads, out_pad):
    """<conv(x, w), y> == <x, conv_transpose(y, w)>: the transposed conv's defining identity."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 3, 4, 3))            # conv: 3 -> 5 channels (OIHW); transpose reads it as IOHW
    y = rng.standard_normal((2, 5, 4, 5))
    xt = _run("conv_transpose2d", [y, w], strides=stride, pads=pads, output_padding=out_pad)
    x = rng.standard_normal(xt.shape)
    cy = _run("conv2d", [x, w], strides=stride, pads=pads)
    assert cy.shape == y.shape
    np.testing.assert_allclose(np.sum(cy * y), np.sum(x * xt), rtol=1e-10)


def test_pooling_reference():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 5, 6))
    mx = _run("max_pool2d", [x], kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1))
    assert mx.shape == (1, 2, 3, 3)
    assert mx[0, 1, 1, 2] == x[0, 1, 1:4, 3:6].max()
    assert mx[0, 0, 0, 0] == x[0, 0, 0:2, 0:2].max()      # the window overlaps the padding
    ex = _run("avg_pool2d", [x], kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), count_include_pad=False)
    inc = _run("avg_pool2d", [x], kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), count_include_pad=True)
    assert np.isclose(ex[0, 0, 0, 0], x[0, 0, 0:2, 0:2].mean())
    assert np.isclose(inc[0, 0, 0, 0], x[0, 0, 0:2, 0:2].sum() / 9)
    assert np.isclose(ex[0, 1, 1, 1], x[0, 1, 1:4, 1:4].mean())


def test_normalisations_and_gather():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 8))
    sm = _run("softmax", [x], axis=-1)
    np.testing.assert_allclose(sm.sum(-1), 1.0)
    g, b = rng.standard_normal(8), rng.standard_normal(8)
    ln = _run("layer_norm", [x, g, b], epsilon=1e-5)
    z = (ln - b) / g
    np.testing.assert_allclose(z.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(z.var(-1), 1, rtol=1e-3)
    table = rng.standard_normal((10, 4))
    idx = np.array([[0, 9], [-1, 3]])
    got = _run("gather", [table, idx], axis=0)
    np.testing.assert_array_equal(got[1, 0], table[9])
    with pytest.raises(GraphError, match="outside"):
        _run("gather", [table, np.array([10])], axis=0)


def test_builder_infers_shapes_and_runs():
    g = GraphBuilder("tiny")
    x = g.input("x", (2, 3, 8, 8))
    w = g.constant(np.ones((4, 3, 3, 3), np.float32), "w")
    y = g.add("conv2d", [x, w], strides=(2, 2), pads=(1, 1, 1, 1))
    y = g.add("relu", [y])
    assert g.shape(y) == (2, 4, 4, 4)
    flat = g.add("reshape", [y], shape=(2, 64))
    graph = g.build([flat])
    assert graph.values[flat] == TensorInfo((2, 64), "float32")
    assert graph.consumers(y)[0].op == "reshape"
    assert graph.producer(flat).op == "reshape"
    out = graph.run_reference(graph.random_inputs(0))[flat]
    assert out.dtype == np.float64 and out.shape == (2, 64) and np.all(out >= 0)
    assert graph.num_params == 4 * 27
    assert "conv2d" in str(graph)


@pytest.mark.parametrize("build,match", [
    (lambda g, x: g.add("conv3x3", [x]), r"unknown op 'conv3x3' \(node 'conv3x3'\); known ops: .*conv2d"),
    (lambda g, x: g.add("conv2d", [x, g.constant(np.ones((4, 5, 3, 3), np.float32))], name="c1"),
     r"node 'c1' \(conv2d\): data has 3 channels"),
    (lambda g, x: g.add("relu", [x, x], name="r"), r"node 'r' \(relu\): takes 1 inputs, got 2"),
    (lambda g, x: g.add("max_pool2d", [x], name="p"), r"node 'p' \(max_pool2d\): missing required attribute 'kernel'"),
    (lambda g, x: g.add("relu", [x], name="r", alpha=0.1), r"node 'r' \(relu\): unknown attribute\(s\) \['alpha'\]"),
    (lambda g, x: g.add("add", [x, "nowhere"], name="a"), r"node 'a' \(add\) reads undefined value 'nowhere'"),
    (lambda g, x: g.add("reshape", [x], shape=(7, 7)), r"cannot reshape \[1, 3, 8, 8\]"),
    (lambda g, x: g.add("add", [x, g.constant(np.ones((4,), np.float32))]), r"do not broadcast"),
    (lambda g, x: g.add("transpose", [x], perm=(0, 1, 1, 2)), r"not a permutation"),
    (lambda g, x: g.add("softmax", [x], axis=4), r"axis 4 is out of range"),
])
def test_bad_nodes_name_the_node_and_the_problem(build, match):
    g = GraphBuilder("bad")
    x = g.input("x", (1, 3, 8, 8))
    with pytest.raises(GraphError, match=match):
        build(g, x)


def test_graph_validation_errors():
    info = {"x": TensorInfo((2, 2))}
    with pytest.raises(GraphError, match=r"reads 'y', which is not a graph input.*topological order"):
        Graph("g", info, {}, [Node("a", "relu", ("y",), "z"), Node("b", "relu", ("x",), "y")], ["z"])
    with pytest.raises(GraphError, match="defined twice"):
        Graph("g", info, {}, [Node("a", "relu", ("x",), "x")], ["x"])
    with pytest.raises(GraphError, match="no outputs"):
        Graph("g", info, {}, [], [])
    with pytest.raises(GraphError, match="'nope' is not produced"):
        Graph("g", info, {}, [], ["nope"])
    with pytest.raises(GraphError, match="must be a numpy array"):
        Graph("g", info, {"c": [1, 2]}, [], ["x"])
    g = Graph("g", info, {}, [Node("a", "relu", ("x",), "y")], ["y"])
    with pytest.raises(GraphError, match=r"needs input\(s\) \['x'\]"):
        g.run_reference({})
    with pytest.raises(GraphError, match=r"input 'x' must have shape \[2, 2\], got \[3\]"):
        g.run_reference({"x": np.ones(3)})


def test_random_inputs_respect_gather_bounds():
    g = GraphBuilder("emb")
    ids = g.input("ids", (4, 50), "int64")
    y = g.add("gather", [g.constant(np.ones((7, 3), np.float32)), ids], axis=0)
    graph = g.build([y])
    a = graph.random_inputs(0)["ids"]
    assert a.dtype == np.int64 and a.min() >= 0 and a.max() < 7 and len(np.unique(a)) > 1
    assert np.array_equal(a, graph.random_inputs(0)["ids"])
