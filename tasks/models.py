"""Model builders: the networks of the Ansor paper's end-to-end benchmark as Graphs with random weights.

Weights are drawn from a seed (deterministic), scaled the way their layers are initialised for
training (He for convolutions, 0.02 for BERT) so activations stay in a sensible range through deep
networks. BatchNorm is folded into the preceding convolution's weights and bias at build time, as
inference compilers do. Every builder takes `batch_size`; sizes (image size, widths, sequence length,
layer count) are arguments so tests can run small versions of the same architecture.
"""
from __future__ import annotations

import inspect
import math
import os
from typing import Callable

import numpy as np

from tensortune.tasks.graph import Graph, GraphBuilder
from tensortune.tasks.graph_ops import GraphError
from tensortune.tasks.onnx_import import import_onnx


class _Weights:
    """Deterministic random parameters: one generator per network, drawn in build order."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def normal(self, shape, std: float) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def uniform(self, shape, lo: float, hi: float) -> np.ndarray:
        return self.rng.uniform(lo, hi, size=shape).astype(np.float32)

    def batch_norm(self, channels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(gamma, beta, running mean, running var) of a trained-looking BatchNorm."""
        return (self.uniform(channels, 0.5, 1.5), self.normal(channels, 0.1), self.normal(channels, 0.1),
                self.uniform(channels, 0.5, 1.5))


def fold_batch_norm(weight: np.ndarray, bias: np.ndarray | None, gamma: np.ndarray, beta: np.ndarray,
                    mean: np.ndarray, var: np.ndarray, eps: float = 1e-5, out_axis: int = 0):
    """Fold y = BN(conv(x, w) + b) into conv(x, w') + b' (out_axis: 0 for OIHW, 1 for IOHW weights)."""
    scale = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + eps)
    shape = [1] * weight.ndim
    shape[out_axis] = -1
    w = (weight.astype(np.float64) * scale.reshape(shape)).astype(np.float32)
    b0 = np.zeros_like(scale) if bias is None else bias.astype(np.float64)
    return w, ((b0 - mean) * scale + beta).astype(np.float32)


