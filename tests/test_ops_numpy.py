"""The operator library means what its names say: every op's DSL definition, evaluated by the
reference, matches an independent NumPy implementation written from the op's usual definition.

Every compiled kernel is checked against the DSL reference (tests/conftest.py::check_state); this
closes the loop, so a wrong operator definition cannot pass both.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tensortune.tasks.reference import evaluate
from tensortune.tasks.workload_registry import workload_signature
from tests.conftest import SMALL_WORKLOADS, small_dag

_WORKLOAD = {"batch_matmul_tb": "batch_matmul", "conv2d_nhwc": "conv2d", "elementwise_gelu": "elementwise",
             "elementwise_sigmoid": "elementwise"}


def _params(key: str) -> dict:
    bound = workload_signature(_WORKLOAD.get(key, key)).bind(*SMALL_WORKLOADS[key])
    bound.apply_defaults()
    return dict(bound.arguments)


def _conv_nchw(x, w, stride=1, pad=0, dilation=1, groups=1):
    """Direct convolution over any number of spatial dims: x [N, C, *S], w [CO, C/groups, *K]."""
    spatial = x.ndim - 2
    x = np.pad(x, [(0, 0), (0, 0)] + [(pad, pad)] * spatial)
    co, cig = w.shape[:2]
    kernel = w.shape[2:]
    out_sizes = [(x.shape[2 + d] - dilation * (kernel[d] - 1) - 1) // stride + 1 for d in range(spatial)]
    out = np.zeros((x.shape[0], co, *out_sizes))
    cog = co // groups
    for offset in np.ndindex(*kernel):
        window = tuple(slice(o * dilation, o * dilation + stride * (n - 1) + 1, stride)
                       for o, n in zip(offset, out_sizes))
        for g in range(groups):
            patch = x[(slice(None), slice(g * cig, (g + 1) * cig)) + window]
            taps = w[(slice(g * cog, (g + 1) * cog), slice(None)) + offset]
            out[:, g * cog:(g + 1) * cog] += np.einsum("nc...,oc->no...", patch, taps)
    return out


def _conv_transpose_nchw(x, w, stride, pad):
    """Scatter form: every input pixel adds its kernel-weighted footprint to the output."""
    n, ci, h, wd = x.shape
    _, co, kh, kw = w.shape
    full = np.zeros((n, co, (h - 1) * stride + kh, (wd - 1) * stride + kw))
    for y in range(h):
        for xx in range(wd):
            full[:, :, y * stride:y * stride + kh, xx * stride:xx * stride + kw] += np.einsum(
                "nc,cokl->nokl", x[:, :, y, xx], w)
    return full[:, :, pad:full.shape[2] - pad, pad:full.shape[3] - pad]


def _pool(x, k, stride, pad, kind):
    fill = -np.inf if kind == "max" else 0.0
    x = np.pad(x, [(0, 0), (0, 0), (pad, pad), (pad, pad)], constant_values=fill)
    oh, ow = (x.shape[2] - k) // stride + 1, (x.shape[3] - k) // stride + 1
    windows = np.stack([x[:, :, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride]
                        for i in range(k) for j in range(k)])
    return windows.max(axis=0) if kind == "max" else windows.sum(axis=0) / (k * k)


def _capsule(x, w, stride, pad):
    """out[n, y, x, i, j, f] = sum over the window, k, c of x[n, y', x', i, k, c] * w[ky, kx, k, j, c, f]."""
    kh, kw = w.shape[:2]
    x = np.pad(x, [(0, 0), (pad, pad), (pad, pad), (0, 0), (0, 0), (0, 0)])
    oh, ow = (x.shape[1] - kh) // stride + 1, (x.shape[2] - kw) // stride + 1
    out = 0
    for ky in range(kh):
        for kx in range(kw):
            patch = x[:, ky:ky + stride * (oh - 1) + 1:stride, kx:kx + stride * (ow - 1) + 1:stride]
            out = out + np.einsum("nyxikc,kjcf->nyxijf", patch, w[ky, kx])
    return out


def _numpy(key: str, p: dict, ins: list[np.ndarray]) -> np.ndarray:
    relu = lambda v: np.maximum(v, 0)  # noqa: E731
    if key == "matmul":
        return ins[0] @ ins[1]
    if key == "matmul_bias_relu":
        return relu(ins[0] @ ins[1] + ins[2])
    if key == "dense":
        out = ins[0] @ ins[1].T + (ins[2] if p["bias"] else 0)
        return relu(out) if p["relu"] else out
    if key in ("batch_matmul", "batch_matmul_tb"):
        return ins[0] @ (np.swapaxes(ins[1], 1, 2) if p["transpose_b"] else ins[1])
    if key == "conv1d":
        return _conv_nchw(ins[0], ins[1], p["stride"], p["padding"])
    if key == "conv2d":
        return _conv_nchw(ins[0], ins[1], p["stride"], p["padding"], p["dilation"])
    if key == "conv2d_nhwc":
        out = _conv_nchw(ins[0].transpose(0, 3, 1, 2), ins[1].transpose(3, 2, 0, 1), p["stride"], p["padding"],
                         p["dilation"])
        return out.transpose(0, 2, 3, 1)
    if key == "conv2d_relu":
        out = _conv_nchw(ins[0], ins[1], p["stride"], p["padding"])
        return relu(out + (ins[2][None, :, None, None] if p["bias"] else 0))
    if key == "conv3d":
        return _conv_nchw(ins[0], ins[1], p["stride"], p["padding"])
    if key == "group_conv2d":
        return _conv_nchw(ins[0], ins[1], p["stride"], p["padding"], groups=p["groups"])
    if key == "dilated_conv2d":
        return _conv_nchw(ins[0], ins[1], p["stride"], p["padding"], p["dilation"])
    if key == "depthwise_conv2d":   # kernel [C, mult, K, K]: output channel c * mult + m reads channel c
        c, mult = ins[1].shape[:2]
        return _conv_nchw(ins[0], ins[1].reshape(c * mult, 1, *ins[1].shape[2:]), p["stride"], p["padding"],
                          groups=c)
    if key == "conv2d_transpose":
        return _conv_transpose_nchw(ins[0], ins[1], p["stride"], p["padding"])
    if key == "capsule_conv2d":
        return _capsule(ins[0], ins[1], p["stride"], p["padding"])
    if key == "norm":
        return np.sqrt((ins[0] ** 2).sum(axis=(1, 2)))
    if key == "softmax":
        e = np.exp(ins[0] - ins[0].max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if key == "layer_norm":
        x, gamma, beta = ins
        mean, var = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-5) * gamma + beta
    if key in ("max_pool2d", "avg_pool2d"):
        return _pool(ins[0], p["K"], p["stride"], p["padding"], key[:3])
    if key == "elementwise":
        return relu(ins[0] + ins[1])
    if key == "elementwise_gelu":
        return ins[0] * 0.5 * (1 + np.vectorize(math.erf)(ins[0] / math.sqrt(2)))
    if key == "elementwise_sigmoid":
        return 1 / (1 + np.exp(-ins[0]))
    raise KeyError(f"no NumPy definition for {key}: add one when adding a workload to SMALL_WORKLOADS")


@pytest.mark.parametrize("key", sorted(SMALL_WORKLOADS))
def test_op_definition_matches_numpy(key):
    dag = small_dag(key)
    inputs = dag.random_inputs(seed=11)
    (got,) = evaluate(dag, inputs)
    want = _numpy(key, _params(key), [x.astype(np.float64) for x in inputs])
    assert got.shape == want.shape, f"{key}: shape {got.shape}, NumPy gives {want.shape}"
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=key)


def test_dense_with_relu_and_the_min_reducer_match_numpy():
    # Paths no SMALL_WORKLOADS entry takes: dense's relu epilogue, and te.min as a reducer.
    from tensortune.tasks import te
    from tensortune.tasks.compute_dag import ComputeDAG
    from tensortune.tasks.workload_registry import make_dag
    dag = make_dag("dense", 3, 16, 8, True, True)
    inputs = dag.random_inputs(seed=2)
    (got,) = evaluate(dag, inputs)
    np.testing.assert_allclose(got, np.maximum(inputs[0] @ inputs[1].T + inputs[2], 0), rtol=1e-5, atol=1e-6)
    a = te.placeholder((5, 9), "float32", "A")
    k = te.reduce_axis(9, "k")
    dag = ComputeDAG([a, te.compute((5,), lambda i: te.min(a[i, k], axis=k), name="rowmin")])
    x = dag.random_inputs(seed=3)[0]
    np.testing.assert_array_equal(evaluate(dag, [x])[0], x.min(axis=1))
