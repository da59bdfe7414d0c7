"""Registered workloads: the Ansor paper's single-operator set plus the common fused subgraphs.

`PAPER_SHAPES` holds the four shapes per operator of the paper's single-op benchmark (batch 1);
each workload's defaults are the first of them.
"""
from __future__ import annotations

from typing import Callable

from tensortune.tasks import ops, te, winograd

# name -> function returning [inputs..., outputs...]; tasks.workload_registry serves these by name
LIBRARY: dict[str, Callable[..., list[te.Tensor]]] = {}


def workload(name: str) -> Callable:
    """Add the function to the operator library under `name`."""
    def add(fn: Callable[..., list[te.Tensor]]) -> Callable[..., list[te.Tensor]]:
        LIBRARY[name] = fn
        return fn
    return add

PAPER_SHAPES: dict[str, tuple[str, list[tuple]]] = {
    # code: (workload, [args...])
    "C1D": ("conv1d", [(1, 256, 64, 128, 3, 2, 1), (1, 128, 128, 256, 1, 2, 0),
                       (1, 64, 256, 256, 5, 1, 2), (1, 32, 512, 512, 3, 1, 1)]),
    "C2D": ("conv2d", [(1, 224, 224, 3, 64, 7, 7, 2, 3), (1, 56, 56, 64, 64, 1, 1, 1, 0),
                       (1, 14, 14, 256, 256, 3, 3, 1, 1), (1, 7, 7, 512, 512, 3, 3, 1, 1)]),
    "C3D": ("conv3d", [(1, 16, 224, 224, 3, 64, 7, 7, 7, 2, 3), (1, 16, 56, 56, 64, 64, 1, 1, 1, 1, 0),
                       (1, 16, 14, 14, 256, 256, 3, 3, 3, 1, 1), (1, 16, 7, 7, 512, 512, 3, 3, 3, 1, 1)]),
    "GMM": ("matmul", [(128, 128, 128), (512, 32, 512), (512, 512, 512), (1024, 1024, 1024)]),
    "GRP": ("group_conv2d", [(1, 56, 56, 64, 128, 3, 3, 2, 1, 4), (1, 28, 28, 128, 256, 3, 3, 2, 1, 4),
                             (1, 14, 14, 256, 512, 3, 3, 2, 1, 4), (1, 7, 7, 512, 512, 3, 3, 1, 1, 4)]),
    "DIL": ("dilated_conv2d", [(1, 224, 224, 3, 64, 7, 7, 2, 3, 2), (1, 56, 56, 64, 64, 3, 3, 1, 2, 2),
                               (1, 14, 14, 256, 256, 3, 3, 1, 2, 2), (1, 7, 7, 512, 512, 3, 3, 1, 2, 2)]),
    "DEP": ("depthwise_conv2d", [(1, 112, 112, 32, 3, 1, 1), (1, 56, 56, 128, 3, 2, 1),
                                 (1, 28, 28, 256, 3, 1, 1), (1, 14, 14, 512, 3, 2, 1)]),
    "T2D": ("conv2d_transpose", [(1, 4, 4, 512, 256, 4, 4, 2, 1), (1, 8, 8, 256, 128, 4, 4, 2, 1),
                                 (1, 16, 16, 128, 64, 4, 4, 2, 1), (1, 32, 32, 64, 3, 4, 4, 2, 1)]),
    "CAP": ("capsule_conv2d", [(1, 16, 16, 32, 32, 3, 3, 2, 1, 4), (1, 8, 8, 32, 32, 3, 3, 1, 1, 4),
                               (1, 16, 16, 8, 16, 3, 3, 2, 1, 4), (1, 8, 8, 16, 16, 3, 3, 1, 1, 4)]),
    "NRM": ("norm", [(1, 256, 256), (1, 512, 512), (1, 1024, 1024), (1, 4096, 1024)]),
}


@workload("matmul")
def matmul(N: int = 128, M: int = 128, K: int = 128, dtype: str = "float32"):
    a = te.placeholder((N, K), dtype, "A")
    b = te.placeholder((K, M), dtype, "B")
    return [a, b, ops.matmul(a, b, name="C")]


@workload("matmul_bias_relu")
def matmul_bias_relu(N: int = 1024, M: int = 1024, K: int = 1024, dtype: str = "float32"):
    a = te.placeholder((N, K), dtype, "A")
    b = te.placeholder((K, M), dtype, "B")
    bias = te.placeholder((M,), dtype, "bias")
    c = ops.matmul(a, b, name="C")
    return [a, b, bias, ops.relu(ops.bias_add(c, bias, axis=1))]


@workload("matmul_add")
def matmul_add(N: int = 1024, M: int = 1024, K: int = 1024, dtype: str = "float32"):
    """A @ B + C: the workload of TVM's auto-scheduler tutorial (its `matmul_add(N, L, M)` with L = K),
    so a schedule from its log has a task here (tasks.tvm_workloads)."""
    a = te.placeholder((N, K), dtype, "A")
    b = te.placeholder((K, M), dtype, "B")
    c = te.placeholder((N, M), dtype, "C")
    return [a, b, c, ops.add(ops.matmul(a, b), c, name="out")]


