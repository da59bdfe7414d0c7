"""Task extraction: fusion rules, dedup by workload key, weights, and the node -> task map."""
from __future__ import annotations

import numpy as np
import pytest

from tensortune.codegen.network_runtime import build_network
from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.extract import ExtractError, extract_tasks, partition, simplify_for_inference
from tensortune.tasks.graph import GraphBuilder
from tensortune.tasks.models import make_network

# ResNet-50 at batch 1, 224x224: 27 unique tasks from 56 fused subgraphs (53 convs, the max pool,
# the global pool and the dense layer), in first-occurrence order.
RESNET50_TASKS = [
    ("conv2d_bias_relu", 1, [1, 64, 112, 112]), ("max_pool2d", 1, [1, 64, 56, 56]),
    ("conv2d_bias_relu", 1, [1, 64, 56, 56]), ("conv2d_bias_relu", 3, [1, 64, 56, 56]),
    ("conv2d_bias_add_relu", 3, [1, 256, 56, 56]), ("conv2d_bias", 1, [1, 256, 56, 56]),
    ("conv2d_bias_relu", 2, [1, 64, 56, 56]), ("conv2d_bias_relu", 1, [1, 128, 56, 56]),
    ("conv2d_bias_relu", 1, [1, 128, 28, 28]), ("conv2d_bias_add_relu", 4, [1, 512, 28, 28]),
    ("conv2d_bias", 1, [1, 512, 28, 28]), ("conv2d_bias_relu", 3, [1, 128, 28, 28]),
    ("conv2d_bias_relu", 3, [1, 128, 28, 28]), ("conv2d_bias_relu", 1, [1, 256, 28, 28]),
    ("conv2d_bias_relu", 1, [1, 256, 14, 14]), ("conv2d_bias_add_relu", 6, [1, 1024, 14, 14]),
    ("conv2d_bias", 1, [1, 1024, 14, 14]), ("conv2d_bias_relu", 5, [1, 256, 14, 14]),
    ("conv2d_bias_relu", 5, [1, 256, 14, 14]), ("conv2d_bias_relu", 1, [1, 512, 14, 14]),
    ("conv2d_bias_relu", 1, [1, 512, 7, 7]), ("conv2d_bias_add_relu", 3, [1, 2048, 7, 7]),
    ("conv2d_bias", 1, [1, 2048, 7, 7]), ("conv2d_bias_relu", 2, [1, 512, 7, 7]),
    ("conv2d_bias_relu", 2, [1, 512, 7, 7]), ("global_avg_pool2d", 1, [1, 2048, 1, 1]),
    ("dense_bias", 1, [1, 1000]),
]


@pytest.mark.parametrize("channels_last", [False, True])
def test_resnet50_tasks_and_weights(channels_last):
    graph = make_network("resnet-50")
    net = extract_tasks(graph, channels_last=channels_last)
    got = [(t.name, t.weight, list(t.dag.outputs[0].shape)) for t in net.tasks]
    want = RESNET50_TASKS
    if channels_last:     # the same tasks in NHWC after the image's transpose (the dense layer is 2-d)
        want = [("transpose", 1, [1, 224, 224, 3])] + [
            (name.replace("conv2d", "conv2d_nhwc").replace("pool2d", "pool2d_nhwc"), weight,
             [shape[0], *shape[2:], shape[1]] if len(shape) == 4 else shape) for name, weight, shape in want]
    assert got == want
    extra = int(channels_last)
    assert len(net.tasks) == 27 + extra and len(net.groups) == 56 + extra
    assert sum(t.weight for t in net.tasks) == 56 + extra
    assert len({t.workload_key for t in net.tasks}) == 27 + extra
    # 4.1 GMACs: the published ResNet-50 cost (the 3x3 max pool and the average are counted too)
    assert net.total_flops == pytest.approx(8.207e9, rel=1e-3)
    # every node maps to a task; BatchNorm was folded into the convolutions at build time
    assert set(net.node_group) == {n.name for n in graph.nodes}
    assert net.node_group["flatten"] is None
    assert net.task_of("layer3.2.relu").name == ("conv2d_nhwc_bias_add_relu" if channels_last
                                                 else "conv2d_bias_add_relu")
    assert net.task_of("layer3.2.relu") is net.task_of("layer3.3.add")


