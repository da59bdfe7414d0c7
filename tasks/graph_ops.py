"""The ops a network graph is made of: each op's attributes, shape and dtype inference, and a direct
NumPy implementation.

The NumPy runners compute in float64 from each op's definition, independent of the tensor-expression
library, so a compiled network is checked against code that shares nothing with it. `Graph`
(tasks.graph) calls `infer_node` as nodes are added and `run_node` for its reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

DTYPES = ("float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool")
REQUIRED = object()   # an attribute default meaning "must be given"


class GraphError(ValueError):
    """A graph that cannot be built or run; the message names the node or value that is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


@dataclass
class Node:
    """One op application: `output = op(*inputs, **attrs)`."""
    name: str
    op: str
    inputs: tuple[str, ...]
    output: str
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OpSpec:
    """What the graph knows about an op: its kind (for fusion), arity, attributes, shapes, reference."""
    name: str
    kind: str                      # "anchor" | "elementwise" | "injective" | "layout"
    arity: tuple[int, int]
    attrs: dict[str, Any]
    infer: Callable[["Node", list[TensorInfo]], TensorInfo]
    run: Callable[[list[np.ndarray], dict], np.ndarray]


OPS: dict[str, OpSpec] = {}


def register_op(name: str, kind: str, arity: tuple[int, int], attrs: dict[str, Any],
                infer: Callable, run: Callable) -> None:
    if name in OPS:
        raise ValueError(f"op {name!r} is already registered")
    OPS[name] = OpSpec(name, kind, arity, attrs, infer, run)


def op_spec(op: str, node: str = "") -> OpSpec:
    if op not in OPS:
        where = f" (node {node!r})" if node else ""
        raise GraphError(f"unknown op {op!r}{where}; known ops: {', '.join(sorted(OPS))}")
    return OPS[op]


def _fail(node: Node, msg: str) -> GraphError:
    return GraphError(f"node {node.name!r} ({node.op}): {msg}")


def _tuple_attr(v):
    if isinstance(v, np.ndarray):
        v = v.tolist()
    return tuple(_tuple_attr(x) for x in v) if isinstance(v, (list, tuple)) else v


def normalize_attrs(node: Node) -> dict:
    spec = op_spec(node.op, node.name)
    unknown = set(node.attrs) - set(spec.attrs)
    if unknown:
        raise _fail(node, f"unknown attribute(s) {sorted(unknown)}; {node.op} takes {sorted(spec.attrs) or 'none'}")
    out = {}
    for k, default in spec.attrs.items():
        if k in node.attrs:
            out[k] = _tuple_attr(node.attrs[k])
        elif default is REQUIRED:
            raise _fail(node, f"missing required attribute {k!r}")
        else:
            out[k] = default
    return out


# ------------------------------------------------------------------------------------ shape helpers