def _conv_bn(g: GraphBuilder, w: _Weights, x: str, out_ch: int, k: int, stride: int = 1, groups: int = 1,
             act: str | None = "relu", name: str = "conv", gamma_scale: float = 1.0) -> str:
    """conv (no bias) + BatchNorm (folded) + optional activation ("relu" or "relu6").

    `gamma_scale` shrinks the BatchNorm scale of a residual branch's last conv, as trained ResNets have
    it (and as `zero_init_residual` starts them), so activations do not double at every block."""
    in_ch = g.shape(x)[1]
    fan_in = in_ch // groups * k * k
    gamma, beta, mean, var = w.batch_norm(out_ch)
    weight, bias = fold_batch_norm(w.normal((out_ch, in_ch // groups, k, k), math.sqrt(2.0 / fan_in)), None,
                                   gamma * np.float32(gamma_scale), beta, mean, var)
    p = k // 2
    y = g.add("conv2d", [x, g.constant(weight, f"{name}.weight"), g.constant(bias, f"{name}.bias")], name=name,
              strides=(stride, stride), pads=(p, p, p, p), groups=groups)
    if act == "relu":
        y = g.add("relu", [y], name=f"{name}.relu")
    elif act == "relu6":
        y = g.add("clip", [y], name=f"{name}.relu6", min=0.0, max=6.0)
    return y


def _classifier(g: GraphBuilder, w: _Weights, x: str, num_classes: int) -> str:
    n, c = g.shape(x)[:2]
    x = g.add("global_avg_pool2d", [x], name="avgpool")
    x = g.add("reshape", [x], name="flatten", shape=(n, c))
    bound = 1.0 / math.sqrt(c)
    return g.add("dense", [x, g.constant(w.uniform((num_classes, c), -bound, bound), "fc.weight"),
                           g.constant(w.uniform(num_classes, -bound, bound), "fc.bias")], name="fc")


# ----------------------------------------------------------------------------------------- ResNet

def resnet(num_layers: int = 50, batch_size: int = 1, image_size: int = 224, base_width: int = 64,
           num_classes: int = 1000, seed: int = 0) -> Graph:
    """ResNet-18/34 (basic blocks) or -50/101/152 (bottlenecks, stride on the 3x3 conv, torchvision v1.5)."""
    blocks = {18: ("basic", [2, 2, 2, 2]), 34: ("basic", [3, 4, 6, 3]), 50: ("bottleneck", [3, 4, 6, 3]),
              101: ("bottleneck", [3, 4, 23, 3]), 152: ("bottleneck", [3, 8, 36, 3])}
    if num_layers not in blocks:
        raise ValueError(f"resnet: num_layers must be one of {sorted(blocks)}, got {num_layers}")
    _check_sizes("resnet", batch_size=batch_size, image_size=image_size, base_width=base_width,
                 num_classes=num_classes)
    if image_size < 32:
        raise ValueError(f"resnet: image_size must be at least 32 (the network downsamples 32x), got {image_size}")
    kind, counts = blocks[num_layers]
    expansion = 4 if kind == "bottleneck" else 1
    g, w = GraphBuilder(f"resnet-{num_layers}"), _Weights(seed)
    x = g.input("data", (batch_size, 3, image_size, image_size))
    x = _conv_bn(g, w, x, base_width, 7, 2, name="conv1")
    x = g.add("max_pool2d", [x], name="maxpool", kernel=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1))
    for stage, count in enumerate(counts):
        width = base_width * 2 ** stage
        for b in range(count):
            stride = 2 if stage > 0 and b == 0 else 1
            pre = f"layer{stage + 1}.{b}"
            in_ch = g.shape(x)[1]
            if kind == "basic":
                y = _conv_bn(g, w, x, width, 3, stride, name=f"{pre}.conv1")
                y = _conv_bn(g, w, y, width, 3, 1, act=None, name=f"{pre}.conv2", gamma_scale=0.2)
            else:
                y = _conv_bn(g, w, x, width, 1, 1, name=f"{pre}.conv1")
                y = _conv_bn(g, w, y, width, 3, stride, name=f"{pre}.conv2")
                y = _conv_bn(g, w, y, width * expansion, 1, 1, act=None, name=f"{pre}.conv3", gamma_scale=0.2)
            short = x
            if stride != 1 or in_ch != width * expansion:
                short = _conv_bn(g, w, x, width * expansion, 1, stride, act=None, name=f"{pre}.downsample")
            x = g.add("relu", [g.add("add", [y, short], name=f"{pre}.add")], name=f"{pre}.relu")
    return g.build([_classifier(g, w, x, num_classes)])


def resnet18(batch_size: int = 1, image_size: int = 224, base_width: int = 64, num_classes: int = 1000,
             seed: int = 0) -> Graph:
    return resnet(18, batch_size, image_size, base_width, num_classes, seed)


def resnet50(batch_size: int = 1, image_size: int = 224, base_width: int = 64, num_classes: int = 1000,
             seed: int = 0) -> Graph:
    return resnet(50, batch_size, image_size, base_width, num_classes, seed)


# ----------------------------------------------------------------------------------------- MobileNet-V2

def _make_divisible(v: float, divisor: int = 8) -> int:
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def mobilenet_v2(batch_size: int = 1, image_size: int = 224, width_mult: float = 1.0, num_classes: int = 1000,
                 seed: int = 0) -> Graph:
    """MobileNet-V2 (Sandler et al. 2018): inverted residual blocks with ReLU6 and linear bottlenecks."""
    _check_sizes("mobilenet_v2", batch_size=batch_size, image_size=image_size, num_classes=num_classes)
    if image_size < 32 or width_mult <= 0:
        raise ValueError(f"mobilenet_v2: need image_size >= 32 and width_mult > 0, got {image_size}, {width_mult}")
    settings = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1)]
    g, w = GraphBuilder("mobilenet-v2"), _Weights(seed)
    x = g.input("data", (batch_size, 3, image_size, image_size))
    x = _conv_bn(g, w, x, _make_divisible(32 * width_mult), 3, 2, act="relu6", name="features.0")
    idx = 1
    for t, c, n, s in settings:
        out_ch = _make_divisible(c * width_mult)
        for i in range(n):
            stride = s if i == 0 else 1
            pre, in_ch = f"features.{idx}", g.shape(x)[1]
            hidden = in_ch * t
            y = x
            if t != 1:
                y = _conv_bn(g, w, y, hidden, 1, 1, act="relu6", name=f"{pre}.expand")
            y = _conv_bn(g, w, y, hidden, 3, stride, groups=hidden, act="relu6", name=f"{pre}.depthwise")
            y = _conv_bn(g, w, y, out_ch, 1, 1, act=None, name=f"{pre}.project")
            x = g.add("add", [x, y], name=f"{pre}.add") if stride == 1 and in_ch == out_ch else y
            idx += 1
    x = _conv_bn(g, w, x, _make_divisible(1280 * max(1.0, width_mult)), 1, 1, act="relu6", name=f"features.{idx}")
    return g.build([_classifier(g, w, x, num_classes)])


# ----------------------------------------------------------------------------------------- BERT