def test_bert_tasks_and_weights():
    net = extract_tasks(make_network("bert-base", seq_len=128, num_layers=12))
    got = [(t.name, t.weight, list(t.dag.inputs[0].shape), list(t.dag.outputs[0].shape)) for t in net.tasks]
    assert got == [
        ("gather_add_add", 1, [30522, 768], [1, 128, 768]),          # embeddings
        ("layer_norm", 25, [1, 128, 768], [1, 128, 768]),
        ("matmul_add", 36, [1, 128, 768], [1, 128, 768]),            # Q, K, V projections
        ("transpose", 24, [1, 128, 12, 64], [1, 12, 128, 64]),       # Q and V into heads
        ("transpose", 12, [1, 128, 12, 64], [1, 12, 64, 128]),       # K into heads, transposed
        ("matmul_mul", 12, [1, 12, 128, 64], [1, 12, 128, 128]),     # scores, scaled
        ("softmax", 12, [1, 12, 128, 128], [1, 12, 128, 128]),
        ("matmul", 12, [1, 12, 128, 128], [1, 12, 128, 64]),         # context
        ("transpose", 12, [1, 12, 128, 64], [1, 128, 12, 64]),       # heads back
        ("matmul_add_add", 12, [1, 128, 768], [1, 128, 768]),        # attention output + residual
        ("matmul_add_gelu", 12, [1, 128, 768], [1, 128, 3072]),      # FFN in
        ("matmul_add_add", 12, [1, 128, 3072], [1, 128, 768]),       # FFN out + residual
        ("slice", 1, [1, 128, 768], [1, 1, 768]),                    # [CLS]
        ("dense_bias_tanh", 1, [1, 768], [1, 768]),                  # pooler
    ]
    assert sum(t.weight for t in net.tasks) == len(net.groups) == 184


def test_dedup_key_ignores_names_and_weights_but_not_shapes():
    def block(name: str, c: int, seed: int):
        g = GraphBuilder(name)
        x = g.input(f"{name}_in", (1, c, 8, 8))
        w = np.random.default_rng(seed).standard_normal((c, c, 3, 3)).astype(np.float32)
        y = g.add("conv2d", [x, g.constant(w, f"{name}_w")], name=f"{name}_conv", pads=(1, 1, 1, 1))
        return g.build([g.add("relu", [y], name=f"{name}_relu")])
    a, b, c = (extract_tasks(block("a", 4, 0)), extract_tasks(block("b", 4, 1)), extract_tasks(block("c", 8, 0)))
    assert a.tasks[0].workload_key == b.tasks[0].workload_key != c.tasks[0].workload_key
    # the key survives the DAG's JSON round trip (workers rebuild it from JSON)
    assert ComputeDAG.from_json(a.tasks[0].dag.to_json()).workload_key == a.tasks[0].workload_key


def _chain_graph(extra_reader: bool = False, output_mid: bool = False):
    g = GraphBuilder("chain")
    x = g.input("x", (1, 4, 6, 6))
    y = g.add("conv2d", [x, g.constant(np.ones((4, 4, 1, 1), np.float32)), g.constant(np.ones(4, np.float32))],
              name="conv")
    y = g.add("add", [y, x], name="residual")
    r = g.add("relu", [y], name="relu")
    outs = [g.add("sigmoid", [r], name="sig")]
    if extra_reader:
        outs.append(g.add("tanh", [y], name="tanh"))
    if output_mid:
        outs.append(r)
    return g.build(outs)


def test_fusion_rules():
    groups, _ = partition(_chain_graph())
    assert [[n.name for n in g] for g in groups] == [["conv", "residual", "relu", "sig"]]
    # a value read twice ends the chain: `residual` has two readers
    groups, _ = partition(_chain_graph(extra_reader=True))
    assert [[n.name for n in g] for g in groups] == [["conv", "residual"], ["relu", "sig"], ["tanh"]]
    # a graph output ends the chain (it must be stored)
    groups, _ = partition(_chain_graph(output_mid=True))
    assert [[n.name for n in g] for g in groups] == [["conv", "residual", "relu"], ["sig"]]
    for graph in (_chain_graph(), _chain_graph(True), _chain_graph(False, True)):
        assert build_network(extract_tasks(graph)).check().passed


