"""Every graph op through the compiled path: extraction builds its tensor expression, the default
schedule compiles it, and the kernel's output is compared with the graph's own NumPy reference (which
shares no code with the tensor-expression library)."""
from __future__ import annotations

import numpy as np
import pytest

from tensortune.codegen.network_runtime import build_network
from tensortune.tasks.extract import extract_tasks
from tensortune.tasks.graph import GraphBuilder
from tensortune.tasks.reference import mismatch

RNG = np.random.default_rng(7)


def _w(*shape) -> np.ndarray:
    return RNG.uniform(-1, 1, size=shape).astype(np.float32)


def _single(op: str, in_shapes, consts=(), **attrs):
    """A graph of one op: runtime inputs (shapes) first, then constant inputs."""
    def build():
        g = GraphBuilder(op)
        ins = [g.input(f"x{i}", s[0], s[1]) if isinstance(s[-1], str) else g.input(f"x{i}", s)
               for i, s in enumerate(in_shapes)]
        ins += [g.constant(c, f"c{i}") for i, c in enumerate(consts)]
        return g.build([g.add(op, ins, **attrs)])
    return build


def _gather_graph():
    g = GraphBuilder("gather")
    ids = g.input("ids", (2, 5), "int64")
    return g.build([g.add("gather", [g.constant(_w(11, 6)), ids], axis=0)])


