"""The operator library: TOPI-style builders from tensors to tensors.

Each builder checks its shapes and raises a ValueError naming the mismatch, so a bad network or
workload fails where it is written, not deep inside lowering.
"""
from __future__ import annotations

from typing import Sequence

from tensortune.tasks import te
from tensortune.tasks.te import Tensor


def _pair(v, n: int = 2) -> tuple[int, ...]:
    if isinstance(v, (list, tuple)):
        if len(v) != n:
            raise ValueError(f"expected {n} values, got {list(v)}")
        return tuple(int(x) for x in v)
    return (int(v),) * n


def _out_size(size: int, k: int, stride: int, pad_lo: int, pad_hi: int, dilation: int, what: str) -> int:
    out = (size + pad_lo + pad_hi - dilation * (k - 1) - 1) // stride + 1
    if out <= 0:
        raise ValueError(f"{what}: kernel {k} (dilation {dilation}) does not fit input {size} "
                         f"with padding {pad_lo}+{pad_hi}")
    return out


def _check_rank(t: Tensor, rank: int, what: str, layout: str) -> None:
    if t.ndim != rank:
        raise ValueError(f"{what}: {t.name} must be {layout} ({rank}-d), got shape {list(t.shape)}")


# ------------------------------------------------------------------------------ elementwise

def pad(data: Tensor, before: Sequence[int], after: Sequence[int] | None = None, value: float = 0.0,
        name: str = "pad_temp") -> Tensor:
    after = before if after is None else after
    if len(before) != data.ndim or len(after) != data.ndim:
        raise ValueError(f"pad: {data.name} has {data.ndim} dims, padding {list(before)}/{list(after)}")
    if not any(before) and not any(after):
        return data
    shape = tuple(s + b + a for s, b, a in zip(data.shape, before, after))

    def f(*idx):
        conds, src = [], []
        for i, b, a, s in zip(idx, before, after, data.shape):
            if b or a:
                conds += [i >= b, i < b + s]
            src.append(i - b)
        return te.if_then_else(te.all(*conds), data[tuple(src)], te.const(value, data.dtype))
    return te.compute(shape, f, name=name)


def _unary(x: Tensor, fn, name: str) -> Tensor:
    return te.compute(x.shape, lambda *i: fn(x[i]), name=name)


def relu(x: Tensor, name: str = "T_relu") -> Tensor:
    return _unary(x, lambda v: te.maximum(v, te.const(0, x.dtype)), name)


def relu6(x: Tensor, name: str = "T_clip") -> Tensor:
    return _unary(x, lambda v: te.minimum(te.maximum(v, te.const(0, x.dtype)), te.const(6, x.dtype)), name)


def sigmoid(x: Tensor, name: str = "T_sigmoid") -> Tensor:
    return _unary(x, te.sigmoid, name)


def tanh(x: Tensor, name: str = "T_tanh") -> Tensor:
    return _unary(x, te.tanh, name)


def exp(x: Tensor, name: str = "T_exp") -> Tensor:
    return _unary(x, te.exp, name)


def gelu(x: Tensor, name: str = "T_gelu") -> Tensor:
    """x * 0.5 * (1 + erf(x / sqrt(2))), as BERT uses it."""
    return _unary(x, lambda v: v * 0.5 * (1.0 + te.erf(v * 0.7071067811865476)), name)


def _broadcast_index(t: Tensor, idx: tuple, out_shape: tuple) -> tuple:
    """numpy broadcasting: align trailing dims; size-1 dims read index 0."""
    off = len(out_shape) - t.ndim
    return tuple(0 if t.shape[d] == 1 and out_shape[off + d] != 1 else idx[off + d] for d in range(t.ndim))