def test_reshape_is_a_view_and_groups_run_in_dependency_order():
    g = GraphBuilder("order")
    x = g.input("x", (2, 3, 4, 4))
    a = g.add("relu", [x], name="a")
    flat = g.add("reshape", [a], name="flat", shape=(2, 48))
    d = g.add("dense", [flat, g.constant(np.ones((5, 48), np.float32))], name="d")
    late = g.add("global_avg_pool2d", [x], name="late")
    late_flat = g.add("reshape", [late], name="late_flat", shape=(2, 3))      # a graph output that is a view
    graph = g.build([g.add("sigmoid", [d], name="s"), late_flat])
    net = extract_tasks(graph)
    assert net.aliases == {"flat": "a", "late_flat": "late"}
    assert net.node_group["flat"] is None and net.node_group["late_flat"] is None
    order = [grp.nodes[0] for grp in net.groups]
    assert order.index("a") < order.index("d")
    assert net.groups[order.index("d")].inputs[0] == "flat"
    assert build_network(net).check().passed


def test_simplify_folds_constant_subgraphs_and_standalone_batch_norm():
    g = GraphBuilder("fold")
    x = g.input("x", (1, 3, 4, 4))
    w = g.add("transpose", [g.constant(np.ones((3, 1), np.float32))], perm=(1, 0))   # constant: folded
    y = g.add("relu", [x])
    stats = [g.constant(np.full(3, v, np.float32)) for v in (2.0, 0.5, 0.1, 4.0)]
    y = g.add("batch_norm", [y] + stats)
    y = g.add("mul", [y, g.add("reshape", [w], shape=(1, 3, 1, 1))])
    graph = g.build([y])
    simple = simplify_for_inference(graph)
    assert [n.op for n in simple.nodes] == ["relu", "mul", "add", "mul"]
    net = extract_tasks(graph)
    assert [t.name for t in net.tasks] == ["relu_mul_add_mul"]
    assert net.node_group["transpose"] is None and net.node_group["reshape"] is None
    assert build_network(net).check().passed


def test_unsupported_axis_fails_at_the_node():
    g = GraphBuilder("sm")
    x = g.input("x", (2, 5, 3))
    graph = g.build([g.add("softmax", [x], name="probs", axis=1)])
    with pytest.raises(ExtractError, match=r"node 'probs' \(softmax\): softmax over axis 1 of a rank-3 tensor"):
        extract_tasks(graph)


def test_erf_gelu_is_recognised():
    g = GraphBuilder("gelu")
    x = g.input("x", (4, 16))
    h = g.add("matmul", [x, g.constant(np.ones((16, 8), np.float32) / 16)], name="mm")
    d = g.add("div", [h, g.constant(np.array(1.4142135, np.float32))], name="d")
    e = g.add("erf", [d], name="e")
    a = g.add("add", [g.constant(np.array(1.0, np.float32)), e], name="a")
    m = g.add("mul", [h, a], name="m")
    y = g.add("mul", [m, g.constant(np.array(0.5, np.float32))], name="y")
    graph = g.build([y])
    net = extract_tasks(graph)
    assert [n.op for n in net.graph.nodes] == ["matmul", "gelu"]
    assert [t.name for t in net.tasks] == ["matmul_gelu"]
    assert {net.node_group[k] for k in ("mm", "d", "e", "a", "m", "y")} == {0}
    assert build_network(net).check().passed
    # not rewritten when an intermediate value is needed elsewhere
    g2 = GraphBuilder("gelu2")
    x = g2.input("x", (4, 8))
    d = g2.add("div", [x, g2.constant(np.array(1.4142135, np.float32))], name="d")
    e = g2.add("erf", [d], name="e")
    a = g2.add("add", [e, g2.constant(np.array(1.0, np.float32))], name="a")
    y = g2.add("mul", [g2.add("mul", [x, a], name="m"), g2.constant(np.array(0.5, np.float32))], name="y")
    assert "erf" in [n.op for n in extract_tasks(g2.build([y, e])).graph.nodes]
