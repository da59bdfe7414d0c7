"""Operator builders that networks need beyond the TOPI-style library in `tasks.ops`.

Layout and data-movement ops (transpose, strided slice, gather, concat), numpy-semantics matmul over
any number of batch dimensions, pooling with asymmetric padding and ONNX's exclusive average, and
inference batch norm as a per-channel scale and shift. Like `tasks.ops`, each checks its shapes and
raises a ValueError naming what is wrong.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from tensortune.tasks import te
from tensortune.tasks.ops import broadcast_shape
from tensortune.tasks.te import Tensor


def _broadcast_index(t: Tensor, idx: tuple, out_shape: tuple) -> tuple:
    off = len(out_shape) - t.ndim
    return tuple(0 if t.shape[d] == 1 and out_shape[off + d] != 1 else idx[off + d] for d in range(t.ndim))


def broadcast_binary(a: Tensor | float, b: Tensor | float, fn: Callable, name: str) -> Tensor:
    """out = fn(a, b) with numpy broadcasting; either side may be a Python scalar (a folded constant)."""
    if not isinstance(a, Tensor) and not isinstance(b, Tensor):
        raise ValueError(f"{name}: at least one operand must be a tensor")
    if not isinstance(b, Tensor):
        assert isinstance(a, Tensor)
        return te.compute(a.shape, lambda *i: fn(a[i], te.const(b, a.dtype)), name=name)
    if not isinstance(a, Tensor):
        return te.compute(b.shape, lambda *i: fn(te.const(a, b.dtype), b[i]), name=name)
    shape = broadcast_shape(a.shape, b.shape)
    return te.compute(shape, lambda *i: fn(a[_broadcast_index(a, i, shape)], b[_broadcast_index(b, i, shape)]),
                      name=name)


def matmul_nd(a: Tensor, b: Tensor, name: str = "T_matmul") -> Tensor:
    """numpy.matmul for rank >= 2 operands: batch dimensions broadcast, the last two multiply."""
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul: needs rank >= 2 operands, got {list(a.shape)} and {list(b.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: {list(a.shape)} x {list(b.shape)} do not chain (inner {a.shape[-1]} vs "
                         f"{b.shape[-2]})")
    batch = broadcast_shape(a.shape[:-2], b.shape[:-2])
    nb = len(batch)
    k = te.reduce_axis(a.shape[-1], "k")

    def operand_index(t: Tensor, idx: tuple, last_two: tuple) -> tuple:
        off = nb - (t.ndim - 2)
        lead = tuple(0 if t.shape[d] == 1 and batch[off + d] != 1 else idx[off + d] for d in range(t.ndim - 2))
        return lead + last_two

    def f(*idx):
        i, j = idx[nb], idx[nb + 1]
        return te.sum(a[operand_index(a, idx, (i, k))] * b[operand_index(b, idx, (k, j))], axis=k)
    return te.compute(batch + (a.shape[-2], b.shape[-1]), f, name=name)


def transpose(x: Tensor, perm: Sequence[int], name: str = "T_transpose") -> Tensor:
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"transpose: perm {list(perm)} is not a permutation of 0..{x.ndim - 1}")
    inverse = [0] * x.ndim
    for out_axis, in_axis in enumerate(perm):
        inverse[in_axis] = out_axis
    return te.compute(tuple(x.shape[p] for p in perm), lambda *i: x[tuple(i[inverse[d]] for d in range(x.ndim))],
                      name=name)


def strided_slice(x: Tensor, begin: Sequence[int], step: Sequence[int], out_shape: Sequence[int],
                  name: str = "T_strided_slice") -> Tensor:
    """out[i] = x[begin + i * step] per axis (the graph resolves ends into `out_shape`)."""
    if not (len(begin) == len(step) == len(out_shape) == x.ndim):
        raise ValueError(f"strided_slice: begin/step/shape need {x.ndim} entries, got {begin}/{step}/{out_shape}")
    for d, (b, s, n) in enumerate(zip(begin, step, out_shape)):
        last = b + (n - 1) * s
        if not (0 <= b < x.shape[d] and 0 <= last < x.shape[d]):
            raise ValueError(f"strided_slice: axis {d} reads {b}..{last} of a dimension of size {x.shape[d]}")
    return te.compute(tuple(out_shape), lambda *i: x[tuple(b + ax * s if s != 1 else ax + b
                                                        for ax, b, s in zip(i, begin, step))], name=name)


def gather(data: Tensor, indices: Tensor, axis: int = 0, name: str = "T_take") -> Tensor:
    """out[..., j..., ...] = data[..., indices[j...], ...]; negative indices wrap, others are clamped."""
    axis = axis % data.ndim
    if te.is_float(indices.dtype) or indices.dtype == "bool":
        raise ValueError(f"gather: indices must be integers, got {indices.dtype}")
    n = data.shape[axis]
    shape = data.shape[:axis] + indices.shape + data.shape[axis + 1:]

    def f(*i):
        raw = te.cast("int64", indices[i[axis: axis + indices.ndim]])
        wrapped = te.if_then_else(raw < 0, raw + n, raw)
        safe = te.maximum(te.minimum(wrapped, te.const(n - 1, "int64")), te.const(0, "int64"))
        return data[i[:axis] + (safe,) + i[axis + indices.ndim:]]
    return te.compute(shape, f, name=name)


def concat(xs: Sequence[Tensor], axis: int, name: str = "T_concat") -> Tensor:
    if not xs:
        raise ValueError("concat: needs at least one tensor")
    rank = xs[0].ndim
    axis = axis % rank
    for x in xs[1:]:
        if x.ndim != rank or any(a != b for d, (a, b) in enumerate(zip(x.shape, xs[0].shape)) if d != axis):
            raise ValueError(f"concat: shapes {[list(t.shape) for t in xs]} differ outside axis {axis}")
    offsets = [0]
    for x in xs:
        offsets.append(offsets[-1] + x.shape[axis])
    shape = xs[0].shape[:axis] + (offsets[-1],) + xs[0].shape[axis + 1:]

    def f(*i):
        def part(k):
            return xs[k][i[:axis] + (i[axis] - offsets[k],) + i[axis + 1:]]
        out = part(len(xs) - 1)
        for k in range(len(xs) - 2, -1, -1):      # inputs before the last: select by the next offset
            out = te.if_then_else(i[axis] < offsets[k + 1], part(k), out)
        return out
    return te.compute(shape, f, name=name)


def pool2d_nchw(data: Tensor, kernel: Sequence[int], stride: Sequence[int], pads: Sequence[int], kind: str = "max",
                count_include_pad: bool = True, name: str | None = None) -> Tensor:
    """Max or average pooling with pads (top, left, bottom, right); the exclusive average divides by
    the number of in-bounds elements of each window (ONNX's count_include_pad=0)."""
    if data.ndim != 4:
        raise ValueError(f"pool2d: data must be NCHW, got shape {list(data.shape)}")
    if kind not in ("max", "avg"):
        raise ValueError(f"pool2d: kind must be 'max' or 'avg', got {kind!r}")
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = kernel, stride, pads
    n, c, h, w = data.shape
    oh, ow = (h + pt + pb - kh) // sh + 1, (w + pl + pr - kw) // sw + 1
    if oh <= 0 or ow <= 0:
        raise ValueError(f"pool2d: kernel {kh}x{kw} does not fit input {h}x{w} with pads {list(pads)}")
    fill = -3.4028234663852886e38 if kind == "max" else 0.0
    if any((pt, pl, pb, pr)):
        def padded(b, cc, y, x):
            return te.if_then_else(te.all(y >= pt, y < pt + h, x >= pl, x < pl + w),
                                   data[b, cc, y - pt, x - pl], te.const(fill, data.dtype))
        src = te.compute((n, c, h + pt + pb, w + pl + pr), padded, name="pad_temp")
    else:
        src = data
    ry, rx = te.reduce_axis(kh, "ry"), te.reduce_axis(kw, "rx")
    if kind == "max":
        return te.compute((n, c, oh, ow), lambda b, cc, y, x: te.max(src[b, cc, y * sh + ry, x * sw + rx],
                                                                   axis=[ry, rx]), name=name or "pool_max")
    total = te.compute((n, c, oh, ow), lambda b, cc, y, x: te.sum(src[b, cc, y * sh + ry, x * sw + rx],
                                                                 axis=[ry, rx]), name="pool_sum")
    if count_include_pad or not any((pt, pl, pb, pr)):
        return te.compute(total.shape, lambda *i: total[i] / float(kh * kw), name=name or "pool_avg")

    return te.compute(total.shape, lambda b, cc, y, x: total[b, cc, y, x] / window_count(
        y, x, kernel, stride, pads, (h, w), data.dtype), name=name or "pool_avg")


def window_count(y, x, kernel: Sequence[int], stride: Sequence[int], pads: Sequence[int], size: Sequence[int],
                 dtype: str):
    """The in-bounds elements of the pooling window of output (y, x) over a (h, w) input padded by
    (top, left, bottom, right): what ONNX's exclusive average (count_include_pad=0) divides by."""
    (kh, kw), (sh, sw), (pt, pl, _, _), (h, w) = kernel, stride, pads, size
    rows = te.minimum(y * sh + kh, te.const(pt + h, "int64")) - te.maximum(y * sh, te.const(pt, "int64"))
    cols = te.minimum(x * sw + kw, te.const(pl + w, "int64")) - te.maximum(x * sw, te.const(pl, "int64"))
    return te.cast(dtype, rows * cols)


def batch_norm_inference(x: Tensor, gamma: Tensor, beta: Tensor, mean: Tensor, var: Tensor, eps: float = 1e-5,
                         name: str = "T_batch_norm") -> Tensor:
    """(x - mean) / sqrt(var + eps) * gamma + beta over axis 1 (for statistics that are not constants;
    constant statistics are folded into a scale and shift before extraction)."""
    c = x.shape[1] if x.ndim >= 2 else 0
    for what, t in (("gamma", gamma), ("beta", beta), ("mean", mean), ("var", var)):
        if t.shape != (c,):
            raise ValueError(f"batch_norm: {what} must have shape [{c}], got {list(t.shape)}")
    return te.compute(x.shape, lambda *i: (x[i] - mean[i[1]]) * te.rsqrt(var[i[1]] + eps) * gamma[i[1]]
                      + beta[i[1]], name=name)


def reduce(x: Tensor, axes: Sequence[int], keepdims: bool = True, kind: str = "sum", name: str | None = None) -> Tensor:
    """Sum, mean, max or min over `axes` (numpy semantics, keepdims or not)."""
    axes = sorted({a % x.ndim for a in axes})
    if kind not in ("sum", "mean", "max", "min"):
        raise ValueError(f"reduce: kind must be 'sum', 'mean', 'max' or 'min', got {kind!r}")
    combine = {"max": te.max, "min": te.min}.get(kind, te.sum)
    red = {a: te.reduce_axis(x.shape[a], f"k{a}") for a in axes}
    keep = [d for d in range(x.ndim) if d not in red]
    shape = tuple(1 if d in red else x.shape[d] for d in range(x.ndim)) if keepdims else tuple(x.shape[d] for d in keep)
    count = 1
    for a in axes:
        count *= x.shape[a]

    def f(*i):
        if keepdims:
            idx = tuple(red[d] if d in red else i[d] for d in range(x.ndim))
        else:
            it = iter(i)
            idx = tuple(red[d] if d in red else next(it) for d in range(x.ndim))
        return combine(x[idx], axis=[red[a] for a in axes])
    total = te.compute(shape, f, name=name or f"T_reduce_{kind}" if kind != "mean" else "T_reduce_sum")
    if kind != "mean":
        return total
    return te.compute(shape, lambda *i: total[i] / float(count), name=name or "T_reduce_mean")


def log_softmax(x: Tensor, name: str = "T_log_softmax") -> Tensor:
    """log(softmax(x)) over the last axis as x - max - log(sum(exp(x - max))): never log(0)."""
    outer, m = x.shape[:-1], x.shape[-1]
    k1, k2 = te.reduce_axis(m, "k"), te.reduce_axis(m, "k")
    mx = te.compute(outer, lambda *i: te.max(x[i + (k1,)], axis=k1), name="T_log_softmax_maxelem")
    sm = te.compute(outer, lambda *i: te.sum(te.exp(x[i + (k2,)] - mx[i]), axis=k2), name="T_log_softmax_expsum")
    return te.compute(x.shape, lambda *i: x[i] - mx[i[:-1]] - te.log(sm[i[:-1]]), name=name)


def lrn(x: Tensor, size: int, alpha: float, beta: float, bias: float, name: str = "T_lrn") -> Tensor:
    """ONNX/Caffe local response normalisation across channels (axis 1), as TOPI's `lrn`: the squares
    summed over a window of `size` channels (zero outside), then x / (bias + alpha/size * sum)^beta."""
    if x.ndim < 3:
        raise ValueError(f"lrn: {x.name} needs channels on axis 1 and spatial axes, got {list(x.shape)}")
    lo = (size - 1) // 2
    c = x.shape[1]
    k = te.reduce_axis(size, "rk")

    def window(*i):
        ch = i[1] + k - lo
        v = te.if_then_else(te.all(ch >= 0, ch < c), x[(i[0], ch) + i[2:]], te.const(0.0, x.dtype))
        return te.sum(v * v, axis=k)
    sq = te.compute(x.shape, window, name="T_lrn_sqr_sum")
    return te.compute(x.shape, lambda *i: x[i] / te.power(bias + alpha / size * sq[i], te.const(beta, x.dtype)),
                      name=name)


def pad_mode(x: Tensor, before: Sequence[int], after: Sequence[int], mode: str, name: str = "T_pad") -> Tensor:
    """Reflect or edge padding (numpy's "reflect" / "edge"), one stage per padded axis: each output
    index reads the input under a guard that keeps it in bounds (the left, middle and right parts)."""
    if mode not in ("reflect", "edge"):
        raise ValueError(f"pad_mode: mode {mode!r} (use tasks.ops.pad for constant padding)")
    out = x
    axes = [d for d in range(x.ndim) if before[d] or after[d]]
    for n_done, d in enumerate(axes):
        src, b, n = out, before[d], x.shape[d]
        shape = src.shape[:d] + (n + before[d] + after[d],) + src.shape[d + 1:]

        def f(*i, src=src, d=d, b=b, n=n):
            j = i[d] - b

            def at(v):
                return src[i[:d] + (v,) + i[d + 1:]]
            if mode == "edge":
                left, right = at(0), at(n - 1)
            else:
                left, right = at(-j), at(2 * (n - 1) - j)
            return te.if_then_else(j < 0, left, te.if_then_else(j < n, at(j), right))
        out = te.compute(shape, f, name=name if n_done == len(axes) - 1 else f"{name}_axis{d}")
    return out


def tile(x: Tensor, repeats: Sequence[int], name: str = "T_tile") -> Tensor:
    shape = tuple(n * r for n, r in zip(x.shape, repeats))
    return te.compute(shape, lambda *i: x[tuple(v % n if r > 1 else v for v, n, r in zip(i, x.shape, repeats))],
                      name=name)


def _pad_spatial(data: Tensor, pads: Sequence[int], fill: float) -> Tensor:
    """data padded on its spatial axes (2..) by pads (begins..., ends...) with `fill`."""
    r = data.ndim - 2
    if not any(pads):
        return data
    shape = data.shape[:2] + tuple(data.shape[2 + i] + pads[i] + pads[r + i] for i in range(r))

    def f(*i):
        inside = [c for k in range(r) for c in (i[2 + k] >= pads[k], i[2 + k] < pads[k] + data.shape[2 + k])]
        src = i[:2] + tuple(i[2 + k] - pads[k] for k in range(r))
        return te.if_then_else(te.all(*inside), data[src], te.const(fill, data.dtype))
    return te.compute(shape, f, name="pad_temp")


def conv3d_ncdhw(data: Tensor, kernel: Tensor, strides: Sequence[int], pads: Sequence[int],
                 dilations: Sequence[int], groups: int = 1, name: str = "conv3d_ncdhw") -> Tensor:
    """Grouped, dilated 3-D convolution with pads (front, top, left, back, bottom, right);
    kernel [CO, CI/groups, KD, KH, KW]."""
    if data.ndim != 5 or kernel.ndim != 5:
        raise ValueError(f"conv3d: data and kernel must be 5-d, got {list(data.shape)} and {list(kernel.shape)}")
    n, c = data.shape[:2]
    co, cig = kernel.shape[:2]
    k = kernel.shape[2:]
    if c % groups or co % groups or cig * groups != c:
        raise ValueError(f"conv3d: {c} channels, kernel {list(kernel.shape)}, groups={groups} do not agree")
    p = _pad_spatial(data, pads, 0.0)
    out = tuple((p.shape[2 + i] - dilations[i] * (k[i] - 1) - 1) // strides[i] + 1 for i in range(3))
    if min(out) <= 0:
        raise ValueError(f"conv3d: kernel {list(k)} does not fit input {list(data.shape[2:])} with pads {list(pads)}")
    rc, rz, ry, rx = (te.reduce_axis(cig, "rc"), te.reduce_axis(k[0], "rz"), te.reduce_axis(k[1], "ry"),
                      te.reduce_axis(k[2], "rx"))
    cog = co // groups
    (sd, sh, sw), (dd, dh, dw) = strides, dilations

    def f(b, ff, z, y, x):
        ch = rc if groups == 1 else ff // cog * cig + rc
        return te.sum(p[b, ch, z * sd + rz * dd, y * sh + ry * dh, x * sw + rx * dw] * kernel[ff, rc, rz, ry, rx],
                      axis=[rc, rz, ry, rx])
    return te.compute((n, co) + out, f, name=name)


def pool3d_ncdhw(data: Tensor, kernel: Sequence[int], strides: Sequence[int], pads: Sequence[int],
                 kind: str = "max", count_include_pad: bool = True, name: str | None = None) -> Tensor:
    """Max or average 3-D pooling; the exclusive average divides by each window's in-bounds count."""
    if data.ndim != 5:
        raise ValueError(f"pool3d: data must be NCDHW, got shape {list(data.shape)}")
    src = _pad_spatial(data, pads, -3.4028234663852886e38 if kind == "max" else 0.0)
    out = tuple((src.shape[2 + i] - kernel[i]) // strides[i] + 1 for i in range(3))
    rz, ry, rx = te.reduce_axis(kernel[0], "rz"), te.reduce_axis(kernel[1], "ry"), te.reduce_axis(kernel[2], "rx")

    def window(b, cc, z, y, x):
        return src[b, cc, z * strides[0] + rz, y * strides[1] + ry, x * strides[2] + rx]
    shape = data.shape[:2] + out
    if kind == "max":
        return te.compute(shape, lambda *i: te.max(window(*i), axis=[rz, ry, rx]), name=name or "pool3d_max")
    total = te.compute(shape, lambda *i: te.sum(window(*i), axis=[rz, ry, rx]), name="pool3d_sum")
    if count_include_pad or not any(pads):
        return te.compute(shape, lambda *i: total[i] / float(math.prod(kernel)), name=name or "pool3d_avg")

    def count(*sp):
        n_in = None
        for k in range(3):
            lo, size = pads[k], data.shape[2 + k]
            span = (te.minimum(sp[k] * strides[k] + kernel[k], te.const(lo + size, "int64"))
                    - te.maximum(sp[k] * strides[k], te.const(lo, "int64")))
            n_in = span if n_in is None else n_in * span
        return te.cast(data.dtype, n_in)
    return te.compute(shape, lambda b, cc, *sp: total[(b, cc) + sp] / count(*sp), name=name or "pool3d_avg")


def broadcast_to(x: Tensor, shape: Sequence[int], name: str = "T_broadcast_to") -> Tensor:
    """x repeated along its size-1 (and missing leading) axes to `shape` (numpy broadcasting)."""
    shape = tuple(shape)
    if broadcast_shape(x.shape, shape) != shape:
        raise ValueError(f"broadcast_to: {list(x.shape)} does not broadcast to {list(shape)}")
    return te.compute(shape, lambda *i: x[_broadcast_index(x, i, shape)], name=name)


def where(cond: Tensor, x: Tensor, y: Tensor, name: str = "T_where") -> Tensor:
    """x where cond else y, the three broadcast together (numpy's where)."""
    shape = broadcast_shape(broadcast_shape(cond.shape, x.shape), y.shape)
    return te.compute(shape, lambda *i: te.if_then_else(cond[_broadcast_index(cond, i, shape)],
                                                        x[_broadcast_index(x, i, shape)],
                                                        y[_broadcast_index(y, i, shape)]), name=name)