def broadcast_shape(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise ValueError(f"shapes {list(a)} and {list(b)} do not broadcast")
        out.append(max(x, y))
    return tuple(out)


def binary(a: Tensor, b: Tensor, op: str, name: str | None = None) -> Tensor:
    """Broadcasting elementwise op (add, subtract, multiply, divide, maximum, minimum)."""
    shape = broadcast_shape(a.shape, b.shape)
    fn = {"add": lambda x, y: x + y, "subtract": lambda x, y: x - y, "multiply": lambda x, y: x * y,
          "divide": lambda x, y: x / y, "maximum": te.maximum, "minimum": te.minimum}
    if op not in fn:
        raise ValueError(f"unknown elementwise op {op!r}; use one of {', '.join(fn)}")
    return te.compute(shape, lambda *i: fn[op](a[_broadcast_index(a, i, shape)], b[_broadcast_index(b, i, shape)]),
                      name=name or f"T_{op}")


def add(a: Tensor, b: Tensor, name: str = "T_add") -> Tensor:
    return binary(a, b, "add", name)


def multiply(a: Tensor, b: Tensor, name: str = "T_multiply") -> Tensor:
    return binary(a, b, "multiply", name)


def bias_add(x: Tensor, bias: Tensor, axis: int = 1, name: str = "T_add") -> Tensor:
    axis = axis % x.ndim
    if bias.ndim != 1 or bias.shape[0] != x.shape[axis]:
        raise ValueError(f"bias_add: bias {list(bias.shape)} must be 1-d of size {x.shape[axis]} (axis {axis} of "
                         f"{list(x.shape)})")
    return te.compute(x.shape, lambda *i: x[i] + bias[i[axis]], name=name)


# ------------------------------------------------------------------------------ dense / matmul

def matmul(a: Tensor, b: Tensor, name: str = "matmul") -> Tensor:
    """C[i, j] = sum_k A[i, k] * B[k, j]."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: shapes {list(a.shape)} x {list(b.shape)} do not chain (need [N, K] x [K, M])")
    k = te.reduce_axis(a.shape[1], "k")
    return te.compute((a.shape[0], b.shape[1]), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name=name)


def dense(x: Tensor, w: Tensor, name: str = "T_dense") -> Tensor:
    """out[i, j] = sum_k X[i, k] * W[j, k] (weights stored [out, in], as in TVM and ONNX Gemm transB)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"dense: data {list(x.shape)} and weight {list(w.shape)} need [N, K] and [M, K]")
    k = te.reduce_axis(x.shape[1], "k")
    return te.compute((x.shape[0], w.shape[0]), lambda i, j: te.sum(x[i, k] * w[j, k], axis=k), name=name)


def batch_matmul(a: Tensor, b: Tensor, transpose_b: bool = False, name: str = "T_batch_matmul") -> Tensor:
    """C[b, i, j] = sum_k A[b, i, k] * B[b, k, j] (or B[b, j, k] with transpose_b)."""
    if a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"batch_matmul: needs 3-d tensors, got {list(a.shape)} and {list(b.shape)}")
    kb = b.shape[2] if transpose_b else b.shape[1]
    m = b.shape[1] if transpose_b else b.shape[2]
    if a.shape[2] != kb or b.shape[0] not in (1, a.shape[0]):
        raise ValueError(f"batch_matmul: {list(a.shape)} x {list(b.shape)} (transpose_b={transpose_b}) do not chain")
    k = te.reduce_axis(a.shape[2], "k")
    bb = (lambda n: 0) if b.shape[0] == 1 else (lambda n: n)
    if transpose_b:
        return te.compute((a.shape[0], a.shape[1], m),
                          lambda n, i, j: te.sum(a[n, i, k] * b[bb(n), j, k], axis=k), name=name)
    return te.compute((a.shape[0], a.shape[1], m),
                      lambda n, i, j: te.sum(a[n, i, k] * b[bb(n), k, j], axis=k), name=name)


# ------------------------------------------------------------------------------ convolutions

def conv1d_ncw(data: Tensor, kernel: Tensor, stride=1, padding=0, dilation=1, name="conv1d_ncw") -> Tensor:
    _check_rank(data, 3, "conv1d", "NCW")
    _check_rank(kernel, 3, "conv1d", "OIW")
    n, c, length = data.shape
    co, ci, kw = kernel.shape
    if ci != c:
        raise ValueError(f"conv1d: data has {c} channels but kernel expects {ci}")
    ol = _out_size(length, kw, stride, padding, padding, dilation, "conv1d")
    p = pad(data, (0, 0, padding), (0, 0, padding))
    rc, rx = te.reduce_axis(c, "rc"), te.reduce_axis(kw, "rx")
    return te.compute((n, co, ol), lambda b, f, x: te.sum(
        p[b, rc, x * stride + rx * dilation] * kernel[f, rc, rx], axis=[rc, rx]), name=name)


