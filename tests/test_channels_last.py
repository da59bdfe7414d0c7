"""The NHWC rewrite (tasks.channels_last): same outputs under the same names, transposes only where
layouts change, and the compiled NHWC networks equal the NCHW reference."""
from __future__ import annotations

import numpy as np
import pytest

from tensortune.codegen.network_runtime import build_network
from tensortune.schedule.default_schedule import default_schedule
from tensortune.tasks.channels_last import to_channels_last
from tensortune.tasks.extract import extract_tasks, simplify_for_inference, winograd_eligible
from tensortune.tasks.graph import GraphBuilder
from tensortune.tasks.models import make_network
from tensortune.tasks.reference import mismatch

RNG = np.random.default_rng(11)


def _w(*shape) -> np.ndarray:
    return RNG.uniform(-1, 1, size=shape).astype(np.float32)


@pytest.mark.parametrize("name", ["resnet-18", "mobilenet-v2"])
def test_cnn_runs_nhwc_between_one_transpose_in_and_the_pooled_view_out(name):
    graph = simplify_for_inference(make_network(name, image_size=32))
    nhwc = to_channels_last(graph)
    ops = [n.op for n in nhwc.nodes]
    assert "conv2d" not in ops and ops.count("conv2d_nhwc") == [n.op for n in graph.nodes].count("conv2d")
    assert ops.count("transpose") == 1 and nhwc.nodes[0].op == "transpose"       # the image, once
    # the global pool's [1, 1, 1, C] is [1, C, 1, 1] in memory: a view, not a copy
    assert "global_avg_pool2d_nhwc" in ops and ops.count("reshape") == [n.op for n in graph.nodes].count("reshape") + 1
    assert nhwc.outputs == graph.outputs
    inputs = graph.random_inputs(1)
    want, got = graph.run_reference(inputs), nhwc.run_reference(inputs)
    for out in graph.outputs:
        np.testing.assert_allclose(got[out], want[out], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["resnet-18", "mobilenet-v2"])
def test_compiled_nhwc_network_equals_the_nchw_reference(name):
    graph = make_network(name, image_size=32)
    net = extract_tasks(graph)
    assert any(t.name.startswith("conv2d_nhwc") for t in net.tasks)
    assert any(t.name.startswith("depthwise_conv2d_nhwc") for t in net.tasks) == (name == "mobilenet-v2")
    result = build_network(net).check()
    assert result.passed, result


def _mixed_graph():
    """A conv whose NHWC output feeds a per-channel scale (a [C, 1, 1] constant), an activation of
    the source layout (added after its own transpose), an avg pool with ONNX's exclusive count, and
    a softmax, which has no NHWC form (so the value goes back to NCHW, under its own name)."""
    g = GraphBuilder("mixed")
    x = g.input("x", (1, 5, 9, 8))
    skip = g.input("skip", (1, 6, 9, 8))
    y = g.add("conv2d", [x, g.constant(_w(6, 5, 3, 3)), g.constant(_w(6))], pads=(1, 0, 1, 2), name="conv")
    y = g.add("mul", [y, g.constant(_w(6, 1, 1))], name="scale")
    y = g.add("add", [y, skip], name="residual")
    y = g.add("relu", [y], name="relu")
    pooled = g.add("avg_pool2d", [y], kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1), name="pool")
    soft = g.add("softmax", [y], axis=-1, name="softmax")
    return g.build([pooled, soft, y])