@workload("dense")
def dense(batch: int = 1, in_features: int = 512, out_features: int = 1000, bias: bool = True,
          relu: bool = False, dtype: str = "float32"):
    x = te.placeholder((batch, in_features), dtype, "data")
    w = te.placeholder((out_features, in_features), dtype, "weight")
    args, out = [x, w], ops.dense(x, w)
    if bias:
        b = te.placeholder((out_features,), dtype, "bias")
        args.append(b)
        out = ops.bias_add(out, b, axis=1)
    if relu:
        out = ops.relu(out)
    return args + [out]


@workload("batch_matmul")
def batch_matmul(B: int = 12, N: int = 128, M: int = 128, K: int = 64, transpose_b: bool = False,
                 dtype: str = "float32"):
    a = te.placeholder((B, N, K), dtype, "A")
    b = te.placeholder((B, M, K) if transpose_b else (B, K, M), dtype, "B")
    return [a, b, ops.batch_matmul(a, b, transpose_b)]


@workload("conv1d")
def conv1d(N: int = 1, L: int = 256, CI: int = 64, CO: int = 128, KW: int = 3, stride: int = 2,
           padding: int = 1, dtype: str = "float32"):
    data = te.placeholder((N, CI, L), dtype, "data")
    kernel = te.placeholder((CO, CI, KW), dtype, "kernel")
    return [data, kernel, ops.conv1d_ncw(data, kernel, stride, padding)]


@workload("conv2d")
def conv2d(N: int = 1, H: int = 224, W: int = 224, CI: int = 3, CO: int = 64, KH: int = 7, KW: int = 7,
           stride: int = 2, padding: int = 3, dilation: int = 1, layout: str = "NCHW", dtype: str = "float32"):
    if layout == "NCHW":
        data = te.placeholder((N, CI, H, W), dtype, "data")
        kernel = te.placeholder((CO, CI, KH, KW), dtype, "kernel")
        return [data, kernel, ops.conv2d_nchw(data, kernel, stride, padding, dilation)]
    if layout == "NHWC":
        data = te.placeholder((N, H, W, CI), dtype, "data")
        kernel = te.placeholder((KH, KW, CI, CO), dtype, "kernel")
        return [data, kernel, ops.conv2d_nhwc(data, kernel, stride, padding, dilation)]
    raise ValueError(f"conv2d layout must be NCHW or NHWC, got {layout!r}")


@workload("conv2d_relu")
def conv2d_relu(N: int = 1, H: int = 56, W: int = 56, CI: int = 64, CO: int = 64, KH: int = 3, KW: int = 3,
                stride: int = 1, padding: int = 1, bias: bool = False, dtype: str = "float32", layout: str = "NCHW"):
    """The ResNet-18 layer of the benchmarks: relu(conv2d(data, kernel) [+ bias]); NHWC (kernel HWIO)
    is the layout tensortune's networks run their convs in (tasks.channels_last)."""
    data, kernel, out = conv2d(N, H, W, CI, CO, KH, KW, stride, padding, 1, layout, dtype)
    channel_axis = 1 if layout == "NCHW" else 3
    args = [data, kernel]
    if bias:
        b = te.placeholder((CO,), dtype, "bias")
        args.append(b)
        out = ops.bias_add(out, b, axis=channel_axis)
    return args + [ops.relu(out)]


@workload("conv2d_winograd")
def conv2d_winograd(N: int = 1, H: int = 56, W: int = 56, CI: int = 64, CO: int = 64, padding: int = 1, m: int = 4,
                    relu: bool = False, layout: str = "NCHW", dtype: str = "float32"):
    """A 3x3 stride-1 conv2d in Winograd form F(m x m, 3 x 3): the kernel input is the transformed
    U, (alpha, alpha, CO, CI) in NCHW (tasks.winograd.transform_weight), (alpha, alpha, CI, CO) in
    NHWC (transform_weight_hwio); [relu] fused after it."""
    if layout == "NCHW":
        data = te.placeholder((N, CI, H, W), dtype, "data")
        U = te.placeholder((m + 2, m + 2, CO, CI), dtype, "U")
        out = winograd.conv2d_winograd_nchw(data, U, padding)
    elif layout == "NHWC":
        data = te.placeholder((N, H, W, CI), dtype, "data")
        U = te.placeholder((m + 2, m + 2, CI, CO), dtype, "U")
        out = winograd.conv2d_winograd_nhwc(data, U, (padding,) * 4)
    else:
        raise ValueError(f"conv2d_winograd layout must be NCHW or NHWC, got {layout!r}")
    return [data, U, ops.relu(out) if relu else out]


@workload("conv3d")
def conv3d(N: int = 1, D: int = 16, H: int = 224, W: int = 224, CI: int = 3, CO: int = 64, KD: int = 7,
           KH: int = 7, KW: int = 7, stride: int = 2, padding: int = 3, dtype: str = "float32"):
    data = te.placeholder((N, CI, D, H, W), dtype, "data")
    kernel = te.placeholder((CO, CI, KD, KH, KW), dtype, "kernel")
    return [data, kernel, ops.conv3d_ncdhw(data, kernel, stride, padding)]