CASES = {
    "conv2d": _single("conv2d", [(1, 4, 9, 9)], [_w(6, 4, 3, 3), _w(6)], strides=(2, 2), pads=(1, 1, 1, 1)),
    "conv2d_asym_pads_dilation": _single("conv2d", [(1, 3, 8, 7)], [_w(4, 3, 3, 2)], pads=(0, 1, 2, 0),
                                         dilations=(2, 1)),
    "conv2d_grouped": _single("conv2d", [(2, 8, 6, 6)], [_w(8, 2, 3, 3)], pads=(1, 1, 1, 1), groups=4),
    "conv2d_depthwise_multiplier": _single("conv2d", [(1, 4, 7, 7)], [_w(8, 1, 3, 3), _w(8)], strides=(2, 2),
                                           pads=(1, 1, 1, 1), groups=4),
    "conv_transpose2d": _single("conv_transpose2d", [(1, 6, 3, 4)], [_w(6, 4, 4, 4), _w(4)], strides=(2, 2),
                                pads=(1, 1, 1, 1)),
    "conv_transpose2d_output_padding": _single("conv_transpose2d", [(1, 3, 4, 4)], [_w(3, 2, 3, 3)], strides=(2, 2),
                                               pads=(1, 1, 1, 1), output_padding=(1, 1)),
    "dense": _single("dense", [(3, 20)], [_w(7, 20), _w(7)]),
    "matmul_2d": _single("matmul", [(5, 12), (12, 9)]),
    "matmul_3d_weight": _single("matmul", [(2, 5, 12)], [_w(12, 9)]),
    "matmul_batched": _single("matmul", [(3, 5, 6), (3, 6, 4)]),
    "matmul_4d_broadcast": _single("matmul", [(2, 3, 5, 6), (1, 3, 6, 4)]),
    "max_pool2d": _single("max_pool2d", [(1, 3, 9, 8)], kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)),
    "max_pool2d_asym": _single("max_pool2d", [(1, 2, 7, 7)], kernel=(2, 3), strides=(2, 2), pads=(0, 1, 1, 0)),
    "avg_pool2d_exclusive": _single("avg_pool2d", [(1, 3, 7, 7)], kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)),
    "avg_pool2d_inclusive": _single("avg_pool2d", [(1, 3, 7, 7)], kernel=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1),
                                    count_include_pad=True),
    "global_avg_pool2d": _single("global_avg_pool2d", [(2, 5, 6, 7)]),
    "softmax": _single("softmax", [(3, 4, 17)], axis=-1),
    "layer_norm": _single("layer_norm", [(2, 5, 24)], [_w(24), _w(24)], epsilon=1e-5),
    "batch_norm_runtime_stats": _single("batch_norm", [(2, 3, 4, 4), (3,), (3,), (3,), (3,)]),
    "reduce_mean": _single("reduce_mean", [(2, 6, 10)], axes=(-1,), keepdims=True),
    "reduce_sum_two_axes": _single("reduce_sum", [(2, 6, 5, 4)], axes=(1, 3), keepdims=False),
    "add_broadcast": _single("add", [(2, 3, 4, 5)], [_w(3, 1, 1)]),
    "sub": _single("sub", [(4, 6), (4, 6)]),
    "mul_scalar": _single("mul", [(4, 6)], [np.array(0.125, np.float32)]),
    "div": _single("div", [(4, 6)], [_w(6) + 2.0]),
    "pow": _single("pow", [(4, 6)], [np.array(2.0, np.float32)]),
    "maximum": _single("maximum", [(4, 6), (1, 6)]),
    "relu": _single("relu", [(3, 10)]),
    "sigmoid": _single("sigmoid", [(3, 10)]),
    "tanh": _single("tanh", [(3, 10)]),
    "exp": _single("exp", [(3, 10)]),
    "erf": _single("erf", [(3, 10)]),
    "gelu": _single("gelu", [(3, 10)]),
    "neg": _single("neg", [(3, 10)]),
    "clip_relu6": _single("clip", [(3, 10)], min=0.0, max=6.0),
    "clip_lower_only": _single("clip", [(3, 10)], min=-0.25),
    "transpose": _single("transpose", [(2, 3, 4, 5)], perm=(0, 2, 3, 1)),
    "slice_strided": _single("slice", [(3, 10, 6)], begin=(1, 1, 0), end=(3, 10, 6), step=(1, 3, 2)),
    "slice_reversed": _single("slice", [(4, 5)], begin=(3, 4), end=(-1, 0), step=(-1, -2)),
    "gather_embedding": lambda: _gather_graph(),
    "concat": _single("concat", [(2, 3, 4), (2, 5, 4), (2, 1, 4)], axis=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_compiles_and_matches_reference(case):
    graph = CASES[case]()
    net = extract_tasks(graph)
    # a conv becomes NHWC between the transposes of its input and output (tasks.channels_last)
    own = [t for t in net.tasks if t.name != "transpose" or case == "transpose"]
    assert len(own) == 1
    compiled = build_network(net)
    inputs = graph.random_inputs(3)
    if case == "gather_embedding":                # negative indices wrap, as in numpy/ONNX
        inputs["ids"][0, 0] = -1
    if case == "batch_norm_runtime_stats":        # a variance is positive
        inputs["x4"] = np.abs(inputs["x4"]) + 0.5
    outs = compiled.run(inputs)
    refs = graph.run_reference(inputs)
    for name, ref in refs.items():
        bad = mismatch(outs[name], ref.astype(np.float32))
        assert bad is None, f"{case}: {bad}\n{own[0].dag}"


def test_batch_norm_is_folded_into_the_conv_before_it():
    g = GraphBuilder("conv_bn")
    x = g.input("x", (1, 3, 6, 6))
    y = g.add("conv2d", [x, g.constant(_w(4, 3, 3, 3))], pads=(1, 1, 1, 1))
    stats = [g.constant(_w(4) + 1.5), g.constant(_w(4)), g.constant(_w(4)), g.constant(_w(4) + 1.5)]
    y = g.add("batch_norm", [y] + stats, epsilon=1e-3)
    y = g.add("relu", [y])
    graph = g.build([y])
    net = extract_tasks(graph, channels_last=False)
    assert [n.op for n in net.graph.nodes] == ["conv2d", "relu"]
    assert net.tasks[0].name == "conv2d_bias_relu"
    assert net.node_group["batch_norm"] == net.node_group["conv2d"] == 0
    assert build_network(net).check().passed
