"""Channels-last (NHWC) forms of the network operators whose layout decides how they vectorise.

A conv in NCHW writes its output rows along the width, so the innermost loop a CPU schedule can
vectorise is the output width: 7 or 14 of 16 AVX-512 lanes in ResNet's later stages. In NHWC the
innermost output axis is the channel, a multiple of the vector width in every network we tune, and
a tile of a few pixels by a few channel vectors is the register block of a direct convolution.
`tasks.channels_last` rewrites a network's NCHW convs and pools into these; the graph ops
`conv2d_nhwc` and the `*_pool2d_nhwc` ops (tasks.graph_ops) build through them.

Weights are HWIO: [KH, KW, CI/groups, CO]; depthwise convs (groups == channels, one output channel
per input channel) take [KH, KW, 1, C]. Pads are (top, left, bottom, right).
"""
from __future__ import annotations

from typing import Sequence

from tensortune.tasks import te
from tensortune.tasks.network_ops import window_count
from tensortune.tasks.ops import _check_rank, _out_size, conv2d_nhwc, pad
from tensortune.tasks.te import Tensor

_LOWEST = -3.4028234663852886e38


def _padded(data: Tensor, pads: Sequence[int], fill: float = 0.0) -> Tensor:
    pt, pl, pb, pr = pads
    return pad(data, (0, pt, pl, 0), (0, pb, pr, 0), fill)


def conv2d(data: Tensor, kernel: Tensor, strides: Sequence[int], pads: Sequence[int], dilations: Sequence[int],
           name: str = "conv2d_nhwc") -> Tensor:
    """A dense (groups 1) conv2d, NHWC data and HWIO kernel."""
    pt, pl, pb, pr = pads
    if (pt, pl) == (pb, pr):
        return conv2d_nhwc(data, kernel, tuple(strides), (pt, pl), tuple(dilations), name=name)
    return conv2d_nhwc(_padded(data, pads), kernel, tuple(strides), 0, tuple(dilations), name=name)


def depthwise_conv2d(data: Tensor, kernel: Tensor, strides: Sequence[int], pads: Sequence[int],
                     dilations: Sequence[int], name: str = "depthwise_conv2d_nhwc") -> Tensor:
    """One filter per channel: data NHWC, kernel [KH, KW, C] (the HWIO weight [KH, KW, 1, C] viewed)."""
    _check_rank(data, 4, "depthwise_conv2d", "NHWC")
    _check_rank(kernel, 3, "depthwise_conv2d", "KH KW C")
    (sh, sw), (dh, dw) = strides, dilations
    n, h, w, c = data.shape
    kh, kw, kc = kernel.shape
    if kc != c:
        raise ValueError(f"depthwise_conv2d: data has {c} channels but kernel has {kc}")
    pt, pl, pb, pr = pads
    oh = _out_size(h, kh, sh, pt, pb, dh, "depthwise height")
    ow = _out_size(w, kw, sw, pl, pr, dw, "depthwise width")
    p = _padded(data, pads)
    ry, rx = te.reduce_axis(kh, "ry"), te.reduce_axis(kw, "rx")
    return te.compute((n, oh, ow, c), lambda b, y, x, f: te.sum(
        p[b, y * sh + ry * dh, x * sw + rx * dw, f] * kernel[ry, rx, f], axis=[ry, rx]), name=name)


def pool2d(data: Tensor, kernel: Sequence[int], strides: Sequence[int], pads: Sequence[int], kind: str = "max",
           count_include_pad: bool = True, name: str | None = None) -> Tensor:
    """Max or average pooling of NHWC data; the exclusive average (count_include_pad False) divides by
    the in-bounds elements of each window, as network_ops.pool2d_nchw does."""
    _check_rank(data, 4, "pool2d", "NHWC")
    if kind not in ("max", "avg"):
        raise ValueError(f"pool2d: kind must be 'max' or 'avg', got {kind!r}")
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = kernel, strides, pads
    n, h, w, c = data.shape
    oh = _out_size(h, kh, sh, pt, pb, 1, "pool height")
    ow = _out_size(w, kw, sw, pl, pr, 1, "pool width")
    src = _padded(data, pads, _LOWEST if kind == "max" else 0.0)
    ry, rx = te.reduce_axis(kh, "ry"), te.reduce_axis(kw, "rx")
    if kind == "max":
        return te.compute((n, oh, ow, c), lambda b, y, x, f: te.max(src[b, y * sh + ry, x * sw + rx, f],
                                                                   axis=[ry, rx]), name=name or "pool_max")
    total = te.compute((n, oh, ow, c), lambda b, y, x, f: te.sum(src[b, y * sh + ry, x * sw + rx, f],
                                                                axis=[ry, rx]), name="pool_sum")
    if count_include_pad or not any(pads):
        return te.compute(total.shape, lambda *i: total[i] / float(kh * kw), name=name or "pool_avg")

    return te.compute(total.shape, lambda b, y, x, f: total[b, y, x, f] / window_count(
        y, x, kernel, strides, pads, (h, w), data.dtype), name=name or "pool_avg")


def global_avg_pool2d(data: Tensor, name: str = "global_avg_pool") -> Tensor:
    """The mean over rows and columns of NHWC data: [N, 1, 1, C]."""
    _check_rank(data, 4, "global_avg_pool2d", "NHWC")
    n, h, w, c = data.shape
    ry, rx = te.reduce_axis(h, "ry"), te.reduce_axis(w, "rx")
    s = te.compute((n, 1, 1, c), lambda b, y, x, f: te.sum(data[b, ry, rx, f], axis=[ry, rx]), name="pool_sum")
    return te.compute(s.shape, lambda *i: s[i] / float(h * w), name=name)