def bert(batch_size: int = 1, seq_len: int = 128, num_layers: int = 12, hidden: int = 768, heads: int = 12,
         intermediate: int = 3072, vocab_size: int = 30522, max_position: int = 512, seed: int = 0) -> Graph:
    """BERT encoder (Devlin et al. 2019): embeddings, `num_layers` post-LN transformer layers, pooler.

    Input `input_ids` [batch, seq_len] int64 (token type 0, no padding mask); outputs the last hidden
    state [batch, seq_len, hidden] and the pooled [CLS] vector [batch, hidden]. BERT-base = the defaults.
    """
    _check_sizes("bert", batch_size=batch_size, seq_len=seq_len, num_layers=num_layers, hidden=hidden, heads=heads,
                 intermediate=intermediate, vocab_size=vocab_size)
    if hidden % heads:
        raise ValueError(f"bert: hidden size {hidden} must be divisible by the number of heads {heads}")
    if seq_len > max_position:
        raise ValueError(f"bert: seq_len {seq_len} exceeds the {max_position} position embeddings")
    g, w = GraphBuilder("bert-base" if (num_layers, hidden) == (12, 768) else f"bert-{num_layers}x{hidden}"), \
        _Weights(seed)
    head_dim = hidden // heads
    b, s = batch_size, seq_len

    def linear(x: str, n_in: int, n_out: int, name: str) -> str:
        y = g.add("matmul", [x, g.constant(w.normal((n_in, n_out), 0.02), f"{name}.weight")], name=name)
        return g.add("add", [y, g.constant(w.normal(n_out, 0.02), f"{name}.bias")], name=f"{name}.bias_add")

    def layer_norm(x: str, name: str) -> str:
        return g.add("layer_norm", [x, g.constant(1.0 + w.normal(hidden, 0.02), f"{name}.weight"),
                                    g.constant(w.normal(hidden, 0.02), f"{name}.bias")], name=name, epsilon=1e-12)

    ids = g.input("input_ids", (b, s), "int64")
    x = g.add("gather", [g.constant(w.normal((vocab_size, hidden), 0.02), "embeddings.word"), ids],
              name="embeddings.word_lookup", axis=0)
    x = g.add("add", [x, g.constant(w.normal((max_position, hidden), 0.02)[:s], "embeddings.position")],
              name="embeddings.add_position")
    x = g.add("add", [x, g.constant(w.normal(hidden, 0.02), "embeddings.token_type")],
              name="embeddings.add_token_type")
    x = layer_norm(x, "embeddings.layer_norm")
    for i in range(num_layers):
        pre = f"encoder.{i}"

        def heads_of(v: str, perm: tuple[int, ...], name: str) -> str:
            v = g.add("reshape", [v], name=f"{name}.split_heads", shape=(b, s, heads, head_dim))
            return g.add("transpose", [v], name=f"{name}.transpose", perm=perm)

        q = heads_of(linear(x, hidden, hidden, f"{pre}.query"), (0, 2, 1, 3), f"{pre}.query")
        k = heads_of(linear(x, hidden, hidden, f"{pre}.key"), (0, 2, 3, 1), f"{pre}.key")
        v = heads_of(linear(x, hidden, hidden, f"{pre}.value"), (0, 2, 1, 3), f"{pre}.value")
        scores = g.add("matmul", [q, k], name=f"{pre}.scores")
        scores = g.add("mul", [scores, g.constant(np.array(1.0 / math.sqrt(head_dim), np.float32), f"{pre}.scale")],
                       name=f"{pre}.scale")
        probs = g.add("softmax", [scores], name=f"{pre}.softmax", axis=-1)
        ctx = g.add("matmul", [probs, v], name=f"{pre}.context")
        ctx = g.add("transpose", [ctx], name=f"{pre}.merge_heads", perm=(0, 2, 1, 3))
        ctx = g.add("reshape", [ctx], name=f"{pre}.merge_heads.reshape", shape=(b, s, hidden))
        att = linear(ctx, hidden, hidden, f"{pre}.attention_output")
        x = layer_norm(g.add("add", [att, x], name=f"{pre}.attention_residual"), f"{pre}.attention_norm")
        h = g.add("gelu", [linear(x, hidden, intermediate, f"{pre}.intermediate")], name=f"{pre}.gelu")
        out = linear(h, intermediate, hidden, f"{pre}.output")
        x = layer_norm(g.add("add", [out, x], name=f"{pre}.output_residual"), f"{pre}.output_norm")
    cls = g.add("slice", [x], name="pooler.cls", begin=(0, 0, 0), end=(b, 1, hidden), step=(1, 1, 1))
    cls = g.add("reshape", [cls], name="pooler.flatten", shape=(b, hidden))
    pooled = g.add("dense", [cls, g.constant(w.normal((hidden, hidden), 0.02), "pooler.weight"),
                             g.constant(w.normal(hidden, 0.02), "pooler.bias")], name="pooler.dense")
    pooled = g.add("tanh", [pooled], name="pooler.tanh")
    return g.build([x, pooled])