def _norm_axis(node: Node, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise _fail(node, f"axis {axis} is out of range for a rank-{rank} input")
    return axis % rank


def _need_rank(node: Node, info: TensorInfo, rank: int, what: str) -> None:
    if len(info.shape) != rank:
        raise _fail(node, f"{what} must be {rank}-d, got shape {list(info.shape)}")


def _need_float(node: Node, infos: Sequence[TensorInfo]) -> None:
    for i in infos:
        if not i.dtype.startswith("float"):
            raise _fail(node, f"needs float inputs, got {i.dtype}")


def broadcast_shapes(node: Node, a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise _fail(node, f"shapes {list(a)} and {list(b)} do not broadcast")
        out.append(max(x, y))
    return tuple(out)


def _window_out(node: Node, size: int, k: int, s: int, lo: int, hi: int, d: int, what: str) -> int:
    out = (size + lo + hi - d * (k - 1) - 1) // s + 1
    if out <= 0:
        raise _fail(node, f"{what}: kernel {k} (dilation {d}) does not fit input {size} with padding {lo}+{hi}")
    return out


def _check_pairs(node: Node, a: dict, names: Sequence[str], lengths: Sequence[int]) -> None:
    for n, ln in zip(names, lengths):
        v = a[n]
        if not isinstance(v, tuple) or len(v) != ln or not all(isinstance(x, int) for x in v):
            raise _fail(node, f"attribute {n!r} must be {ln} integers, got {v!r}")
        if n in ("strides", "dilations", "kernel") and min(v) < 1:
            raise _fail(node, f"attribute {n!r} must be positive, got {list(v)}")
        if n in ("pads", "output_padding") and min(v) < 0:
            raise _fail(node, f"attribute {n!r} must be non-negative, got {list(v)}")


# ------------------------------------------------------------------------------------ anchors

def _window_outs(node: Node, spatial: Sequence[int], k: Sequence[int], s: Sequence[int], pads: Sequence[int],
                 d: Sequence[int]) -> tuple[int, ...]:
    r = len(spatial)
    return tuple(_window_out(node, spatial[i], k[i], s[i], pads[i], pads[r + i], d[i], f"spatial axis {i}")
                 for i in range(r))


def _infer_conv(spatial: int) -> Callable[[Node, list[TensorInfo]], TensorInfo]:
    """Shape inference of a grouped, dilated conv over `spatial` axes (2: NCHW/OIHW, 3: NCDHW/OIDHW);
    pads are (begins..., ends...)."""
    layout = {2: ("data (NCHW)", "weight (OIHW)"), 3: ("data (NCDHW)", "weight (OIDHW)")}[spatial]

    def infer(node: Node, ins: list[TensorInfo]) -> TensorInfo:
        a = node.attrs
        _check_pairs(node, a, ("strides", "pads", "dilations"), (spatial, 2 * spatial, spatial))
        x, w = ins[0], ins[1]
        _need_float(node, ins)
        _need_rank(node, x, spatial + 2, layout[0])
        _need_rank(node, w, spatial + 2, layout[1])
        g, c, co, cig = a["groups"], x.shape[1], w.shape[0], w.shape[1]
        if g < 1 or c % g or co % g or cig * g != c:
            raise _fail(node, f"data has {c} channels, weight {list(w.shape)} with groups={g}: need weight dim 1 "
                              f"== channels/groups and output channels divisible by groups")
        if len(ins) == 3 and ins[2].shape != (co,):
            raise _fail(node, f"bias must have shape [{co}], got {list(ins[2].shape)}")
        out = _window_outs(node, x.shape[2:], w.shape[2:], a["strides"], a["pads"], a["dilations"])
        return TensorInfo((x.shape[0], co) + out, x.dtype)
    return infer


def _run_conv(xs: list[np.ndarray], a: dict) -> np.ndarray:
    """Grouped, dilated conv over any number of spatial axes: the sum over the kernel offsets of the
    (grouped) channel matmuls with the strided input views; pads are (begins..., ends...)."""
    x, w, g = xs[0], xs[1], a["groups"]
    s, p, d = a["strides"], a["pads"], a["dilations"]
    r = w.ndim - 2
    x = np.pad(x, ((0, 0), (0, 0)) + tuple((p[i], p[r + i]) for i in range(r)))
    n = x.shape[0]
    co, cig = w.shape[:2]
    k = w.shape[2:]
    out_sp = tuple((x.shape[2 + i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(r))
    xg = x.reshape((n, g, cig) + x.shape[2:])
    wg = w.reshape((g, co // g, cig) + k)
    out = np.zeros((n, g, co // g, math.prod(out_sp)))
    for off in np.ndindex(*k):
        view = xg[(...,) + tuple(slice(off[i] * d[i], off[i] * d[i] + s[i] * (out_sp[i] - 1) + 1, s[i])
                                 for i in range(r))]
        out += np.matmul(wg[(None, slice(None), slice(None), slice(None)) + off], view.reshape(n, g, cig, -1))
    out = out.reshape((n, co) + out_sp)
    return out + xs[2].reshape((1, co) + (1,) * r) if len(xs) == 3 else out


def _infer_conv_transpose2d(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    a = node.attrs
    _check_pairs(node, a, ("strides", "pads", "output_padding", "dilations"), (2, 4, 2, 2))
    x, w = ins[0], ins[1]
    _need_float(node, ins)
    _need_rank(node, x, 4, "data (NCHW)")
    _need_rank(node, w, 4, "weight (IOHW)")
    n, c, h, wd = x.shape
    ci, co, kh, kw = w.shape
    if ci != c:
        raise _fail(node, f"data has {c} channels but weight {list(w.shape)} expects {ci} (layout IOHW)")
    if len(ins) == 3 and ins[2].shape != (co,):
        raise _fail(node, f"bias must have shape [{co}], got {list(ins[2].shape)}")
    (sh, sw), (pt, pl, pb, pr), (oph, opw), (dh, dw) = a["strides"], a["pads"], a["output_padding"], a["dilations"]
    if oph >= max(sh, dh) or opw >= max(sw, dw):
        raise _fail(node, f"output_padding {[oph, opw]} must be smaller than the stride or dilation")
    oh = (h - 1) * sh - pt - pb + dh * (kh - 1) + 1 + oph
    ow = (wd - 1) * sw - pl - pr + dw * (kw - 1) + 1 + opw
    if oh <= 0 or ow <= 0:
        raise _fail(node, f"padding {list(a['pads'])} leaves an empty output")
    return TensorInfo((n, co, oh, ow), x.dtype)


def _run_conv_transpose2d(xs: list[np.ndarray], a: dict) -> np.ndarray:
    """Scatter definition: every input pixel adds weight * value to a KxK window of the output."""
    x, w = xs[0], xs[1]
    (sh, sw), (pt, pl, pb, pr), (oph, opw), (dh, dw) = a["strides"], a["pads"], a["output_padding"], a["dilations"]
    n, c, h, wd = x.shape
    _, co, kh, kw = w.shape
    fh, fw = (h - 1) * sh + dh * (kh - 1) + 1, (wd - 1) * sw + dw * (kw - 1) + 1
    full = np.zeros((n, co, fh + oph, fw + opw))
    for ky in range(kh):
        for kx in range(kw):
            contrib = np.einsum("nchw,co->nohw", x, w[:, :, ky, kx])
            full[:, :, ky * dh: ky * dh + (h - 1) * sh + 1: sh, kx * dw: kx * dw + (wd - 1) * sw + 1: sw] += contrib
    oh, ow = fh - pt - pb + oph, fw - pl - pr + opw
    out = full[:, :, pt: pt + oh, pl: pl + ow]
    return out + xs[2].reshape(1, co, 1, 1) if len(xs) == 3 else out


def _infer_dense(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    x, w = ins[0], ins[1]
    _need_float(node, ins)
    if len(x.shape) != 2 or len(w.shape) != 2 or x.shape[1] != w.shape[1]:
        raise _fail(node, f"data {list(x.shape)} and weight {list(w.shape)} must be [N, K] and [M, K]")
    if len(ins) == 3 and ins[2].shape != (w.shape[0],):
        raise _fail(node, f"bias must have shape [{w.shape[0]}], got {list(ins[2].shape)}")
    return TensorInfo((x.shape[0], w.shape[0]), x.dtype)


def _run_dense(xs: list[np.ndarray], a: dict) -> np.ndarray:
    out = xs[0] @ xs[1].T
    return out + xs[2] if len(xs) == 3 else out


def _infer_matmul(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    a, b = ins
    _need_float(node, ins)
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise _fail(node, f"inputs must have rank >= 2, got {list(a.shape)} and {list(b.shape)}; "
                          f"reshape vectors to matrices first")
    if a.shape[-1] != b.shape[-2]:
        raise _fail(node, f"{list(a.shape)} x {list(b.shape)}: inner dimensions {a.shape[-1]} and {b.shape[-2]} differ")
    batch = broadcast_shapes(node, a.shape[:-2], b.shape[:-2])
    return TensorInfo(batch + (a.shape[-2], b.shape[-1]), a.dtype)


def _infer_pool(spatial: int) -> Callable[[Node, list[TensorInfo]], TensorInfo]:
    """Shape inference of max/avg pooling over `spatial` axes (2: NCHW, 3: NCDHW); pads (begins..., ends...)."""
    layout = {2: "data (NCHW)", 3: "data (NCDHW)"}[spatial]

    def infer(node: Node, ins: list[TensorInfo]) -> TensorInfo:
        a = node.attrs
        _check_pairs(node, a, ("kernel", "strides", "pads"), (spatial, spatial, 2 * spatial))
        _need_rank(node, ins[0], spatial + 2, layout)
        _need_float(node, ins)
        if any(max(a["pads"][i], a["pads"][spatial + i]) >= a["kernel"][i] for i in range(spatial)):
            raise _fail(node, f"padding {list(a['pads'])} must be smaller than the kernel {list(a['kernel'])}")
        return TensorInfo(ins[0].shape[:2] + _window_outs(node, ins[0].shape[2:], a["kernel"], a["strides"],
                                                          a["pads"], (1,) * spatial), ins[0].dtype)
    return infer


def _pool_windows(x: np.ndarray, a: dict, fill: float) -> np.ndarray:
    """Every window of x (..., *spatial, *kernel), the spatial axes padded with `fill`."""
    p, s, k = a["pads"], a["strides"], tuple(a["kernel"])
    r = len(k)
    xp = np.pad(x, ((0, 0), (0, 0)) + tuple((p[i], p[r + i]) for i in range(r)), constant_values=fill)
    win = np.lib.stride_tricks.sliding_window_view(xp, k, axis=tuple(range(2, 2 + r)))
    return win[(slice(None), slice(None)) + tuple(slice(None, None, st) for st in s)]


def _run_max_pool(xs: list[np.ndarray], a: dict) -> np.ndarray:
    return _pool_windows(xs[0], a, -np.inf).max(axis=tuple(range(-len(a["kernel"]), 0)))


def _run_avg_pool(xs: list[np.ndarray], a: dict) -> np.ndarray:
    window_axes = tuple(range(-len(a["kernel"]), 0))
    total = _pool_windows(xs[0], a, 0.0).sum(axis=window_axes)
    if a["count_include_pad"]:
        return total / math.prod(a["kernel"])
    return total / _pool_windows(np.ones((1, 1) + xs[0].shape[2:]), a, 0.0).sum(axis=window_axes)


def _infer_global_pool(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    _need_rank(node, ins[0], 4, "data (NCHW)")
    _need_float(node, ins)
    n, c, _, _ = ins[0].shape
    return TensorInfo((n, c, 1, 1), ins[0].dtype)


def _infer_softmax(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    _need_float(node, ins)
    _norm_axis(node, node.attrs["axis"], len(ins[0].shape))
    return ins[0]


def _run_softmax(xs: list[np.ndarray], a: dict) -> np.ndarray:
    e = np.exp(xs[0] - xs[0].max(axis=a["axis"], keepdims=True))
    return e / e.sum(axis=a["axis"], keepdims=True)


def _infer_layer_norm(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    _need_float(node, ins)
    x = ins[0]
    axis = _norm_axis(node, node.attrs["axis"], len(x.shape))
    for what, info in zip(("scale", "bias"), ins[1:]):
        if info.shape != x.shape[axis:]:
            raise _fail(node, f"{what} must have shape {list(x.shape[axis:])}, got {list(info.shape)}")
    return x


def _run_layer_norm(xs: list[np.ndarray], a: dict) -> np.ndarray:
    x = xs[0]
    axes = tuple(range(a["axis"] % x.ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(var + a["epsilon"]) * xs[1] + xs[2]


def _infer_batch_norm(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    _need_float(node, ins)
    x = ins[0]
    if len(x.shape) < 2:
        raise _fail(node, f"data must have a channel axis (rank >= 2), got {list(x.shape)}")
    for what, info in zip(("scale", "bias", "mean", "var"), ins[1:]):
        if info.shape != (x.shape[1],):
            raise _fail(node, f"{what} must have shape [{x.shape[1]}], got {list(info.shape)}")
    return x


def _run_batch_norm(xs: list[np.ndarray], a: dict) -> np.ndarray:
    x, gamma, beta, mean, var = xs
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + a["epsilon"]) * gamma.reshape(shape) \
        + beta.reshape(shape)


# ------------------------------------------------------------------------------------ elementwise

def _infer_binary(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    a, b = ins
    if a.dtype != b.dtype:
        raise _fail(node, f"input dtypes differ ({a.dtype} and {b.dtype}); insert a cast")
    return TensorInfo(broadcast_shapes(node, a.shape, b.shape), a.dtype)


def _infer_unary(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    _need_float(node, ins)
    return ins[0]


def _infer_clip(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    lo, hi = node.attrs["min"], node.attrs["max"]
    if lo is not None and hi is not None and lo > hi:
        raise _fail(node, f"min {lo} is larger than max {hi}")
    return _infer_unary(node, ins)


_erf = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    return np.asarray(_erf(np.asarray(x, dtype=np.float64)), dtype=np.float64)


def _run_clip(xs: list[np.ndarray], a: dict) -> np.ndarray:
    x = xs[0]
    if a["min"] is not None:
        x = np.maximum(x, a["min"])
    if a["max"] is not None:
        x = np.minimum(x, a["max"])
    return x


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(np.asarray(a).dtype, np.integer):
        return np.floor_divide(a, b)
    return np.divide(a, b)


_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": _divide, "pow": np.power,
           "maximum": np.maximum, "minimum": np.minimum}
_UNARY = {
    "relu": lambda x: np.maximum(x, 0.0), "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "tanh": np.tanh,
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "erf": erf, "neg": np.negative, "abs": np.abs,
    "gelu": lambda x: 0.5 * x * (1.0 + erf(x / math.sqrt(2.0))),
}


def _prelu(x: np.ndarray, slope: np.ndarray) -> np.ndarray:
    return np.where(x >= 0, x, x * slope)


_BINARY["prelu"] = _prelu


def _expm1_where(x: np.ndarray, alpha: float) -> np.ndarray:
    return np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0)))


# elementwise ops with attributes: name -> (attribute defaults, NumPy reference of (x, attrs)); the
# defaults are ONNX's
ACTIVATIONS: dict[str, tuple[dict[str, Any], Callable[[np.ndarray, dict], np.ndarray]]] = {
    "leaky_relu": ({"alpha": 0.01}, lambda x, a: np.where(x >= 0, x, a["alpha"] * x)),
    "elu": ({"alpha": 1.0}, lambda x, a: _expm1_where(x, a["alpha"])),
    "selu": ({"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875},
             lambda x, a: a["gamma"] * _expm1_where(x, a["alpha"])),
    "softplus": ({}, lambda x, a: np.logaddexp(0.0, x)),
    "softsign": ({}, lambda x, a: x / (1.0 + np.abs(x))),
    "swish": ({"alpha": 1.0}, lambda x, a: x / (1.0 + np.exp(-a["alpha"] * x))),
    "thresholded_relu": ({"alpha": 1.0}, lambda x, a: np.where(x > a["alpha"], x, 0.0)),
    "shrink": ({"lambd": 0.5, "bias": 0.0}, lambda x, a: np.where(x < -a["lambd"], x + a["bias"],
                                                                  np.where(x > a["lambd"], x - a["bias"], 0.0))),
    "sign": ({}, lambda x, a: np.sign(x)),
    "floor": ({}, lambda x, a: np.floor(x)),
    "ceil": ({}, lambda x, a: np.ceil(x)),
    "gelu_tanh": ({}, lambda x, a: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))),
    "hard_sigmoid": ({"alpha": 0.2, "beta": 0.5}, lambda x, a: np.clip(a["alpha"] * x + a["beta"], 0.0, 1.0)),
    "hard_swish": ({}, lambda x, a: x * np.clip(x / 6.0 + 0.5, 0.0, 1.0)),
    "reciprocal": ({}, lambda x, a: 1.0 / x),
}



# comparisons and logic on run-time tensors: bool results (numpy broadcasting)
COMPARISONS = {"equal": np.equal, "less": np.less, "greater": np.greater, "less_equal": np.less_equal,
               "greater_equal": np.greater_equal, "logical_and": np.logical_and, "logical_or": np.logical_or,
               "logical_xor": np.logical_xor}


def _infer_compare(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    a, b = ins
    if a.dtype != b.dtype:
        raise _fail(node, f"input dtypes differ ({a.dtype} and {b.dtype}); insert a cast")
    if node.op.startswith("logical_") and a.dtype != "bool":
        raise _fail(node, f"needs bool inputs, got {a.dtype}")
    return TensorInfo(broadcast_shapes(node, a.shape, b.shape), "bool")


def _infer_not(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    if ins[0].dtype != "bool":
        raise _fail(node, f"needs a bool input, got {ins[0].dtype}")
    return ins[0]


def _infer_where(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    cond, x, y = ins
    if cond.dtype != "bool" or x.dtype != y.dtype:
        raise _fail(node, f"needs a bool condition and two values of one dtype, got {cond.dtype}, {x.dtype}, {y.dtype}")
    return TensorInfo(broadcast_shapes(node, broadcast_shapes(node, cond.shape, x.shape), y.shape), x.dtype)


# ------------------------------------------------------------------------------------ normalisation

def _run_log_softmax(xs: list[np.ndarray], a: dict) -> np.ndarray:
    x = xs[0] - xs[0].max(axis=a["axis"], keepdims=True)
    return x - np.log(np.exp(x).sum(axis=a["axis"], keepdims=True))


def _infer_lrn(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    _need_float(node, ins)
    if len(ins[0].shape) < 3:
        raise _fail(node, f"needs a tensor with channels on axis 1 and spatial axes (rank >= 3), got "
                          f"{list(ins[0].shape)}")
    size = node.attrs["size"]
    if not isinstance(size, int) or size < 1:
        raise _fail(node, f"size must be a positive integer, got {size!r}")
    return ins[0]


def _run_lrn(xs: list[np.ndarray], a: dict) -> np.ndarray:
    """ONNX LRN: the sum of squares over the channels [c - floor((size-1)/2), c + ceil((size-1)/2)]."""
    x, size = xs[0], a["size"]
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = np.pad(x * x, [(0, 0), (lo, hi)] + [(0, 0)] * (x.ndim - 2))
    window = sum(sq[:, k:k + x.shape[1]] for k in range(size))
    return x / (a["bias"] + a["alpha"] / size * window) ** a["beta"]


# ------------------------------------------------------------------------------------ layout

def _infer_reshape(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    shape = node.attrs["shape"]
    if not isinstance(shape, tuple) or not all(isinstance(s, int) and s > 0 for s in shape):
        raise _fail(node, f"shape must be positive integers (resolve -1 and 0 first), got {shape!r}")
    if math.prod(shape) != ins[0].size:
        raise _fail(node, f"cannot reshape {list(ins[0].shape)} ({ins[0].size} elements) to {list(shape)}")
    return TensorInfo(shape, ins[0].dtype)


def _infer_transpose(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    perm, rank = node.attrs["perm"], len(ins[0].shape)
    if sorted(perm) != list(range(rank)):
        raise _fail(node, f"perm {list(perm)} is not a permutation of 0..{rank - 1}")
    return TensorInfo(tuple(ins[0].shape[p] for p in perm), ins[0].dtype)


def slice_length(begin: int, end: int, step: int) -> int:
    return len(range(begin, end, step))


def _infer_slice(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    a, shape = node.attrs, ins[0].shape
    begin, end, step = a["begin"], a["end"], a["step"]
    if not (len(begin) == len(end) == len(step) == len(shape)):
        raise _fail(node, f"begin/end/step need one entry per axis ({len(shape)}), got {begin}/{end}/{step}")
    out = []
    for d, (b, e, s, n) in enumerate(zip(begin, end, step, shape)):
        if s == 0:
            raise _fail(node, f"step on axis {d} is 0")
        if not (0 <= b < n) or not (-1 <= e <= n):
            raise _fail(node, f"axis {d}: begin {b} / end {e} must be clamped into the dimension of size {n}")
        ln = slice_length(b, e, s)
        if ln <= 0:
            raise _fail(node, f"axis {d}: slice {b}:{e}:{s} of a dimension of size {n} is empty")
        out.append(ln)
    return TensorInfo(tuple(out), ins[0].dtype)


def _run_slice(xs: list[np.ndarray], a: dict) -> np.ndarray:
    idx = tuple(slice(b, None if e < 0 else e, s) for b, e, s in zip(a["begin"], a["end"], a["step"]))
    return xs[0][idx]


PAD_MODES = ("constant", "reflect", "edge")


def _infer_pad(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    a, shape = node.attrs, ins[0].shape
    if len(a["before"]) != len(shape) or len(a["after"]) != len(shape):
        raise _fail(node, f"pads need one entry per axis ({len(shape)}), got {list(a['before'])}/{list(a['after'])}")
    if any(p < 0 for p in a["before"] + a["after"]):
        raise _fail(node, f"negative pads (cropping) are not supported: {list(a['before'])}/{list(a['after'])}")
    if a["mode"] not in PAD_MODES:
        raise _fail(node, f"mode {a['mode']!r} is not supported; use one of {', '.join(PAD_MODES)}")
    if a["mode"] == "reflect" and any(max(b, e) >= n for b, e, n in zip(a["before"], a["after"], shape)):
        raise _fail(node, f"reflect pads {list(a['before'])}/{list(a['after'])} must be smaller than the "
                          f"dimensions {list(shape)}")
    return TensorInfo(tuple(n + b + e for n, b, e in zip(shape, a["before"], a["after"])), ins[0].dtype)


def _run_pad(xs: list[np.ndarray], a: dict) -> np.ndarray:
    widths = list(zip(a["before"], a["after"]))
    if a["mode"] == "constant":
        return np.pad(xs[0], widths, mode="constant", constant_values=a["value"])
    return np.pad(xs[0], widths, mode=a["mode"])


def _infer_broadcast_to(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    shape = node.attrs["shape"]
    if broadcast_shapes(node, ins[0].shape, shape) != tuple(shape):
        raise _fail(node, f"{list(ins[0].shape)} does not broadcast to {list(shape)}")
    return TensorInfo(tuple(shape), ins[0].dtype)


def _infer_tile(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    reps, shape = node.attrs["repeats"], ins[0].shape
    if len(reps) != len(shape) or any(not isinstance(r, int) or r < 1 for r in reps):
        raise _fail(node, f"repeats must be one positive integer per axis ({len(shape)}), got {list(reps)}")
    return TensorInfo(tuple(n * r for n, r in zip(shape, reps)), ins[0].dtype)


def _infer_gather(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    data, idx = ins
    axis = _norm_axis(node, node.attrs["axis"], len(data.shape))
    if not idx.dtype.startswith(("int", "uint")):
        raise _fail(node, f"indices must be integers, got {idx.dtype}")
    return TensorInfo(data.shape[:axis] + idx.shape + data.shape[axis + 1:], data.dtype)


def _run_gather(xs: list[np.ndarray], a: dict) -> np.ndarray:
    data, idx = xs
    axis = a["axis"] % data.ndim
    n = data.shape[axis]
    idx = np.asarray(idx).astype(np.int64)
    if np.any(idx < -n) or np.any(idx >= n):
        raise GraphError(f"gather: an index is outside [-{n}, {n}) on axis {axis}")
    return np.take(data, np.where(idx < 0, idx + n, idx), axis=axis)


def _infer_concat(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    rank = len(ins[0].shape)
    axis = _norm_axis(node, node.attrs["axis"], rank)
    for i in ins[1:]:
        if len(i.shape) != rank or i.dtype != ins[0].dtype or any(
                x != y for d, (x, y) in enumerate(zip(i.shape, ins[0].shape)) if d != axis):
            raise _fail(node, f"inputs {[list(j.shape) for j in ins]} must agree on every axis but {axis} "
                              f"(and on dtype)")
    shape = list(ins[0].shape)
    shape[axis] = sum(i.shape[axis] for i in ins)
    return TensorInfo(tuple(shape), ins[0].dtype)


def _infer_reduce(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    _need_float(node, ins)
    shape = ins[0].shape
    axes = node.attrs["axes"]
    if not isinstance(axes, tuple) or not axes:
        raise _fail(node, f"axes must be a non-empty list of integers, got {axes!r}")
    axes = sorted({_norm_axis(node, a, len(shape)) for a in axes})
    node.attrs["axes"] = tuple(axes)
    if node.attrs["keepdims"]:
        return TensorInfo(tuple(1 if d in axes else s for d, s in enumerate(shape)), ins[0].dtype)
    out = tuple(s for d, s in enumerate(shape) if d not in axes)
    if not out:
        raise _fail(node, "reducing every axis without keepdims gives a scalar; use keepdims=True")
    return TensorInfo(out, ins[0].dtype)


# NHWC forms (tasks.channels_last makes them): the NCHW op's inference and reference on transposed
# views. Data NHWC; a conv's weight HWIO ([KH, KW, CI/groups, CO]); the output NHWC.
_TO_NCHW, _TO_NHWC, _HWIO_TO_OIHW = (0, 3, 1, 2), (0, 2, 3, 1), (3, 2, 0, 1)


def _channels_last(infer: Callable[[Node, list[TensorInfo]], TensorInfo],
                   run: Callable[[list[np.ndarray], dict], np.ndarray]) -> tuple[Callable, Callable]:
    def permuted(info: TensorInfo, perm: tuple[int, ...]) -> TensorInfo:
        return TensorInfo(tuple(info.shape[p] for p in perm), info.dtype) if len(info.shape) == 4 else info

    def infer_nhwc(node: Node, ins: list[TensorInfo]) -> TensorInfo:
        _need_rank(node, ins[0], 4, "data (NHWC)")
        if len(ins) > 1:
            _need_rank(node, ins[1], 4, "weight (HWIO)")
        moved = [permuted(ins[0], _TO_NCHW)] + [permuted(w, _HWIO_TO_OIHW) for w in ins[1:2]] + ins[2:]
        return permuted(infer(node, moved), _TO_NHWC)

    def run_nhwc(xs: list[np.ndarray], a: dict) -> np.ndarray:
        moved = [xs[0].transpose(_TO_NCHW)] + [w.transpose(_HWIO_TO_OIHW) for w in xs[1:2]] + xs[2:]
        return np.asarray(run(moved, a)).transpose(_TO_NHWC)
    return infer_nhwc, run_nhwc


def _register_all() -> None:
    conv = {"strides": (1, 1), "pads": (0, 0, 0, 0), "dilations": (1, 1), "groups": 1}
    register_op("conv2d", "anchor", (2, 3), conv, _infer_conv(2), _run_conv)
    register_op("conv_transpose2d", "anchor", (2, 3),
                {"strides": (1, 1), "pads": (0, 0, 0, 0), "output_padding": (0, 0), "dilations": (1, 1)},
                _infer_conv_transpose2d, _run_conv_transpose2d)
    register_op("dense", "anchor", (2, 3), {}, _infer_dense, _run_dense)
    register_op("matmul", "anchor", (2, 2), {}, _infer_matmul, lambda xs, a: np.matmul(xs[0], xs[1]))
    pool = {"kernel": REQUIRED, "strides": (1, 1), "pads": (0, 0, 0, 0)}
    register_op("max_pool2d", "anchor", (1, 1), pool, _infer_pool(2), _run_max_pool)
    register_op("avg_pool2d", "anchor", (1, 1), {**pool, "count_include_pad": False}, _infer_pool(2), _run_avg_pool)
    register_op("global_avg_pool2d", "anchor", (1, 1), {}, _infer_global_pool,
                lambda xs, a: xs[0].mean(axis=(2, 3), keepdims=True))
    register_op("conv2d_nhwc", "anchor", (2, 3), conv, *_channels_last(_infer_conv(2), _run_conv))
    register_op("max_pool2d_nhwc", "anchor", (1, 1), pool, *_channels_last(_infer_pool(2), _run_max_pool))
    register_op("avg_pool2d_nhwc", "anchor", (1, 1), {**pool, "count_include_pad": False},
                *_channels_last(_infer_pool(2), _run_avg_pool))
    register_op("global_avg_pool2d_nhwc", "anchor", (1, 1), {},
                *_channels_last(_infer_global_pool, lambda xs, a: xs[0].mean(axis=(2, 3), keepdims=True)))
    register_op("conv3d", "anchor", (2, 3), {"strides": (1, 1, 1), "pads": (0,) * 6, "dilations": (1, 1, 1),
                                             "groups": 1}, _infer_conv(3), _run_conv)
    pool3d = {"kernel": REQUIRED, "strides": (1, 1, 1), "pads": (0,) * 6}
    register_op("max_pool3d", "anchor", (1, 1), pool3d, _infer_pool(3), _run_max_pool)
    register_op("avg_pool3d", "anchor", (1, 1), {**pool3d, "count_include_pad": False}, _infer_pool(3),
                _run_avg_pool)
    register_op("softmax", "anchor", (1, 1), {"axis": -1}, _infer_softmax, _run_softmax)
    register_op("layer_norm", "anchor", (3, 3), {"axis": -1, "epsilon": 1e-5}, _infer_layer_norm, _run_layer_norm)
    for name, fn in (("reduce_mean", np.mean), ("reduce_sum", np.sum), ("reduce_max", np.max),
                     ("reduce_min", np.min)):
        register_op(name, "anchor", (1, 1), {"axes": REQUIRED, "keepdims": True}, _infer_reduce,
                    lambda xs, a, fn=fn: fn(xs[0], axis=a["axes"], keepdims=bool(a["keepdims"])))
    register_op("batch_norm", "elementwise", (5, 5), {"epsilon": 1e-5}, _infer_batch_norm, _run_batch_norm)
    for name, binary in _BINARY.items():
        register_op(name, "elementwise", (2, 2), {}, _infer_binary, lambda xs, a, fn=binary: fn(xs[0], xs[1]))
    for name, unary in _UNARY.items():
        register_op(name, "elementwise", (1, 1), {}, _infer_unary, lambda xs, a, fn=unary: fn(xs[0]))
    register_op("clip", "elementwise", (1, 1), {"min": None, "max": None}, _infer_clip, _run_clip)
    for name, (defaults, act) in ACTIVATIONS.items():
        register_op(name, "elementwise", (1, 1), defaults, _infer_unary, lambda xs, a, fn=act: fn(xs[0], a))
    for name, cmp in COMPARISONS.items():
        register_op(name, "elementwise", (2, 2), {}, _infer_compare, lambda xs, a, fn=cmp: fn(xs[0], xs[1]))
    register_op("logical_not", "elementwise", (1, 1), {}, _infer_not, lambda xs, a: np.logical_not(xs[0]))
    register_op("where", "elementwise", (3, 3), {}, _infer_where, lambda xs, a: np.where(xs[0], xs[1], xs[2]))
    register_op("log_softmax", "anchor", (1, 1), {"axis": -1}, _infer_softmax, _run_log_softmax)
    register_op("lrn", "anchor", (1, 1), {"size": REQUIRED, "alpha": 1e-4, "beta": 0.75, "bias": 1.0},
                _infer_lrn, _run_lrn)
    register_op("pad", "injective", (1, 1), {"before": REQUIRED, "after": REQUIRED, "mode": "constant", "value": 0.0},
                _infer_pad, _run_pad)
    register_op("broadcast_to", "injective", (1, 1), {"shape": REQUIRED}, _infer_broadcast_to,
                lambda xs, a: np.broadcast_to(xs[0], a["shape"]))
    register_op("tile", "injective", (1, 1), {"repeats": REQUIRED}, _infer_tile,
                lambda xs, a: np.tile(xs[0], a["repeats"]))
    register_op("reshape", "layout", (1, 1), {"shape": REQUIRED}, _infer_reshape,
                lambda xs, a: xs[0].reshape(a["shape"]))
    register_op("transpose", "injective", (1, 1), {"perm": REQUIRED}, _infer_transpose,
                lambda xs, a: np.transpose(xs[0], a["perm"]))
    register_op("slice", "injective", (1, 1), {"begin": REQUIRED, "end": REQUIRED, "step": REQUIRED},
                _infer_slice, _run_slice)
    register_op("gather", "injective", (2, 2), {"axis": 0}, _infer_gather, _run_gather)
    register_op("concat", "injective", (1, 64), {"axis": REQUIRED}, _infer_concat,
                lambda xs, a: np.concatenate(xs, axis=a["axis"]))


_register_all()


def infer_node(node: Node, ins: list[TensorInfo]) -> TensorInfo:
    """Check a node's arity and attributes and return its output's TensorInfo (normalises node.attrs)."""
    spec = op_spec(node.op, node.name)
    lo, hi = spec.arity
    if not lo <= len(ins) <= hi:
        want = str(lo) if lo == hi else f"{lo} to {hi}"
        raise _fail(node, f"takes {want} inputs, got {len(ins)}")
    node.attrs = normalize_attrs(node)
    try:
        return spec.infer(node, ins)
    except GraphError:
        raise
    except (TypeError, ValueError) as err:
        raise _fail(node, f"bad attributes {node.attrs}: {err}") from None

def run_node(node: Node, xs: list[np.ndarray]) -> np.ndarray:
    """The NumPy reference of one node."""
    try:
        return np.asarray(OPS[node.op].run(xs, node.attrs))
    except GraphError as err:
        raise GraphError(f"node {node.name!r} ({node.op}): {err}") from None
