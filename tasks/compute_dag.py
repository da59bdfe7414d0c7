"""ComputeDAG: a workload's tensors in topological order, with the access analysis Ansor's rules need.

The DAG is the unit of tuning. It knows its FLOP count, prints a canonical text whose hash is the
stable `workload_key`, serialises to JSON (so workers can rebuild it without the registry), and makes
the random inputs every correctness check uses.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Sequence

import numpy as np

from tensortune.tasks import te
from tensortune.tasks.arith import const_bounds
from tensortune.tasks.te import Expr, IterVar, Load, Reduce, Tensor


class DAGError(ValueError):
    """A workload definition that cannot be tuned (missing input, out-of-bounds access, ...)."""


def topo_sort(outputs: Sequence[Tensor]) -> list[Tensor]:
    order: list[Tensor] = []
    state: dict[Tensor, int] = {}
    for out in outputs:
        stack = [(out, False)]
        while stack:
            t, done = stack.pop()
            if done:
                if state[t] == 1:
                    state[t] = 2
                    order.append(t)
                continue
            if t in state:
                continue
            state[t] = 1
            stack.append((t, True))
            stack.extend((i, False) for i in reversed(t.inputs()) if i not in state)
    return order


def _unique_names(tensors: list[Tensor]) -> list[Tensor]:
    """Rebuild tensors whose names collide, so buffers and records can refer to stages by name."""
    used: dict[str, int] = {}
    remap: dict[Tensor, Tensor] = {}
    out = []
    for t in tensors:
        name = t.name
        if name in used:
            used[name] += 1
            while f"{t.name}_{used[name]}" in used:
                used[name] += 1
            name = f"{t.name}_{used[name]}"
        used.setdefault(name, 0)
        body = t.body
        if body is not None and remap:
            body = te.transform(body, lambda n: Load(remap[n.tensor], n.indices)
                                if isinstance(n, Load) and n.tensor in remap else None)
        if name != t.name or body is not t.body:
            remap[t] = Tensor(name, t.shape, t.dtype, t.axes, body, t.attrs)
        out.append(remap.get(t, t))
    return out


def read_accesses(t: Tensor) -> dict[Tensor, list[tuple[Expr, ...]]]:
    acc: dict[Tensor, list[tuple[Expr, ...]]] = {}
    if t.body is not None:
        for n in te.walk(t.body):
            if isinstance(n, Load):
                acc.setdefault(n.tensor, []).append(n.indices)
    return acc


def _const_shift_var(e: Expr) -> te.Var | None:
    """The var of `v`, `v + c`, `v - c` or `c + v`, else None."""
    if isinstance(e, te.Var):
        return e
    if isinstance(e, te.BinOp) and e.op in ("add", "sub"):
        if isinstance(e.a, te.Var) and isinstance(e.b, te.Const):
            return e.a
        if e.op == "add" and isinstance(e.b, te.Var) and isinstance(e.a, te.Const):
            return e.b
    return None


@dataclass(frozen=True)
class SimpleAccess:
    simple: bool
    axis_missing: bool = False
    axis_duplicated: bool = False
    same_order: bool = True


def simple_access(t: Tensor, indices: tuple[Expr, ...]) -> SimpleAccess:
    """Each index is an axis of `t` with an optional constant shift (Ansor's IsSimpleAccess)."""
    if t.is_placeholder:
        return SimpleAccess(False)
    pos: dict[te.Var, int] = {ax: i for i, ax in enumerate(t.axes)}
    order, counts = [], [0] * len(t.axes)
    for e in indices:
        if isinstance(e, te.Const):
            continue
        v = _const_shift_var(e)
        if v is None or v not in pos:
            return SimpleAccess(False)
        order.append(pos[v])
        counts[pos[v]] += 1
    return SimpleAccess(True, any(c == 0 for c in counts), any(c > 1 for c in counts),
                        all(a <= b for a, b in zip(order, order[1:])))


def _has_branch(e: Expr) -> bool:
    return any(isinstance(n, te.Select) for n in te.walk(e))


def _has_expensive_op(e: Expr) -> bool:
    return any(isinstance(n, te.Call) and n.name in te.EXPENSIVE_INTRINSICS for n in te.walk(e))


def flop_count(tensors: Sequence[Tensor]) -> float:
    """TVM's estimate: float arithmetic per output point times points; index math is free."""
    total = 0.0
    for t in tensors:
        body = t.body
        if body is None:              # a placeholder
            continue
        if "FLOP" in t.attrs:
            total += float(t.attrs["FLOP"])
            continue
        code_is_float = te.is_float(t.dtype)

        def same_kind(e: Expr) -> bool:
            return te.is_float(e.dtype) == code_is_float and e.dtype != "bool"

        def visit(e: Expr) -> float:
            if isinstance(e, Reduce):
                n = float(np.prod([a.extent for a in e.axes]))
                return n * (1.0 + visit(e.source))
            if isinstance(e, te.Select):
                return visit(e.cond) + max(visit(e.t), visit(e.f))
            if isinstance(e, (te.BinOp, te.Cmp)):
                base = 1.0 if (same_kind(e.a) or same_kind(e.b)) else 0.0
                return base + visit(e.a) + visit(e.b)
            if isinstance(e, te.Not):
                return visit(e.a)
            if isinstance(e, te.Call):
                return (1.0 if e.name != "abs" else 0.0) + sum(visit(a) for a in e.args)
            if isinstance(e, te.Cast):
                return visit(e.value)
            return 0.0

        total += float(np.prod(t.shape)) * visit(body)
    return total


def check_bounds(t: Tensor) -> None:
    """Every load outside an if_then_else branch must stay inside its tensor: catches bad shapes early."""
    ranges: dict[te.Var, tuple[int, int]] = {ax: (0, ax.extent - 1) for ax in t.axes + t.reduce_axes}

    def visit(e: Expr, guarded: bool) -> None:
        if isinstance(e, te.Select):
            visit(e.cond, guarded)
            visit(e.t, True)
            visit(e.f, True)
            return
        if isinstance(e, Load) and not guarded:
            for d, (idx, size) in enumerate(zip(e.indices, e.tensor.shape)):
                lo, hi = const_bounds(idx, ranges)
                if lo < 0 or hi > size - 1:
                    raise DAGError(
                        f"{t.name} reads {e.tensor.name} out of bounds on dimension {d}: index "
                        f"{te.to_text(idx)} spans [{lo}, {hi}] but the dimension has size {size}; "
                        f"check the shapes (or guard the access with te.if_then_else)")
        for c in te.children(e):
            visit(c, guarded)

    if t.body is not None:
        visit(t.body, False)


class ComputeDAG:
    """The tensors of a workload. `args` = inputs then outputs, the order of the kernel's arguments."""

    def __init__(self, args: Sequence[Tensor], name: str = ""):
        if not args:
            raise DAGError("a workload needs at least one output tensor")
        for a in args:
            if not isinstance(a, Tensor):
                raise DAGError(f"workload arguments must be tensors, got {type(a).__name__}")
        outputs = [a for a in args if not a.is_placeholder]
        if not outputs:
            raise DAGError("a workload needs at least one compute (output) tensor")
        old_order = topo_sort(outputs)
        order = _unique_names(old_order)
        remap = dict(zip(old_order, order))
        given = set(args)
        for old, new in zip(old_order, order):
            if old.is_placeholder and old not in given:
                raise DAGError(f"placeholder {old.name!r} is read but is not among the workload's "
                               f"arguments; return it from the workload function")
        self.name = name
        self.tensors: list[Tensor] = order
        self.args: list[Tensor] = [remap.get(a, a) for a in args]
        self.inputs = [a for a in self.args if a.is_placeholder]
        self.outputs = [a for a in self.args if not a.is_placeholder]
        for t in self.tensors:
            if not t.is_placeholder:
                check_bounds(t)

    # ------------------------------------------------------------------ analysis (Ansor §4.1)

    @cached_property
    def analysis(self) -> "AccessAnalysis":
        return AccessAnalysis(self.tensors, self.outputs)

    def tensor(self, name: str) -> Tensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no tensor named {name!r} in this DAG ({', '.join(t.name for t in self.tensors)})")

    @cached_property
    def flop_ct(self) -> float:
        return flop_count(self.tensors)

    # ------------------------------------------------------------------ text, key, JSON

    def to_text(self) -> str:
        """Human-readable text, one line per tensor (the format of TVM's ComputeDAG print)."""
        lines = []
        for t in self.tensors:
            if t.is_placeholder:
                lines.append(f"{t.name} = PLACEHOLDER {list(t.shape)} {t.dtype}")
            else:
                lines.append(_compute_line(t))
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.to_text()

    @property
    def shape_signature(self) -> str:
        """The argument shapes, inputs then outputs: '1x64x56x56, 64x64x3x3, 64 -> 1x64x56x56'. Tasks
        that share an op name (ResNet-18 has four conv2d_bias_relu) read apart by it."""
        def dims(t: Tensor) -> str:
            return "x".join(str(d) for d in t.shape) or "scalar"
        return ", ".join(dims(t) for t in self.inputs) + " -> " + ", ".join(dims(t) for t in self.outputs)

    @cached_property
    def canonical_text(self) -> str:
        """Text with positional names: equal for DAGs that differ only in tensor and axis names."""
        names: dict = {t: f"T{i}" for i, t in enumerate(self.tensors)}
        for t in self.tensors:
            for j, ax in enumerate(t.axes + t.reduce_axes):
                names[ax] = f"{'i' if ax.kind == 'spatial' else 'r'}{j}"
        lines = []
        for t in self.tensors:
            if t.is_placeholder:
                arg = self.args.index(t) if t in self.args else -1
                lines.append(f"{names[t]} = PLACEHOLDER {list(t.shape)} {t.dtype} arg{arg}")
            else:
                arg = self.args.index(t) if t in self.args else -1
                lines.append(_compute_line(t, names) + f" {t.dtype} arg{arg}")
        return "\n".join(lines)

    @cached_property
    def workload_key(self) -> str:
        return hashlib.sha256(self.canonical_text.encode()).hexdigest()[:20]

    def to_json(self) -> dict:
        return dag_to_json(self)

    @staticmethod
    def from_json(data: dict | str) -> "ComputeDAG":
        return dag_from_json(data)

    # ------------------------------------------------------------------ data

    def random_inputs(self, seed: int = 0) -> list[np.ndarray]:
        """Fresh random inputs (never zeros): floats in [-1, 1), ints in a small positive range."""
        rng = np.random.default_rng(seed)
        out = []
        for t in self.inputs:
            if te.is_float(t.dtype):
                out.append(rng.uniform(-1.0, 1.0, size=t.shape).astype(t.dtype))
            elif t.dtype == "bool":
                out.append(rng.integers(0, 2, size=t.shape).astype(bool))
            else:
                out.append(rng.integers(1, 8, size=t.shape).astype(t.dtype))
        return out

    def empty_outputs(self) -> list[np.ndarray]:
        return [np.empty(t.shape, dtype=t.dtype) for t in self.outputs]


def _compute_line(t: Tensor, names: dict | None = None) -> str:
    nm = (names or {}).get(t, t.name)
    axes = ", ".join((names or {}).get(a, a.name) for a in t.axes)
    body = t.body
    if body is None:
        raise ValueError(f"{t.name} is a placeholder; it has no compute line")
    if isinstance(body, Reduce):
        sym = {"sum": "+=", "max": "max=", "min": "min="}[body.combiner]
        red = ", ".join(f"{(names or {}).get(a, a.name)}:{a.extent}" for a in body.axes)
        return f"{nm}({axes}) {sym} {te.to_text(body.source, names)}  [{red}]"
    return f"{nm}({axes}) = {te.to_text(body, names)}"


class AccessAnalysis:
    """Ansor's static analysis of a list of tensors (compute_dag.cc, AccessAnalyzer)."""

    def __init__(self, tensors: Sequence[Tensor], outputs: Sequence[Tensor] = ()):
        self.tensors = list(tensors)
        self.read_from: dict[Tensor, dict[Tensor, list[tuple[Expr, ...]]]] = {}
        self.read_by: dict[Tensor, dict[Tensor, list[tuple[Expr, ...]]]] = {t: {} for t in tensors}
        for t in tensors:
            self.read_from[t] = read_accesses(t)
            for p, acc in self.read_from[t].items():
                self.read_by.setdefault(p, {}).setdefault(t, []).extend(acc)
        self.is_simple_access: dict[Tensor, bool] = {}
        self.is_strictly_inlineable: dict[Tensor, bool] = {}
        self.needs_multi_level_tiling: dict[Tensor, bool] = {}
        self.is_output: dict[Tensor, bool] = {}
        out_set = set(outputs)
        for t in tensors:
            body = t.body
            if body is None:          # a placeholder
                self.is_simple_access[t], self.is_strictly_inlineable[t] = True, False
                self.needs_multi_level_tiling[t], self.is_output[t] = False, False
                continue
            simple, inlineable = True, True
            for acc_list in self.read_from[t].values():
                for idx in acc_list:
                    sa = simple_access(t, idx)
                    if not sa.simple:
                        simple = inlineable = False
                        break
                    if not sa.same_order or sa.axis_duplicated:
                        inlineable = False
                if not simple:
                    break
            if _has_expensive_op(body) or _has_branch(body) or isinstance(body, Reduce):
                inlineable = False
            if not self.read_from[t]:
                inlineable = not isinstance(body, Reduce)
            self.is_simple_access[t] = simple
            self.is_strictly_inlineable[t] = inlineable
            self.needs_multi_level_tiling[t] = self._needs_tiling(t)
            self.is_output[t] = not self.read_by.get(t) or t in out_set

    def _needs_tiling(self, t: Tensor) -> bool:
        """Data reuse: some spatial axis is missing from an input's indices (and there is a reduction)."""
        n_missing = 0
        for acc_list in self.read_from[t].values():
            used = set()
            for idx in acc_list:
                for e in idx:
                    used |= te.free_vars(e)
            for ax in t.axes:
                if ax.extent > 1 and ax not in used:
                    n_missing += 1
                    break
            if n_missing >= 2 or (n_missing >= 1 and t.reduce_axes):
                return True
        return False

    def consumers(self, t: Tensor) -> list[Tensor]:
        return list(self.read_by.get(t, {}))

    def producers(self, t: Tensor) -> list[Tensor]:
        return list(self.read_from.get(t, {}))

    def elementwise_match(self, t: Tensor, target: Tensor) -> bool:
        """A chain of single-consumer, same-shape, elementwise reads leads from t to target."""
        cur = t
        while cur is not target:
            readers = self.read_by.get(cur, {})
            if len(readers) != 1:
                return False
            nxt, reads = next(iter(readers.items()))
            if cur.is_placeholder or nxt.is_placeholder or nxt.shape != cur.shape:
                return False
            for idx in reads:
                sa = simple_access(nxt, idx)
                if not sa.simple or sa.axis_missing or sa.axis_duplicated or not sa.same_order:
                    return False
            cur = nxt
        return True

    def num_common_outer_iterators(self, t: Tensor, target: Tensor) -> int:
        """How many outer axes t shares one-to-one with target along every read path."""
        def common(producer: Tensor, consumer: Tensor) -> int:
            n = 0
            for n in range(min(len(producer.shape), len(consumer.shape)) + 1):
                if n == min(len(producer.shape), len(consumer.shape)):
                    break
                if producer.shape[n] != consumer.shape[n]:
                    break
                if not all(_const_shift_var(idx[n]) is consumer.axes[n]
                           for idx in self.read_from[consumer][producer]):
                    break
            return n

        best = None

        def walk(cur: Tensor, n: int) -> None:
            nonlocal best
            if cur is target:
                best = n if best is None else min(best, n)
                return
            for nxt in self.read_by.get(cur, {}):
                walk(nxt, min(n, common(cur, nxt)))

        walk(t, len(t.shape))
        return best or 0


# ---------------------------------------------------------------------------------- JSON

def _expr_to_json(e: Expr, var_index: dict) -> list:
    if isinstance(e, te.Var):
        if e not in var_index:
            raise DAGError(f"variable {e.name!r} is not an axis of the compute that uses it")
        return ["v", var_index[e]]
    if isinstance(e, te.Const):
        return ["c", e.value, e.dtype]
    if isinstance(e, te.BinOp):
        return ["b", e.op, _expr_to_json(e.a, var_index), _expr_to_json(e.b, var_index)]
    if isinstance(e, te.Cmp):
        return ["cmp", e.op, _expr_to_json(e.a, var_index), _expr_to_json(e.b, var_index)]
    if isinstance(e, te.Not):
        return ["not", _expr_to_json(e.a, var_index)]
    if isinstance(e, te.Select):
        return ["sel"] + [_expr_to_json(x, var_index) for x in (e.cond, e.t, e.f)]
    if isinstance(e, te.Call):
        return ["call", e.name, e.dtype] + [_expr_to_json(a, var_index) for a in e.args]
    if isinstance(e, te.Cast):
        return ["cast", e.dtype, _expr_to_json(e.value, var_index)]
    if isinstance(e, Load):
        return ["ld", e.tensor.name] + [_expr_to_json(i, var_index) for i in e.indices]
    if isinstance(e, Reduce):
        return ["red", e.combiner, [var_index[a] for a in e.axes], _expr_to_json(e.source, var_index)]
    raise DAGError(f"cannot serialise expression node {type(e).__name__}")


def dag_to_json(dag: ComputeDAG) -> dict:
    tensors = []
    for t in dag.tensors:
        item: dict[str, Any] = {"name": t.name, "shape": list(t.shape), "dtype": t.dtype}
        if t.body is not None:    # a compute, not a placeholder
            all_axes = t.axes + t.reduce_axes
            index = {ax: i for i, ax in enumerate(all_axes)}
            item["axes"] = [[a.name, a.extent, a.kind] for a in all_axes]
            item["body"] = _expr_to_json(t.body, index)
            if t.attrs:
                item["attrs"] = {k: v for k, v in t.attrs.items() if isinstance(v, (int, float, str, bool))}
        tensors.append(item)
    return {"name": dag.name, "tensors": tensors, "args": [a.name for a in dag.args]}


def dag_from_json(data: dict | str) -> ComputeDAG:
    try:
        doc: dict[str, Any] = json.loads(data) if isinstance(data, str) else data
        by_name: dict[str, Tensor] = {}
        for item in doc["tensors"]:
            shape = tuple(item["shape"])
            if "body" not in item:
                by_name[item["name"]] = te.placeholder(shape, item["dtype"], item["name"])
                continue
            axes = [IterVar(n, ext, kind) for n, ext, kind in item["axes"]]

            def build(j) -> Expr:
                tag = j[0]
                if tag == "v":
                    return axes[j[1]]
                if tag == "c":
                    return te.Const(j[1], j[2])
                if tag == "b":
                    return te.binary(j[1], build(j[2]), build(j[3]))
                if tag == "cmp":
                    return te.compare(j[1], build(j[2]), build(j[3]))
                if tag == "not":
                    return te.Not(build(j[1]))
                if tag == "sel":
                    return te.Select(build(j[1]), build(j[2]), build(j[3]))
                if tag == "call":
                    return te.Call(j[1], tuple(build(a) for a in j[3:]), j[2])
                if tag == "cast":
                    return te.Cast(j[1], build(j[2]))
                if tag == "ld":
                    return Load(by_name[j[1]], tuple(build(i) for i in j[2:]))
                if tag == "red":
                    return Reduce(j[1], build(j[3]), tuple(axes[i] for i in j[2]))
                raise DAGError(f"unknown expression tag {tag!r}")

            body = te.shared(build(item["body"]))
            n_sp = len(shape)
            by_name[item["name"]] = Tensor(item["name"], shape, item["dtype"], tuple(axes[:n_sp]), body,
                                           item.get("attrs"))
        return ComputeDAG([by_name[n] for n in doc["args"]], name=doc.get("name", ""))
    except DAGError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, json.JSONDecodeError) as err:
        raise DAGError(f"malformed ComputeDAG JSON: {err!r}; regenerate it with ComputeDAG.to_json()") from err
