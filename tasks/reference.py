"""The NumPy reference: evaluates a ComputeDAG directly from its expressions.

Every kernel the project builds is checked against this. It evaluates in float64 (so the reference
is more accurate than any float32 kernel) and in chunks (so large convolutions fit in memory).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from tensortune.tasks import te
from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.te import Expr, Tensor

_CHUNK_ELEMENTS = 1 << 22
_erf = np.vectorize(math.erf, otypes=[np.float64])

_UNARY: dict[str, Callable[..., Any]] = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "tanh": np.tanh, "abs": np.abs,
    "floor": np.floor, "ceil": np.ceil, "sin": np.sin, "cos": np.cos,
    "rsqrt": lambda x: 1.0 / np.sqrt(x), "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "erf": _erf,
}
_BINARY: dict[str, Callable[..., Any]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "min": np.minimum,
    "max": np.maximum, "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "eq": np.equal, "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or,
}

_REDUCERS: dict[str, Callable[..., Any]] = {"sum": np.sum, "max": np.max, "min": np.min}



def _np_dtype(dtype: str):
    return np.float64 if te.is_float(dtype) else (bool if dtype == "bool" else np.dtype(dtype))


def _eval(e: Expr, env: dict, values: dict):
    if isinstance(e, te.Var):
        return env[e]
    if isinstance(e, te.Const):
        return e.value
    if isinstance(e, te.BinOp):
        a, b = _eval(e.a, env, values), _eval(e.b, env, values)
        if e.op == "floordiv":
            return np.floor_divide(a, b) if not te.is_float(e.dtype) else np.floor(np.divide(a, b))
        if e.op == "floormod":
            return np.mod(a, b)
        return _BINARY[e.op](a, b)
    if isinstance(e, te.Cmp):
        return _BINARY[e.op](_eval(e.a, env, values), _eval(e.b, env, values))
    if isinstance(e, te.Not):
        return np.logical_not(_eval(e.a, env, values))
    if isinstance(e, te.Select):
        return np.where(_eval(e.cond, env, values), _eval(e.t, env, values), _eval(e.f, env, values))
    if isinstance(e, te.Call):
        args = [np.asarray(_eval(a, env, values), dtype=np.float64) for a in e.args]
        return np.power(*args) if e.name == "pow" else _UNARY[e.name](args[0])
    if isinstance(e, te.Cast):
        v = _eval(e.value, env, values)
        if not te.is_float(e.dtype) and te.is_float(e.value.dtype):
            v = np.trunc(v)
        return np.asarray(v).astype(_np_dtype(e.dtype)) if e.dtype != "float32" else np.asarray(v, np.float64)
    if isinstance(e, te.Load):
        arr = values[e.tensor]
        # Out-of-range indices only occur in the untaken branch of an if_then_else: clip them.
        idx = tuple(np.clip(_eval(i, env, values), 0, n - 1) for i, n in zip(e.indices, arr.shape))
        return arr[idx]
    raise TypeError(f"cannot evaluate {type(e).__name__} here")


def _einsum_terms(t: Tensor):
    """For sum-of-products whose loads index by plain axes (matmul, dense, batch_matmul, norms):
    the einsum operands and subscripts, else None."""
    body = t.body
    if not isinstance(body, te.Reduce) or body.combiner != "sum" or not te.is_float(t.dtype):
        return None
    loads, stack = [], [body.source]
    while stack:
        e = stack.pop()
        if isinstance(e, te.BinOp) and e.op == "mul":
            stack += [e.a, e.b]
        elif isinstance(e, te.Load) and all(isinstance(i, te.IterVar) for i in e.indices):
            loads.append(e)
        else:
            return None
    axes = list(t.axes) + list(body.axes)
    if len(axes) > 52 or any(len(set(map(id, ld.indices))) != len(ld.indices) for ld in loads):
        return None
    letter: dict[Expr, str] = {ax: chr(ord("a") + k) if k < 26 else chr(ord("A") + k - 26) for k, ax in enumerate(axes)}
    if any(i not in letter for ld in loads for i in ld.indices):
        return None
    used = {i for ld in loads for i in ld.indices}
    if any(a not in used for a in t.axes):          # an output axis no operand varies over
        return None
    subs = ",".join("".join(letter[i] for i in ld.indices) for ld in loads)
    return [ld.tensor for ld in loads], f"{subs}->{''.join(letter[a] for a in t.axes)}"


def _evaluate_compute(t: Tensor, values: dict) -> np.ndarray:
    fast = _einsum_terms(t)
    if fast is not None:
        tensors, subscripts = fast
        return np.einsum(subscripts, *[values[x] for x in tensors], optimize=True)
    reduce_axes = t.reduce_axes
    n_sp, n_red = len(t.axes), len(reduce_axes)
    red_size = int(np.prod([a.extent for a in reduce_axes])) if reduce_axes else 1
    out = np.empty(t.shape, dtype=_np_dtype(t.dtype))
    if n_sp == 0:
        raise ValueError(f"{t.name} has no axes")
    chunk_axis = int(np.argmax(t.shape))
    per_row = int(np.prod(t.shape)) // t.shape[chunk_axis] * red_size
    step = max(1, _CHUNK_ELEMENTS // max(per_row, 1))
    for lo in range(0, t.shape[chunk_axis], step):
        hi = min(t.shape[chunk_axis], lo + step)
        env = {}
        for d, ax in enumerate(t.axes):
            rng = np.arange(lo, hi) if d == chunk_axis else np.arange(ax.extent)
            env[ax] = rng.reshape([-1 if k == d else 1 for k in range(n_sp + n_red)])
        for d, ax in enumerate(reduce_axes):
            env[ax] = np.arange(ax.extent).reshape([-1 if k == n_sp + d else 1 for k in range(n_sp + n_red)])
        sl = tuple(slice(lo, hi) if d == chunk_axis else slice(None) for d in range(n_sp))
        if isinstance(t.body, te.Reduce):
            src = _eval(t.body.source, env, values)
            full = tuple(hi - lo if d == chunk_axis else s for d, s in enumerate(t.shape)) + tuple(
                a.extent for a in reduce_axes)
            src = np.broadcast_to(np.asarray(src, dtype=out.dtype), full)
            red = _REDUCERS[t.body.combiner]
            out[sl] = red(src, axis=tuple(range(n_sp, n_sp + n_red)))
        else:
            assert t.body is not None                # placeholders are inputs, never evaluated
            val = np.asarray(_eval(t.body, env, values))
            out[sl] = np.broadcast_to(val, out[sl].shape)
    return out


def evaluate(dag: ComputeDAG, inputs: Sequence[np.ndarray], keep_all: bool = False):
    """Outputs of the DAG for `inputs` (in `dag.inputs` order), cast to their declared dtypes."""
    if len(inputs) != len(dag.inputs):
        raise ValueError(f"the workload takes {len(dag.inputs)} inputs, got {len(inputs)}")
    values: dict[Tensor, np.ndarray] = {}
    for t, arr in zip(dag.inputs, inputs):
        arr = np.asarray(arr)
        if arr.shape != t.shape:
            raise ValueError(f"input {t.name} must have shape {t.shape}, got {arr.shape}")
        values[t] = arr.astype(_np_dtype(t.dtype))
    for t in dag.tensors:
        if not t.is_placeholder:
            values[t] = _evaluate_compute(t, values)
    if keep_all:
        return {t.name: v for t, v in values.items()}
    return [values[t].astype(t.dtype) for t in dag.outputs]


def tolerance(ref: np.ndarray) -> tuple[float, float]:
    """(rtol, atol) for comparing a float32 kernel with the float64 reference."""
    scale = float(np.max(np.abs(ref))) if ref.size else 1.0
    return 1e-3, 1e-4 * max(1.0, scale)


def mismatch(out: np.ndarray, ref: np.ndarray) -> str | None:
    """None when out matches ref, else a one-line description of the worst element."""
    if out.shape != ref.shape:
        return f"shape {out.shape} != reference {ref.shape}"
    if not np.issubdtype(ref.dtype, np.floating):
        bad = np.argwhere(out != ref)
        return None if bad.size == 0 else f"{len(bad)} elements differ, first at {tuple(bad[0])}"
    rtol, atol = tolerance(ref)
    diff = np.abs(out.astype(np.float64) - ref.astype(np.float64))
    bad = diff > atol + rtol * np.abs(ref)
    if not np.any(bad) and np.all(np.isfinite(out) == np.isfinite(ref)):
        return None
    worst = np.unravel_index(int(np.argmax(np.where(np.isnan(diff), np.inf, diff))), diff.shape)
    return (f"{int(np.sum(bad))}/{out.size} elements differ; worst at {tuple(int(i) for i in worst)}: "
            f"{out[worst]!r} vs reference {ref[worst]!r}")