def conv2d_nchw(data: Tensor, kernel: Tensor, stride=1, padding=0, dilation=1, groups: int = 1,
                name: str = "conv2d_nchw") -> Tensor:
    """Grouped and dilated conv2d; kernel [CO, CI/groups, KH, KW]."""
    _check_rank(data, 4, "conv2d", "NCHW")
    _check_rank(kernel, 4, "conv2d", "OIHW")
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    n, c, h, w = data.shape
    co, cig, kh, kw = kernel.shape
    if c % groups or co % groups or cig != c // groups:
        raise ValueError(f"conv2d: data has {c} channels, kernel {list(kernel.shape)} and groups={groups} "
                         f"need CI/groups == kernel dim 1 and CO divisible by groups")
    oh = _out_size(h, kh, sh, ph, ph, dh, "conv2d height")
    ow = _out_size(w, kw, sw, pw, pw, dw, "conv2d width")
    p = pad(data, (0, 0, ph, pw))
    rc, ry, rx = te.reduce_axis(cig, "rc"), te.reduce_axis(kh, "ry"), te.reduce_axis(kw, "rx")
    cog = co // groups
    if groups == 1:
        def f(b, ff, y, x):
            return te.sum(p[b, rc, y * sh + ry * dh, x * sw + rx * dw] * kernel[ff, rc, ry, rx], axis=[rc, ry, rx])
    else:
        def f(b, ff, y, x):
            return te.sum(p[b, ff // cog * cig + rc, y * sh + ry * dh, x * sw + rx * dw] * kernel[ff, rc, ry, rx],
                          axis=[rc, ry, rx])
    return te.compute((n, co, oh, ow), f, name=name)


def conv2d_nhwc(data: Tensor, kernel: Tensor, stride=1, padding=0, dilation=1, name: str = "conv2d_nhwc") -> Tensor:
    """kernel [KH, KW, CI, CO]."""
    _check_rank(data, 4, "conv2d", "NHWC")
    _check_rank(kernel, 4, "conv2d", "HWIO")
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    n, h, w, c = data.shape
    kh, kw, ci, co = kernel.shape
    if ci != c:
        raise ValueError(f"conv2d: data has {c} channels but kernel expects {ci}")
    oh = _out_size(h, kh, sh, ph, ph, dh, "conv2d height")
    ow = _out_size(w, kw, sw, pw, pw, dw, "conv2d width")
    p = pad(data, (0, ph, pw, 0))
    rc, ry, rx = te.reduce_axis(c, "rc"), te.reduce_axis(kh, "ry"), te.reduce_axis(kw, "rx")
    return te.compute((n, oh, ow, co), lambda b, y, x, f: te.sum(
        p[b, y * sh + ry * dh, x * sw + rx * dw, rc] * kernel[ry, rx, rc, f], axis=[ry, rx, rc]), name=name)


def conv3d_ncdhw(data: Tensor, kernel: Tensor, stride=1, padding=0, dilation=1, name="conv3d_ncdhw") -> Tensor:
    _check_rank(data, 5, "conv3d", "NCDHW")
    _check_rank(kernel, 5, "conv3d", "OIDHW")
    (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = _pair(stride, 3), _pair(padding, 3), _pair(dilation, 3)
    n, c, d, h, w = data.shape
    co, ci, kd, kh, kw = kernel.shape
    if ci != c:
        raise ValueError(f"conv3d: data has {c} channels but kernel expects {ci}")
    od = _out_size(d, kd, sd, pd, pd, dd, "conv3d depth")
    oh = _out_size(h, kh, sh, ph, ph, dh, "conv3d height")
    ow = _out_size(w, kw, sw, pw, pw, dw, "conv3d width")
    p = pad(data, (0, 0, pd, ph, pw))
    rc, rz, ry, rx = (te.reduce_axis(c, "rc"), te.reduce_axis(kd, "rz"), te.reduce_axis(kh, "ry"),
                      te.reduce_axis(kw, "rx"))
    return te.compute((n, co, od, oh, ow), lambda b, f, z, y, x: te.sum(
        p[b, rc, z * sd + rz * dd, y * sh + ry * dh, x * sw + rx * dw] * kernel[f, rc, rz, ry, rx],
        axis=[rc, rz, ry, rx]), name=name)


def depthwise_conv2d_nchw(data: Tensor, kernel: Tensor, stride=1, padding=0, dilation=1,
                          name: str = "DepthwiseConv2d") -> Tensor:
    """kernel [C, multiplier, KH, KW]; output channel c*multiplier + m."""
    _check_rank(data, 4, "depthwise_conv2d", "NCHW")
    _check_rank(kernel, 4, "depthwise_conv2d", "C M KH KW")
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    n, c, h, w = data.shape
    kc, mult, kh, kw = kernel.shape
    if kc != c:
        raise ValueError(f"depthwise_conv2d: data has {c} channels but kernel has {kc}")
    oh = _out_size(h, kh, sh, ph, ph, dh, "depthwise height")
    ow = _out_size(w, kw, sw, pw, pw, dw, "depthwise width")
    p = pad(data, (0, 0, ph, pw))
    ry, rx = te.reduce_axis(kh, "ry"), te.reduce_axis(kw, "rx")
    return te.compute((n, c * mult, oh, ow), lambda b, f, y, x: te.sum(
        p[b, f // mult, y * sh + ry * dh, x * sw + rx * dw] * kernel[f // mult, f % mult, ry, rx],
        axis=[ry, rx]), name=name)


def conv2d_transpose_nchw(data: Tensor, kernel: Tensor, stride=1, padding=0, output_padding=0,
                          name: str = "conv2d_transpose_nchw") -> Tensor:
    """kernel [CI, CO, KH, KW] (PyTorch's ConvTranspose2d layout)."""
    _check_rank(data, 4, "conv2d_transpose", "NCHW")
    _check_rank(kernel, 4, "conv2d_transpose", "IOHW")
    (sh, sw), (ph, pw), (oph, opw) = _pair(stride), _pair(padding), _pair(output_padding)
    n, c, h, w = data.shape
    ci, co, kh, kw = kernel.shape
    if ci != c:
        raise ValueError(f"conv2d_transpose: data has {c} channels but kernel expects {ci}")
    bh, bw = kh - 1 - ph, kw - 1 - pw
    if bh < 0 or bw < 0:
        raise ValueError(f"conv2d_transpose: padding {ph, pw} larger than kernel-1 {kh - 1, kw - 1} is unsupported")
    oh, ow = (h - 1) * sh - 2 * ph + kh + oph, (w - 1) * sw - 2 * pw + kw + opw
    dil = te.compute((n, c, oh + kh - 1, ow + kw - 1), lambda b, cc, y, x: te.if_then_else(
        te.all(y >= bh, x >= bw, (y - bh) % sh == 0 if sh > 1 else True, (x - bw) % sw == 0 if sw > 1 else True,
               (y - bh) // sh < h, (x - bw) // sw < w),
        data[b, cc, (y - bh) // sh, (x - bw) // sw], te.const(0, data.dtype)), name="data_pad")
    rc, ry, rx = te.reduce_axis(c, "rc"), te.reduce_axis(kh, "ry"), te.reduce_axis(kw, "rx")
    return te.compute((n, co, oh, ow), lambda b, f, y, x: te.sum(
        dil[b, rc, y + ry, x + rx] * kernel[rc, f, kh - 1 - ry, kw - 1 - rx], axis=[rc, ry, rx]), name=name)


def capsule_conv2d_nhwijc(data: Tensor, kernel: Tensor, stride=1, padding=0,
                          name: str = "conv2d_capsule_nhwijc") -> Tensor:
    """Capsule conv: data [N, H, W, cap, cap, CI], kernel [KH, KW, cap, cap, CI, CO]."""
    _check_rank(data, 6, "capsule_conv2d", "N H W cap cap CI")
    _check_rank(kernel, 6, "capsule_conv2d", "KH KW cap cap CI CO")
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    n, h, w, cap_i, cap_j, c = data.shape
    kh, kw, k_i, k_j, ci, co = kernel.shape
    if (cap_i, cap_j, ci) != (k_i, k_j, c) or cap_i != cap_j:
        raise ValueError(f"capsule_conv2d: data {list(data.shape)} and kernel {list(kernel.shape)} disagree")
    oh = _out_size(h, kh, sh, ph, ph, 1, "capsule height")
    ow = _out_size(w, kw, sw, pw, pw, 1, "capsule width")
    p = pad(data, (0, ph, pw, 0, 0, 0))
    ry, rx, rk, rc = te.reduce_axis(kh, "ry"), te.reduce_axis(kw, "rx"), te.reduce_axis(cap_j, "cap_k"), \
        te.reduce_axis(c, "rc")
    return te.compute((n, oh, ow, cap_i, cap_j, co), lambda b, y, x, i, j, f: te.sum(
        p[b, y * sh + ry, x * sw + rx, i, rk, rc] * kernel[ry, rx, rk, j, rc, f], axis=[ry, rx, rk, rc]), name=name)


# ------------------------------------------------------------------------------ reductions

def matrix_norm(data: Tensor, name: str = "T_norm") -> Tensor:
    """Frobenius (2-)norm of each matrix of a [B, M, N] batch."""
    _check_rank(data, 3, "norm", "B M N")
    b, m, n = data.shape
    i, j = te.reduce_axis(m, "i"), te.reduce_axis(n, "j")
    sq = te.compute((b,), lambda bb: te.sum(data[bb, i, j] * data[bb, i, j], axis=[i, j]), name="T_sum_sq")
    return te.compute((b,), lambda bb: te.sqrt(sq[bb]), name=name)


def softmax(x: Tensor, name: str = "T_softmax_norm") -> Tensor:
    """Softmax over the last axis, in TVM's four stages (max, exp, sum, normalise)."""
    outer, m = x.shape[:-1], x.shape[-1]
    k1, k2 = te.reduce_axis(m, "k"), te.reduce_axis(m, "k")
    mx = te.compute(outer, lambda *i: te.max(x[i + (k1,)], axis=k1), name="T_softmax_maxelem")
    ex = te.compute(x.shape, lambda *i: te.exp(x[i] - mx[i[:-1]]), name="T_softmax_exp")
    sm = te.compute(outer, lambda *i: te.sum(ex[i + (k2,)], axis=k2), name="T_softmax_expsum")
    return te.compute(x.shape, lambda *i: ex[i] / sm[i[:-1]], name=name)


def layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, eps: float = 1e-5, name: str = "T_layer_norm") -> Tensor:
    """Normalise over the last axis, then scale and shift."""
    outer, d = x.shape[:-1], x.shape[-1]
    if gamma.shape != (d,) or beta.shape != (d,):
        raise ValueError(f"layer_norm: gamma/beta must be [{d}], got {list(gamma.shape)}/{list(beta.shape)}")
    k1, k2 = te.reduce_axis(d, "k"), te.reduce_axis(d, "k")
    mean = te.compute(outer, lambda *i: te.sum(x[i + (k1,)] / float(d), axis=k1), name="T_mean")
    var = te.compute(outer, lambda *i: te.sum((x[i + (k2,)] - mean[i]) * (x[i + (k2,)] - mean[i]) / float(d),
                                              axis=k2), name="T_var")
    return te.compute(x.shape, lambda *i: (x[i] - mean[i[:-1]]) * te.rsqrt(var[i[:-1]] + eps) * gamma[i[-1]]
                      + beta[i[-1]], name=name)


def pool2d_nchw(data: Tensor, kernel, stride, padding=0, kind: str = "max", name: str | None = None) -> Tensor:
    """Max or average pooling (average counts the padding, as PyTorch's default does)."""
    _check_rank(data, 4, "pool2d", "NCHW")
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel), _pair(stride), _pair(padding)
    n, c, h, w = data.shape
    oh = _out_size(h, kh, sh, ph, ph, 1, "pool height")
    ow = _out_size(w, kw, sw, pw, pw, 1, "pool width")
    if kind not in ("max", "avg"):
        raise ValueError(f"pool2d: kind must be 'max' or 'avg', got {kind!r}")
    fill = -3.4028234663852886e38 if kind == "max" else 0.0
    p = pad(data, (0, 0, ph, pw), value=fill)
    ry, rx = te.reduce_axis(kh, "ry"), te.reduce_axis(kw, "rx")
    if kind == "max":
        return te.compute((n, c, oh, ow), lambda b, cc, y, x: te.max(p[b, cc, y * sh + ry, x * sw + rx],
                                                                   axis=[ry, rx]), name=name or "pool_max")
    s = te.compute((n, c, oh, ow), lambda b, cc, y, x: te.sum(p[b, cc, y * sh + ry, x * sw + rx], axis=[ry, rx]),
                   name="pool_sum")
    return te.compute(s.shape, lambda *i: s[i] / float(kh * kw), name=name or "pool_avg")


def global_avg_pool2d_nchw(data: Tensor, name: str = "global_avg_pool") -> Tensor:
    _check_rank(data, 4, "global_avg_pool2d", "NCHW")
    n, c, h, w = data.shape
    ry, rx = te.reduce_axis(h, "ry"), te.reduce_axis(w, "rx")
    s = te.compute((n, c, 1, 1), lambda b, cc, y, x: te.sum(data[b, cc, ry, rx], axis=[ry, rx]), name="pool_sum")
    return te.compute(s.shape, lambda *i: s[i] / float(h * w), name=name)
