"""ONNX import: models made here with onnx.helper (and exported from PyTorch where it is installed)
import, agree with onnx's own reference evaluator, compile and run end to end; bad input fails with a
message that names the file, op or node."""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from tensortune.codegen.network_runtime import build_network
from tensortune.tasks.extract import extract_tasks
from tensortune.tasks.onnx_import import OnnxImportError, import_onnx

RNG = np.random.default_rng(11)


def _init(name: str, *shape, scale: float = 0.5, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(dtype), name)


def _const(name: str, value, dtype=np.int64) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _model(nodes, inputs, outputs, inits, opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 8)
    return onnx.shape_inference.infer_shapes(model)


def _vi(name: str, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def cnn_model() -> onnx.ModelProto:
    """Conv (SAME_UPPER, stride 2) + BN + Relu, MaxPool, grouped conv with asymmetric pads, residual,
    global pool, Flatten, Gemm, Softmax."""
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "w1", "b1"], ["c1"], auto_pad="SAME_UPPER", strides=[2, 2], kernel_shape=[3, 3]),
        n("BatchNormalization", ["c1", "g", "beta", "mean", "var"], ["bn"], epsilon=1e-3),
        n("Relu", ["bn"], ["r1"]),
        n("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1]),
        n("Conv", ["p1", "w2"], ["c2"], group=2, pads=[1, 0, 1, 2], kernel_shape=[3, 3]),
        n("Slice", ["c2", "s_start", "s_end", "s_axes"], ["c2s"]),
        n("Add", ["c2s", "p1"], ["res"]),
        n("GlobalAveragePool", ["res"], ["gp"]),
        n("Flatten", ["gp"], ["flat"], axis=1),
        n("Gemm", ["flat", "wfc", "bfc"], ["fc"], transB=1, alpha=0.5),
        n("Softmax", ["fc"], ["y"], axis=-1),
    ]
    inits = [_init("w1", 8, 3, 3, 3), _init("b1", 8),
             numpy_helper.from_array(RNG.uniform(0.5, 1.5, 8).astype(np.float32), "g"),
             _init("beta", 8), _init("mean", 8), numpy_helper.from_array(RNG.uniform(0.5, 1.5, 8).astype(np.float32),
                                                                         "var"),
             _init("w2", 8, 4, 3, 3), _const("s_start", [0]), _const("s_end", [5]), _const("s_axes", [3]),
             _init("wfc", 5, 8), _init("bfc", 5)]
    # opset 15: onnx's reference evaluator runs opset-9..13 BatchNormalization with its default momentum,
    # i.e. in training mode; from opset 14 on it honours training_mode=0
    return _model(nodes, [_vi("x", [2, 3, 10, 10])], [_vi("y", [2, 5])], inits, 15)