# ----------------------------------------------------------------------------------------- DCGAN

def dcgan_generator(batch_size: int = 1, nz: int = 100, ngf: int = 64, nc: int = 3, seed: int = 0) -> Graph:
    """The DCGAN generator (Radford et al. 2016): z [batch, nz, 1, 1] -> image [batch, nc, 64, 64]."""
    _check_sizes("dcgan_generator", batch_size=batch_size, nz=nz, ngf=ngf, nc=nc)
    g, w = GraphBuilder("dcgan"), _Weights(seed)
    x = g.input("z", (batch_size, nz, 1, 1))
    chans = [ngf * 8, ngf * 4, ngf * 2, ngf, nc]
    for i, co in enumerate(chans):
        ci = g.shape(x)[1]
        stride, pad = (1, 0) if i == 0 else (2, 1)
        # each output sums about 4 * ci products (stride 2, kernel 4): keep activations near unit scale
        weight = w.normal((ci, co, 4, 4), math.sqrt(1.0 / (4 * ci)))
        name = f"main.{i}"
        if i < len(chans) - 1:
            weight, bias = fold_batch_norm(weight, None, *w.batch_norm(co), out_axis=1)
            x = g.add("conv_transpose2d", [x, g.constant(weight, f"{name}.weight"), g.constant(bias, f"{name}.bias")],
                      name=name, strides=(stride, stride), pads=(pad,) * 4)
            x = g.add("relu", [x], name=f"{name}.relu")
        else:
            x = g.add("conv_transpose2d", [x, g.constant(weight, f"{name}.weight")], name=name,
                      strides=(stride, stride), pads=(pad,) * 4)
            x = g.add("tanh", [x], name=f"{name}.tanh")
    return g.build([x])


# ----------------------------------------------------------------------------------------- registry

def _check_sizes(what: str, **sizes: int) -> None:
    for k, v in sizes.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{what}: {k} must be a positive integer, got {v!r}")


NETWORKS: dict[str, Callable[..., Graph]] = {
    "resnet-18": resnet18,
    "resnet-50": resnet50,
    "mobilenet-v2": mobilenet_v2,
    "bert-base": bert,
    "dcgan": dcgan_generator,
}


def network_names() -> list[str]:
    return sorted(NETWORKS)


def network_options(name: str) -> list[str]:
    """The keyword arguments a network's builder takes."""
    return list(inspect.signature(_builder(name)).parameters)


def _builder(name: str) -> Callable[..., Graph]:
    if name not in NETWORKS:
        raise GraphError(f"unknown network {name!r}; known: {', '.join(network_names())} (or an .onnx file)")
    return NETWORKS[name]


def make_network(name: str, **options) -> Graph:
    """Build a registered network; options the builder does not take are an error that lists those it does."""
    fn = _builder(name)
    params = inspect.signature(fn).parameters
    unknown = [k for k in options if k not in params]
    if unknown:
        raise GraphError(f"network {name!r} does not take {', '.join(unknown)}; it takes {', '.join(params)}")
    return fn(**options)


def load_graph(network: str, batch: int | None = None, seq_len: int | None = None, layers: int | None = None,
               image_size: int | None = None, input_shapes: list[str] | None = None) -> Graph:
    """A registered network built with the given sizes, or an imported ONNX file."""
    if network.endswith(".onnx") or os.path.sep in network:
        given = {k: v for k, v in (("--batch", batch), ("--seq-len", seq_len), ("--layers", layers),
                                   ("--image-size", image_size)) if v is not None}
        if given:
            raise GraphError(f"{', '.join(given)} apply to built-in networks; for an ONNX model pass "
                             f"--input-shape NAME=D0,D1,...")
        return import_onnx(network, _parse_shapes(input_shapes or []))
    options = {k: v for k, v in (("batch_size", batch), ("seq_len", seq_len), ("num_layers", layers),
                                 ("image_size", image_size)) if v is not None}
    return make_network(network, **options)


def _parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    out = {}
    for item in items:
        name, sep, dims = item.partition("=")
        try:
            out[name] = tuple(int(d) for d in dims.replace("x", ",").split(","))
        except ValueError:
            sep = ""
        if not sep or not name:
            raise GraphError(f"--input-shape {item!r}: write NAME=D0,D1,... (e.g. input=1,3,224,224)")
    return out
