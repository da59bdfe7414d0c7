"""bench network's per-task comparison with ONNX Runtime (a test dependency): ORT's own per-node
profile, each node given to the task whose kernel computes it. ORT renames the nodes it rewrites for its
NCHWc kernels (after the tensor they write), so a real session is profiled here: a lookup by ONNX node
name alone would find none of the convs, and the table would show no conv at all."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.network import layer_breakdown, layer_rows
from tensortune.codegen.network_runtime import build_network
from tensortune.flows.tuning import network_tasks
from tensortune.tasks.onnx_import import import_onnx


def _two_block_net(path: str) -> str:
    """conv+relu, conv, add, relu, global pool, gemm: named nodes, as torch.onnx names them."""
    rng = np.random.default_rng(0)

    def const(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.1, name)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="node_conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="node_relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="node_conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["a2"], name="node_add2"),
        helper.make_node("Relu", ["a2"], ["r2"], name="node_relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="node_pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="node_flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], name="node_linear", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "two_blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 28, 28])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [const("w1", 32, 16, 3, 3), const("b1", 32), const("w2", 32, 32, 3, 3), const("b2", 32),
         const("wf", 10, 32), const("bf", 10)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


def test_each_task_gets_its_time_in_our_network_and_its_nodes_time_in_orts_profile(tmp_path):
    path = _two_block_net(str(tmp_path / "net.onnx"))
    graph = import_onnx(path, name="two_blocks")
    net, tasks = network_tasks(graph, "llvm -num-threads=2")
    compiled = build_network(net, None, "llvm -num-threads=2")
    layers = layer_breakdown(compiled, path, 2, graph.random_inputs(0), net, tasks, blocks=2, passes=3)
    assert len(layers.ours_ms) == len(layers.ort_ms) == len(tasks)
    assert all(ms is not None and ms > 0 for ms in layers.ours_ms), layers.ours_ms
    theirs = dict(zip([t.name for t in tasks], layers.ort_ms))
    # our NCHW -> NHWC transpose has no ORT node of its own (ORT reorders to NCHWc instead: unmapped)
    assert sorted(theirs) == ["conv2d_nhwc_bias_add_relu", "conv2d_nhwc_bias_relu", "dense_bias",
                              "global_avg_pool2d_nhwc", "transpose"]
    assert theirs.pop("transpose") == 0.0
    assert all(ms is not None and ms > 0 for ms in theirs.values()), theirs
    assert layers.ort_unmapped_ms > 0
    # ORT's profile files go beside the model, not into the working folder
    assert list(tmp_path.glob("ort-profile*.json"))


def test_the_layer_table_puts_the_most_time_lost_first_and_skips_tasks_orts_profile_lacks():
    row = {"task_labels": ["a", "b", "c", "d"], "task_weights": [1, 3, 1, 2],
           "task_in_network_ms": [1.0, 0.5, None, 0.2], "task_ort_ms": [0.5, 0.4, 1.0, None]}
    table = layer_rows(row)
    assert [r["task"] for r in table] == ["a", "b"]
    assert table[0]["lost_ms_per_run"] == pytest.approx(0.5) and table[1]["lost_ms_per_run"] == pytest.approx(0.3)
    assert table[1]["ours_over_ort"] == pytest.approx(1.25)