def attention_model(opset: int = 17) -> onnx.ModelProto:
    """Embedding Gather, MatMul with 2-D weights, Reshape (0 and -1) computed from Shape, Transpose,
    batched MatMul, scaling, Softmax, LayerNormalization, Erf-GELU, Slice/Squeeze of [CLS], Concat, Clip."""
    n = helper.make_node
    h, heads, s = 8, 2, 6
    nodes = [
        n("Gather", ["emb", "ids"], ["e"], axis=0),
        n("MatMul", ["e", "wq"], ["q0"]), n("Add", ["q0", "bq"], ["q"]),
        n("Shape", ["q"], ["qshape"]),
        n("Gather", ["qshape", "zero"], ["batch"], axis=0),
        n("Unsqueeze", ["batch", "axes0"], ["batch1"]),
        n("Concat", ["batch1", "tail"], ["newshape"], axis=0),
        n("Reshape", ["q", "newshape"], ["q4"]),
        n("Transpose", ["q4"], ["qt"], perm=[0, 2, 1, 3]),
        n("Transpose", ["q4"], ["kt"], perm=[0, 2, 3, 1]),
        n("MatMul", ["qt", "kt"], ["sc0"]),
        n("Div", ["sc0", "sqrt_d"], ["sc"]),
        n("Softmax", ["sc"], ["p"], axis=-1),
        n("MatMul", ["p", "qt"], ["ctx0"]),
        n("Transpose", ["ctx0"], ["ctx1"], perm=[0, 2, 1, 3]),
        n("Reshape", ["ctx1", "shape3"], ["ctx"]),
        n("Add", ["ctx", "e"], ["res"]),
        n("LayerNormalization", ["res", "lng", "lnb"], ["ln"], axis=-1, epsilon=1e-5),
        n("Div", ["ln", "sqrt2"], ["g0"]), n("Erf", ["g0"], ["g1"]), n("Add", ["g1", "one"], ["g2"]),
        n("Mul", ["ln", "g2"], ["g3"]), n("Mul", ["g3", "half"], ["gelu"]),
        n("Slice", ["gelu", "cls_start", "cls_end", "cls_axes"], ["cls3"]),
        n("Squeeze", ["cls3", "cls_axes"], ["cls"]),
        n("Concat", ["cls", "cls"], ["cat"], axis=1),
        n("Clip", ["cat", "lo", "hi"], ["y2"]),
        n("Identity", ["gelu"], ["y1"]),
    ]
    inits = [_init("emb", 20, h), _init("wq", h, h), _init("bq", h), _const("zero", 0), _const("axes0", [0]),
             _const("tail", [0, heads, -1]), _const("shape3", [2, s, h]),
             numpy_helper.from_array(np.array(np.sqrt(h // heads), np.float32), "sqrt_d"),
             _init("lng", h), _init("lnb", h), numpy_helper.from_array(np.array(1.4142135, np.float32), "sqrt2"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half"),
             _const("cls_start", [0]), _const("cls_end", [1]), _const("cls_axes", [1]),
             numpy_helper.from_array(np.array(-0.2, np.float32), "lo"),
             numpy_helper.from_array(np.array(0.3, np.float32), "hi")]
    return _model(nodes, [_vi("ids", [2, s], TensorProto.INT64)], [_vi("y1", [2, s, h]), _vi("y2", [2, 2 * h])],
                  inits, opset)


def generator_model() -> onnx.ModelProto:
    """ConvTranspose (pads, output_padding), Sigmoid, exclusive AveragePool, Tanh, Pow, Sqrt."""
    n = helper.make_node
    nodes = [
        n("ConvTranspose", ["z", "wt", "bt"], ["up"], strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]),
        n("Sigmoid", ["up"], ["sg"]),
        n("AveragePool", ["sg"], ["ap"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1]),
        n("Pow", ["ap", "two"], ["sq"]), n("Sqrt", ["sq"], ["ab"]), n("Tanh", ["ab"], ["y"]),
    ]
    inits = [_init("wt", 4, 3, 3, 3), _init("bt", 3), numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    return _model(nodes, [_vi("z", [1, 4, 5, 5])], [_vi("y", [1, 3, 10, 10])], inits, 13)


def old_opset_model() -> onnx.ModelProto:
    """Opset 10 forms: Clip min/max attributes, Unsqueeze axes attribute, Softmax's flatten-at-axis
    (onnx's reference evaluator applies the opset-13 meaning to every opset, so the test checks this
    one by hand)."""
    n = helper.make_node
    nodes = [n("Clip", ["x"], ["c"], min=-0.5, max=0.5), n("Unsqueeze", ["c"], ["u"], axes=[1]),
             n("Softmax", ["u"], ["y"], axis=2)]
    return _model(nodes, [_vi("x", [2, 3, 4])], [_vi("y", [2, 1, 3, 4])], [], 10)


MODELS = {"cnn": cnn_model, "attention": attention_model, "generator": generator_model, "old_opset": old_opset_model}


def _feeds(graph) -> dict[str, np.ndarray]:
    return graph.random_inputs(5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_import_agrees_with_onnx_reference_and_runs_compiled(name):
    model = MODELS[name]()
    graph = import_onnx(model.SerializeToString())
    feeds = _feeds(graph)
    if name == "old_opset":                      # softmax over the flattened trailing axes (2 and 3)
        u = np.clip(feeds["x"].astype(np.float64), -0.5, 0.5).reshape(2, 12)
        e = np.exp(u - u.max(axis=1, keepdims=True))
        expected = [(e / e.sum(axis=1, keepdims=True)).reshape(2, 1, 3, 4)]
    else:
        expected = ReferenceEvaluator(model).run(None, feeds)
    ours = graph.run_reference(feeds)
    for out, want in zip(model.graph.output, expected):
        np.testing.assert_allclose(ours[out.name], want, rtol=1e-4, atol=1e-5, err_msg=f"{name}: {out.name}")
    net = extract_tasks(graph)
    if name == "attention":                       # the erf form of GELU became one op
        assert "gelu" in [n.op for n in net.graph.nodes] and "erf" not in [n.op for n in net.graph.nodes]
    result = build_network(net).check(feeds)
    assert result.passed, f"{name}: {result}"


def test_import_from_file_names_and_weights(tmp_path):
    path = tmp_path / "cnn.onnx"
    onnx.save(cnn_model(), str(path))
    graph = import_onnx(path)
    assert list(graph.inputs) == ["x"] and graph.outputs == ["y"]
    assert "w1" in graph.constants and graph.constants["w1"].shape == (8, 3, 3, 3)
    ops = graph.op_counts()
    assert ops["conv2d"] == 2 and ops["batch_norm"] == 1 and ops["dense"] == 1
    net = extract_tasks(graph)
    # BatchNorm folded into the conv (NHWC after the image's transpose, tasks.channels_last)
    assert [t.name for t in net.tasks][:3] == ["transpose", "conv2d_nhwc_bias_relu", "max_pool2d_nhwc"]


def test_symbolic_dimensions_need_input_shapes():
    model = cnn_model()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    with pytest.raises(OnnxImportError, match=r"graph input 'x' has a symbolic dimension 'batch' \(axis 0\); pass "
                                              r"concrete sizes: input_shapes=\{'x': \(...\)\}, or --input-shape x=D0"):
        import_onnx(model)
    model.graph.ClearField("value_info")
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    graph = import_onnx(model, input_shapes={"x": (3, 3, 10, 10)})
    assert graph.values["y"].shape == (3, 5)
    with pytest.raises(OnnxImportError, match=r"input shapes given for \['nope'\], which are not graph inputs"):
        import_onnx(model, input_shapes={"x": (3, 3, 10, 10), "nope": (1,)})


# ------------------------------------------------------------------------------------ bad input

def test_missing_empty_and_garbage_files(tmp_path):
    with pytest.raises(OnnxImportError, match=r"no_such\.onnx: no such file"):
        import_onnx(tmp_path / "no_such.onnx")
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(OnnxImportError, match=r"empty\.onnx: the file is empty"):
        import_onnx(empty)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff\xfe this is not a protobuf \x00\x01" * 10)
    with pytest.raises(OnnxImportError, match=r"junk\.onnx: (not a valid ONNX model|the model has no graph|invalid)"):
        import_onnx(junk)
    good = cnn_model().SerializeToString()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(good[: len(good) // 3])
    with pytest.raises(OnnxImportError, match=r"truncated\.onnx: "):
        import_onnx(truncated)
    with pytest.raises(OnnxImportError, match="cannot import a int"):
        import_onnx(42)


def _one_node(node, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph([node], "bad", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_unsupported_op_names_op_and_node():
    model = _one_node(helper.make_node("Resize", ["x", "", "scales"], ["y"], name="upsample_1"),
                      [_vi("x", [1, 1, 4, 4])], [_vi("y", [1, 1, 8, 8])],
                      [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")])
    with pytest.raises(OnnxImportError, match=r"node upsample_1 \(Resize\): unsupported op 'Resize'; supported ops: "
                                              r"Abs, Add"):
        import_onnx(model)


def test_unsupported_forms_fail_clearly():
    cases = [
        (_one_node(helper.make_node("MaxPool", ["x"], ["y", "idx"], kernel_shape=[2, 2], name="mp"),
                   [_vi("x", [1, 1, 4, 4])], [_vi("y", [1, 1, 3, 3]), _vi("idx", [1, 1, 3, 3], TensorProto.INT64)]),
         r"node mp \(MaxPool\): its extra output\(s\) \['idx'\] are used"),
        (_one_node(helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], ceil_mode=1, name="mp"),
                   [_vi("x", [1, 1, 5, 5])], [_vi("y", [1, 1, 3, 3])]), r"ceil_mode=1 is not supported"),
        (_one_node(helper.make_node("Conv", ["x", "w"], ["y"], name="c4d"), [_vi("x", [1, 2, 4, 4, 4, 4])],
                   [_vi("y", [1, 2, 2, 2, 2, 2])], [_init("w", 2, 2, 3, 3, 3, 3)]),
         r"node c4d \(Conv\): only 1-D, 2-D and 3-D spatial ops"),
        (_one_node(helper.make_node("Cast", ["x"], ["y"], to=TensorProto.INT32, name="cast"), [_vi("x", [2, 2])],
                   [_vi("y", [2, 2], TensorProto.INT32)]), r"casting a run-time tensor from float32 to int32"),
        (_one_node(helper.make_node("Pad", ["x", "p"], ["y"], mode="wrap", name="pw"), [_vi("x", [2, 2])],
                   [_vi("y", [2, 4])], [_const("p", [0, 1, 0, 1])], opset=19), r"mode 'wrap' is not supported"),
        (_one_node(helper.make_node("Reshape", ["x", "s"], ["y"], name="r"), [_vi("x", [2, 3])], [_vi("y", [5])],
                   [_const("s", [5])]), r"node r \(Reshape\): cannot reshape \[2, 3\] \(6 elements\) to \[5\]"),
    ]
    for model, match in cases:
        with pytest.raises(OnnxImportError, match=match):
            import_onnx(model)


def test_custom_domain_and_invalid_models():
    node = helper.make_node("FusedGemm", ["x"], ["y"], domain="com.microsoft", name="fg")
    graph = helper.make_graph([node], "bad", [_vi("x", [2, 2])], [_vi("y", [2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(OnnxImportError, match=r"node fg \(FusedGemm\): unsupported op com\.microsoft\.FusedGemm"):
        import_onnx(model)
    undefined = _one_node(helper.make_node("Relu", ["nowhere"], ["y"]), [_vi("x", [2])], [_vi("y", [2])])
    with pytest.raises(OnnxImportError, match=r"invalid ONNX model: .*nowhere"):
        import_onnx(undefined)


# ------------------------------------------------------------------------------------ PyTorch exports

def _torch_models():
    import torch  # in the test extra: these checks against an independent framework must run, not skip
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + x)

    class TinyResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
            self.block, self.fc = Block(8), nn.Linear(8, 10)

        def forward(self, x):
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.block(self.stem(x)), 1), 1))

    class TinyBert(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 32)
            self.pos = nn.Parameter(torch.randn(8, 32) * 0.02)
            self.enc = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu", batch_first=True)
            self.pool = nn.Linear(32, 32)

        def forward(self, ids):
            h = self.enc(self.emb(ids) + self.pos)
            return h, torch.tanh(self.pool(h[:, 0]))

    mobile = nn.Sequential(nn.Conv2d(4, 24, 1), nn.BatchNorm2d(24), nn.ReLU6(),
                           nn.Conv2d(24, 24, 3, 2, 1, groups=24), nn.BatchNorm2d(24), nn.ReLU6(), nn.Conv2d(24, 8, 1),
                           nn.AvgPool2d(3, 1, 1, count_include_pad=False), nn.Sigmoid())
    gen = nn.Sequential(nn.ConvTranspose2d(16, 32, 4, 1, 0, bias=False), nn.BatchNorm2d(32), nn.ReLU(True),
                        nn.ConvTranspose2d(32, 3, 4, 2, 1, bias=False), nn.Tanh())
    torch.manual_seed(0)
    return torch, {"resnet": (TinyResNet(), torch.randn(2, 3, 32, 32)),
                   "mobilenet": (mobile, torch.randn(1, 4, 16, 16)),
                   "dcgan": (gen, torch.randn(2, 16, 1, 1)), "bert": (TinyBert(), torch.randint(0, 50, (2, 8)))}


@pytest.mark.parametrize("name", ["resnet", "mobilenet", "dcgan", "bert"])
@pytest.mark.parametrize("opset", [14, 17])
def test_pytorch_export_imports_and_runs(name, opset):
    torch, models = _torch_models()
    module, example = models[name]
    module.eval()
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.BatchNorm2d):      # trained-looking statistics, so folding matters
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
        expected = module(example)
    expected = expected if isinstance(expected, tuple) else (expected,)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (example,), buf, dynamo=False, opset_version=opset,
                          do_constant_folding=opset == 17)
    graph = import_onnx(buf.getvalue())
    feeds = {next(iter(graph.inputs)): example.numpy()}
    ours = graph.run_reference(feeds)
    for out, want in zip(graph.outputs, expected):
        np.testing.assert_allclose(ours[out], want.numpy(), rtol=1e-4, atol=1e-5)
    net = extract_tasks(graph)
    if name == "bert":                            # the exported erf-GELU fuses into the FFN matmul
        assert "matmul_add_gelu" in [t.name for t in net.tasks]
    result = build_network(net).check(feeds)
    assert result.passed, f"{name} opset {opset}: {result}"