def test_mixed_layouts_transpose_once_per_value_and_keep_output_names():
    graph = _mixed_graph()
    nhwc = to_channels_last(graph)
    by_name = {n.name: n for n in nhwc.nodes}
    assert by_name["conv"].op == "conv2d_nhwc" and by_name["pool"].op == "avg_pool2d_nhwc"
    assert by_name["scale"].inputs[0] == by_name["conv"].output and nhwc.values[by_name["scale"].inputs[1]].shape \
        == (1, 1, 1, 6)
    assert by_name["softmax"].op == "softmax" and by_name["softmax"].inputs == ("relu",)
    transposes = [n for n in nhwc.nodes if n.op == "transpose"]
    # x and skip in, relu back (read by softmax and a graph output), pool's output back
    assert sorted(n.inputs[0] for n in transposes) == sorted(["x", "skip", by_name["relu"].output,
                                                              by_name["pool"].output])
    inputs = graph.random_inputs(2)
    want, got = graph.run_reference(inputs), nhwc.run_reference(inputs)
    assert list(got) == list(want)
    for out in graph.outputs:
        np.testing.assert_allclose(got[out], want[out], rtol=1e-5, atol=1e-6)
    net = extract_tasks(graph)
    compiled = build_network(net)
    outs = compiled.run(inputs)
    for out in graph.outputs:
        bad = mismatch(outs[out], want[out].astype(np.float32))
        assert bad is None, f"{out}: {bad}"


def test_grouped_convs_and_runtime_weights_stay_nchw():
    g = GraphBuilder("grouped")
    x = g.input("x", (1, 8, 6, 6))
    w = g.input("w", (8, 8, 1, 1))
    y = g.add("conv2d", [x, g.constant(_w(8, 4, 3, 3))], pads=(1, 1, 1, 1), groups=2, name="grouped")
    y = g.add("conv2d", [y, w], name="runtime_weight")
    graph = g.build([y])
    assert to_channels_last(graph) is graph


def test_winograd_forms_of_nhwc_convs_are_nhwc_and_equal_the_reference():
    graph = make_network("resnet-18", image_size=32)
    net = extract_tasks(graph, winograd_tiles=(2, 4))
    assert "conv2d" not in {n.op for n in net.graph.nodes}
    forms = {net.tasks[a.task].name for g in net.groups for a in g.alternatives}
    assert forms and all(f.startswith(("conv2d_winograd_f2_nhwc", "conv2d_winograd_f4_nhwc")) for f in forms)
    eligible = [n for n in net.graph.nodes if winograd_eligible(net.graph, n)]
    assert len(eligible) == sum(1 for g in net.groups if g.alternatives) > 0
    for position in (1, 2):           # every group runs its F(2) form, then every group its F(4) form
        costs = {t.workload_key: 1.0 for t in net.tasks}
        for g in net.groups:
            for a in g.alternatives[position - 1:position]:
                costs[net.tasks[a.task].workload_key] = 0.5
        records = {t.workload_key: default_schedule(t.dag).steps_json() for t in net.tasks}
        resolved = net.resolve_forms(records, costs)
        assert sum(t.name.startswith("conv2d_winograd") for t in resolved.tasks) > 0
        result = build_network(resolved, records).check()
        assert result.passed, result


def test_channels_last_false_keeps_the_source_layout():
    graph = make_network("resnet-18", image_size=32)
    net = extract_tasks(graph, channels_last=False)
    assert not any(n.op.endswith("_nhwc") or n.op == "transpose" for n in net.graph.nodes)


def test_an_exporters_global_pool_reduces_the_nhwc_axes():
    """torch.onnx writes the global pool as ReduceMean over (2, 3) with keepdims: it stays NHWC."""
    g = GraphBuilder("reduce")
    x = g.input("x", (1, 4, 5, 6))
    y = g.add("conv2d", [x, g.constant(_w(8, 4, 1, 1))], name="conv")
    y = g.add("reduce_mean", [y], axes=(2, 3), keepdims=True, name="pool")
    y = g.add("reduce_max", [y], axes=(1,), keepdims=True, name="channel_max")
    graph = g.build([y])
    nhwc = to_channels_last(graph)
    by_name = {n.name: n for n in nhwc.nodes}
    assert by_name["pool"].attrs["axes"] == (1, 2) and by_name["channel_max"].attrs["axes"] == (3,)
    assert [n.op for n in nhwc.nodes].count("transpose") == 1     # x in; the [1, 1, 1, 1] out is a view
    inputs = graph.random_inputs(0)
    np.testing.assert_allclose(nhwc.run_reference(inputs)[y], graph.run_reference(inputs)[y], rtol=1e-6)
    assert build_network(extract_tasks(graph)).check().passed