@workload("group_conv2d")
def group_conv2d(N: int = 1, H: int = 56, W: int = 56, CI: int = 64, CO: int = 128, KH: int = 3, KW: int = 3,
                 stride: int = 2, padding: int = 1, groups: int = 4, dtype: str = "float32"):
    data = te.placeholder((N, CI, H, W), dtype, "data")
    kernel = te.placeholder((CO, CI // groups, KH, KW), dtype, "kernel")
    return [data, kernel, ops.conv2d_nchw(data, kernel, stride, padding, 1, groups, name="group_conv2d_nchw")]


@workload("dilated_conv2d")
def dilated_conv2d(N: int = 1, H: int = 224, W: int = 224, CI: int = 3, CO: int = 64, KH: int = 7, KW: int = 7,
                   stride: int = 2, padding: int = 3, dilation: int = 2, dtype: str = "float32"):
    data = te.placeholder((N, CI, H, W), dtype, "data")
    kernel = te.placeholder((CO, CI, KH, KW), dtype, "kernel")
    return [data, kernel, ops.conv2d_nchw(data, kernel, stride, padding, dilation)]


@workload("depthwise_conv2d")
def depthwise_conv2d(N: int = 1, H: int = 112, W: int = 112, C: int = 32, K: int = 3, stride: int = 1,
                     padding: int = 1, multiplier: int = 1, dtype: str = "float32"):
    data = te.placeholder((N, C, H, W), dtype, "data")
    kernel = te.placeholder((C, multiplier, K, K), dtype, "kernel")
    return [data, kernel, ops.depthwise_conv2d_nchw(data, kernel, stride, padding)]


@workload("conv2d_transpose")
def conv2d_transpose(N: int = 1, H: int = 4, W: int = 4, CI: int = 512, CO: int = 256, KH: int = 4, KW: int = 4,
                     stride: int = 2, padding: int = 1, dtype: str = "float32"):
    data = te.placeholder((N, CI, H, W), dtype, "data")
    kernel = te.placeholder((CI, CO, KH, KW), dtype, "kernel")
    return [data, kernel, ops.conv2d_transpose_nchw(data, kernel, stride, padding)]


@workload("capsule_conv2d")
def capsule_conv2d(N: int = 1, H: int = 16, W: int = 16, CI: int = 32, CO: int = 32, KH: int = 3, KW: int = 3,
                   stride: int = 2, padding: int = 1, capsule_size: int = 4, dtype: str = "float32"):
    data = te.placeholder((N, H, W, capsule_size, capsule_size, CI), dtype, "data")
    kernel = te.placeholder((KH, KW, capsule_size, capsule_size, CI, CO), dtype, "kernel")
    return [data, kernel, ops.capsule_conv2d_nhwijc(data, kernel, stride, padding)]


@workload("norm")
def norm(B: int = 1, M: int = 256, N: int = 256, dtype: str = "float32"):
    data = te.placeholder((B, M, N), dtype, "data")
    return [data, ops.matrix_norm(data)]


@workload("softmax")
def softmax(N: int = 128, M: int = 1024, dtype: str = "float32"):
    x = te.placeholder((N, M), dtype, "data")
    return [x, ops.softmax(x)]


@workload("layer_norm")
def layer_norm(N: int = 128, D: int = 768, dtype: str = "float32"):
    x = te.placeholder((N, D), dtype, "data")
    gamma = te.placeholder((D,), dtype, "gamma")
    beta = te.placeholder((D,), dtype, "beta")
    return [x, gamma, beta, ops.layer_norm(x, gamma, beta)]


@workload("max_pool2d")
def max_pool2d(N: int = 1, C: int = 64, H: int = 112, W: int = 112, K: int = 3, stride: int = 2, padding: int = 1,
               dtype: str = "float32"):
    data = te.placeholder((N, C, H, W), dtype, "data")
    return [data, ops.pool2d_nchw(data, K, stride, padding, "max")]


@workload("avg_pool2d")
def avg_pool2d(N: int = 1, C: int = 64, H: int = 56, W: int = 56, K: int = 3, stride: int = 2, padding: int = 1,
               dtype: str = "float32"):
    data = te.placeholder((N, C, H, W), dtype, "data")
    return [data, ops.pool2d_nchw(data, K, stride, padding, "avg")]


@workload("elementwise")
def elementwise(N: int = 1, C: int = 64, H: int = 56, W: int = 56, op: str = "add_relu", dtype: str = "float32"):
    """Residual add + relu (ResNet's block tail), or a single unary op by name."""
    a = te.placeholder((N, C, H, W), dtype, "A")
    if op == "add_relu":
        b = te.placeholder((N, C, H, W), dtype, "B")
        return [a, b, ops.relu(ops.add(a, b))]
    unary = {"relu": ops.relu, "sigmoid": ops.sigmoid, "tanh": ops.tanh, "exp": ops.exp, "gelu": ops.gelu,
             "relu6": ops.relu6}
    if op not in unary:
        raise ValueError(f"elementwise op must be add_relu or one of {', '.join(unary)}, got {op!r}")
    return [a, unary[op](a)]
