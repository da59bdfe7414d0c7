"""Ansor's per-store features (the 164 floats of TVM's feature.cc), for a whole population at once.

This is the search's hot path. Thousands of candidates share a few structures: they differ only in
tile sizes and unroll depths. So features are computed per *structure*: a `FeatureTemplate` is built
once from one representative (loop nests, buffer accesses and their linear index coefficients, all
symbolic in the tile sizes), and then evaluated with numpy over the numbers of every candidate with
that structure. Region sizes of stages computed inside other stages are inferred the same way.

Deviations from feature.cc, on purpose: index coefficients are exact linear coefficients (not the
pattern-matched approximation), `lines` divides by the extents of the loops it skipped (feature.cc
divides by the innermost extent each time), serial read-write reuse between an init and an update
statement is not modelled, an attached stage's loops over a region of extent 1 are kept (TVM's
lowering drops them, so num_loops differs there), and unique_lines takes each buffer's contiguous run
from that buffer's own touched region (feature.cc reuses the region of the last buffer it visited).
Integer op counts include the index arithmetic of each dimension as written; feature.cc counts it in
the flattened index, so it counts more for a buffer of two or more dimensions.

A stage computed inside another one reads at the place its region starts, an expression of the
enclosing loops (its readers' indices with their inner loops at 0), and its own buffer is indexed
relative to that place, as in TVM's lowered code: so its operands' reuse and unique bytes follow the
enclosing loops, and its readers see a buffer the size of the region.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from tensortune.schedule.loop_structure import loop_structure
from tensortune.schedule.program import Program
from tensortune.schedule.stage import Split
from tensortune.schedule.state import State
from tensortune.schedule.steps import FollowFusedSplitStep, FollowSplitStep, PragmaStep, RfactorStep, SplitStep, Step
from tensortune.search.feature_layout import (
    BUF,
    BUFFER_FIELDS,
    COLUMN,
    CURVE_N,
    MAX_N_BUFS,
    N_FEATURES,
    OFFSET,
    OP_FIELDS,
    onehot_mask,
)
from tensortune.search.symbolic import FreeVars, IntervalCompiler, Linear, compile_exprs, linear_form
from tensortune.tasks import te
from tensortune.tasks.search_task import SearchTask
from tensortune.tasks.te import DTYPE_BYTES, Expr, Var

_GPU_AXES = ("blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y", "threadIdx.z")
_ANNOTATION_GROUPS = (("vectorize", "vec"), ("unroll", "unroll"), ("parallel", "parallel"))   # loop kind, group
_ONEHOT = np.array(onehot_mask())


def _structural_split(state: Program, i: int) -> bool:
    """A split whose lengths shape an operator (the one feeding an rfactor) is part of the structure."""
    return i + 1 < len(state.steps) and isinstance(state.steps[i + 1], RfactorStep)


def structure_key(state: Program) -> str:
    """Equal for states that differ only in tile sizes and unroll depths."""
    key = []
    for i, st in enumerate(state.steps):
        if isinstance(st, SplitStep) and not _structural_split(state, i):
            key.append(["SP", st.stage_id, st.iter_id, st.extent, len(st.lengths), int(st.inner_to_outer)])
        elif isinstance(st, PragmaStep) and st.pragma.startswith("auto_unroll_max_step"):
            key.append(["PR", st.stage_id, st.iter_id])
        else:
            key.append(st.to_json())
    return json.dumps(key, separators=(",", ":"))


def _slots(state: Program) -> list[tuple[int, int]]:
    """(step index, position) of every number a structure leaves open; position -1 = pragma value."""
    out = []
    for i, st in enumerate(state.steps):
        if isinstance(st, SplitStep) and not _structural_split(state, i):
            out += [(i, k) for k in range(len(st.lengths))]
        elif isinstance(st, PragmaStep) and st.pragma.startswith("auto_unroll_max_step"):
            out.append((i, -1))
    return out


def state_numbers(state: Program, slots: list[tuple[int, int]]) -> list[int]:
    return [_slot_number(state.steps[i], k) for i, k in slots]


def _slot_number(st: Step, k: int) -> int:
    """The number at one slot (see `_slots`): a split's k-th length, or (k = -1) a pragma's value."""
    if k < 0 and isinstance(st, PragmaStep):
        return st.parsed()[1]
    if k >= 0 and isinstance(st, SplitStep):
        length = st.lengths[k]
        if length is None:
            raise ValueError("a split with an open length has no features")
        return length
    raise TypeError(f"slot {k} of a {type(st).__name__} holds no number")


# ------------------------------------------------------------------------------------ op counts

class _OpCounts(dict):
    """Operation counts of a statement, keyed by the op-count feature names (missing ones are 0)."""

    def __missing__(self, key: str) -> int:
        return 0

    def vector(self) -> list[int]:
        return [self[f] for f in OP_FIELDS]

    @property
    def float_ops(self) -> int:
        return sum(self[f] for f in ("float_addsub", "float_mul", "float_divmod", "float_cmp", "float_mathfunc"))


def _count_ops(e: Expr) -> _OpCounts:
    c = _OpCounts()
    for n in te.walk(e):
        if isinstance(n, (te.BinOp, te.Cmp)):
            if n.op in ("and", "or"):
                c["bool_op"] += 1
                continue
            f = te.is_float(n.a.dtype)
            kind = {"add": "addsub", "sub": "addsub", "mul": "mul", "div": "divmod", "floordiv": "divmod",
                    "floormod": "divmod"}.get(n.op, "cmp")
            c[f"{'float' if f else 'int'}_{kind}"] += 1
        elif isinstance(n, te.Not):
            c["bool_op"] += 1
        elif isinstance(n, te.Select):
            c["select_op"] += 1
        elif isinstance(n, te.Call):
            if te.is_float(n.dtype):
                c["float_mathfunc"] += 1
            else:
                c["int_mathfunc"] += 1
    return c


# ------------------------------------------------------------------------------------ template

@dataclass
class _Access:
    buffer: str
    dims: list                   # per dim: Linear
    acc_type: int                # 0 read, 1 write, 2 read-write
    ele_bytes: int


@dataclass
class _Store:
    """One feature row: a stage's (update) store and the loop nest around it."""
    stage: str
    loops: list                  # [(var, annotation, pragmas)], outermost first
    n_enclosing: int             # loops outside the stage's own (its compute_at scope)
    accesses: list               # [_Access]
    ops: _OpCounts
    alloc: bool                  # the stage's buffer is allocated (not a kernel argument)
    plan: dict | None = field(default=None, repr=False, compare=False)   # FeatureTemplate._plan, made once


def _split_lengths(steps: Sequence, sym: dict, i: int) -> list:
    """The lengths step i splits into: tile-size symbols where the structure leaves them open.
    (Module-level functions, not recursive closures: those are reference cycles that keep a whole
    template's making alive until the cyclic collector runs.)"""
    st = steps[i]
    if isinstance(st, SplitStep):
        return [sym.get((i, k), ln) for k, ln in enumerate(st.lengths)]
    if isinstance(st, FollowSplitStep):
        src = _split_lengths(steps, sym, st.src_step_id)
        last = src[st.n_split - 1]
        for x in src[st.n_split:]:
            last = te.binary("mul", te.as_expr(last), te.as_expr(x))
        return list(src[:st.n_split - 1]) + [last]
    if isinstance(st, FollowFusedSplitStep):
        out: Expr | int = 1
        for s in st.src_step_ids:
            out = te.binary("mul", te.as_expr(out), te.as_expr(_split_lengths(steps, sym, s)[st.level]))
        return [out]
    raise TypeError(f"step {i} makes no split")


def _loop_nest(name: str, by_name: dict, pragma_sym: dict, nests: dict, enclosing: dict) -> list:
    """(var, annotation, unroll) of the loops of the stages `name` is computed in, then its own;
    memoised in `nests`, with the number of enclosing loops in `enclosing`."""
    if name in nests:
        return nests[name]
    st = by_name[name]
    outer = []
    if st.compute_at == "iter":
        target, var = st.attach
        tn = _loop_nest(target, by_name, pragma_sym, nests, enclosing)
        j = by_name[target].iter_index(var)
        outer = tn[:enclosing[target] + j + 1]
    enclosing[name] = len(outer)
    own = []
    for it in st.iters:
        unroll = dict(it.pragmas).get("auto_unroll_max_step")
        if unroll is not None:
            unroll = pragma_sym.get(name, unroll)
        own.append((it.var, it.annotation, unroll))
    nests[name] = outer + own
    return nests[name]


def _region_base(name: str, nests: dict, enclosing: dict, loads: dict, order: list) -> list | None:
    """Where the region of attached stage `name` starts, per dimension, as an expression of its
    enclosing loops: the first reader's index with the reader's loops inside the attach point at 0.
    None when no reader shares those enclosing loops (the region is then taken to start at 0)."""
    start = enclosing[name]
    outer = [v for v, _, _ in nests[name][:start]]
    for reader in order:
        idx_list = loads.get(reader, {}).get(name) if reader != name else None
        if not idx_list or [v for v, _, _ in nests[reader][:start]] != outer:
            continue
        inner = {v: te.const(0) for v, _, _ in nests[reader][start:]}
        return [te.substitute(i, inner) for i in idx_list[0]]
    return None


class FeatureTemplate:
    """Features of every state with one structure, as a function of its open numbers."""

    def __init__(self, state: State, task: SearchTask):
        self.slots = _slots(state)
        self.is_gpu = task.target_kind == "cuda"
        self.cache_line = task.hardware.cache_line_bytes
        names: dict[Var, str] = {}
        sym: dict[tuple[int, int], Var] = {}
        for i, k in self.slots:
            v = Var(f"L{i}_{k}" if k >= 0 else f"P{i}")
            sym[(i, k)], names[v] = v, v.name
        self._slot_syms = [sym[slot] for slot in self.slots]

        def lengths(rel: Split) -> list:
            return _split_lengths(state.steps, sym, rel.step)

        # stage ids do not move after the annotation steps, so a pragma step's stage is final
        pragma_sym: dict[str, Var] = {}
        for i, k in self.slots:
            step = state.steps[i]
            if k < 0 and isinstance(step, PragmaStep):
                pragma_sym[state.stages[step.stage_id].name] = sym[(i, -1)]
        self._tensor_shapes = {st.name: list(st.op.shape) for st in state.stages}
        bodies = state.effective_bodies()
        outputs = {t.name for t in task.dag.args}
        self.stage_names = [s.name for s in state.stages if not s.is_placeholder and s.compute_at != "inline"]
        self.shapes: dict[str, list] = {}
        self.region_syms: dict[str, list[Var]] = {}
        self.ext: dict[Var, object] = {}
        nests: dict[str, list] = {}
        enclosing: dict[str, int] = {}
        values: dict[str, dict] = {}
        by_name = {s.name: s for s in state.stages}
        for s in state.stages:
            if s.is_placeholder:
                self.shapes[s.name] = list(s.op.shape)
        for name in self.stage_names:
            st = by_name[name]
            if st.compute_at == "iter":
                rs = [Var(f"R{name}_{d}") for d in range(st.op.ndim)]
                for v in rs:
                    names[v] = v.name
                self.region_syms[name] = rs
                self.shapes[name] = list(rs)
                roots = rs + [a.extent for a in st.op.reduce_axes]
            else:
                self.shapes[name] = list(st.op.shape)
                roots = None
            ls = loop_structure(st, roots, lengths)
            for it in st.iters:
                self.ext[it.var] = ls.extents[it.var]
            values[name] = ls.values
        # Loads in global coordinates, consumers first: a stage computed inside another one runs once per
        # iteration of its enclosing loops, on the region its readers need there, so its own loop values
        # are offset by where that region starts (the readers' indices with their inner loops at 0).
        for name in self.stage_names:
            _loop_nest(name, by_name, pragma_sym, nests, enclosing)
        global_vals: dict[str, dict] = {}
        loads: dict[str, dict[str, list]] = {}
        for name in reversed(self.stage_names):
            st = by_name[name]
            vals = values[name]
            if name in self.region_syms:
                base = _region_base(name, nests, enclosing, loads, self.stage_names)
                if base is not None:
                    vals = {**vals, **{a: te.binary("add", b, vals[a]) for a, b in zip(st.op.axes, base)}}
            global_vals[name] = vals
            body = bodies[name]
            src = te.substitute(body.source if isinstance(body, te.Reduce) else body, vals)
            reads: dict[str, list] = {}
            for n in te.walk(src):
                if isinstance(n, te.Load):
                    reads.setdefault(n.tensor.name, []).append(n.indices)
            loads[name] = reads
        self.stores: list[_Store] = []
        free_vars = FreeVars()
        for name in self.stage_names:
            st = by_name[name]
            loops = nests[name]
            loop_vars = {v for v, _, _ in loops}
            body = bodies[name]
            src = te.substitute(body.source if isinstance(body, te.Reduce) else body, global_vals[name])
            accesses = []
            # the stage's own buffer is indexed relative to its region (values[name]: local coordinates)
            out_idx = [values[name][a] for a in st.op.axes]
            is_update = isinstance(body, te.Reduce)
            accesses.append(_Access(name, [linear_form(i, loop_vars, free_vars) for i in out_idx],
                                    2 if is_update else 1, DTYPE_BYTES[st.op.dtype]))
            for buf, idx_list in loads[name].items():
                if buf == name:
                    continue
                dtype = by_name[buf].op.dtype if buf in by_name else "float32"
                idx = idx_list[0]
                if buf in self.region_syms:       # a region buffer: its enclosing loops only move the region
                    fixed = {v: te.const(0) for v, _, _ in nests[buf][:enclosing[buf]]}
                    idx = [te.substitute(i, fixed) for i in idx]
                accesses.append(_Access(buf, [linear_form(i, loop_vars, free_vars) for i in idx], 0,
                                        DTYPE_BYTES[dtype]))
            ops = _count_ops(src)
            if isinstance(body, te.Reduce):
                ops["float_addsub"] += 1 if te.is_float(st.op.dtype) and body.combiner == "sum" else 0
                ops["float_cmp"] += 1 if te.is_float(st.op.dtype) and body.combiner != "sum" else 0
            self.stores.append(_Store(name, loops, enclosing[name], accesses, ops, name not in outputs))
        # readers of each attached stage, for region inference: (reader store, access)
        self.readers: dict[str, list] = {n: [] for n in self.region_syms}
        for store in self.stores:
            for acc in store.accesses[1:]:
                if acc.buffer in self.readers:
                    self.readers[acc.buffer].append((store, acc))
        # compile every extent and coefficient expression into one numpy function
        exprs: list[Expr] = []
        self._index: dict[int, int] = {}                 # id(expression) -> its position in exprs

        def want(x) -> None:
            if isinstance(x, (int, float)) or id(x) in self._index:
                return
            self._index[id(x)] = len(exprs)
            exprs.append(x)

        for store in self.stores:
            for v, _, _ in store.loops:
                want(self.ext[v])
            for acc in store.accesses:
                for d in acc.dims:
                    for c in d.coef.values():
                        want(c)
        self._names = names
        self._exprs = exprs
        self._fn = compile_exprs(exprs, names) if exprs else (lambda e: ())
        self._atom_vars = {id(a): free_vars(a) for s in self.stores for acc in s.accesses for d in acc.dims
                           for a in d.atoms}
        self._compile_atoms()
        self._ext_rows = {v: r for r, v in enumerate(dict.fromkeys(v for st in self.stores for v, _, _ in st.loops))}
        self._shape_rows = {key: r for r, key in enumerate(dict.fromkeys(
            (acc.buffer, d) for st in self.stores for acc in st.accesses for d in range(len(acc.dims))))}

    def _compile_atoms(self) -> None:
        """One numpy function for every (non-linear index part, set of varying loops) the features
        need: the region inference of attached stages and the per-level touched regions."""
        loop_vars = {v for st in self.stores for v, _, _ in st.loops}
        self._loop_names = {v: f"x{k}" for k, v in enumerate(sorted(loop_vars, key=id))}
        # split lengths (L..) and region sizes (R..) are at least 1, unroll depths (P..) at least 0
        floors = {name: 1 if name[0] in "LR" else 0 for name in self._names.values()}
        comp = IntervalCompiler({**self._names, **self._loop_names}, loop_vars, floors)
        self._atom_index: dict = {}
        outputs: list[str] = []

        def want(a, ranging: frozenset) -> None:
            key = (id(a), ranging)
            if key not in self._atom_index:
                lo, hi = comp.bound(a, ranging)
                self._atom_index[key] = len(outputs)
                outputs.append(f"np.abs(({hi}) - ({lo}))")

        for store in self.stores:
            for acc in store.accesses:
                for lin in acc.dims:
                    for a in lin.atoms:
                        for p in self._atom_positions(a, store.loops):
                            want(a, self._ranging(a, store.loops, p))
        for name, readers in self.readers.items():
            start = next(st.n_enclosing for st in self.stores if st.stage == name)
            for store, acc in readers:
                for lin in acc.dims:
                    for a in lin.atoms:
                        want(a, self._ranging(a, store.loops, start))
        self._atom_fn: Callable[[dict, dict], tuple] | None = comp.function(outputs) if outputs else None

    def _atom_positions(self, a, loops: list) -> list[int]:
        return sorted(k for k, (v, _, _) in enumerate(loops) if v in self._atom_vars[id(a)])

    def _ranging(self, a, loops: list, start: int) -> frozenset:
        return frozenset(v for v, _, _ in loops[start:] if v in self._atom_vars[id(a)])

    def _atom_widths(self, env: dict, vals: tuple, m: int) -> tuple:
        if self._atom_fn is None:
            return ()
        ones = np.ones(m, dtype=np.int64)
        X = {name: np.asarray(self._value(self.ext[v], vals)) * ones for v, name in self._loop_names.items()}
        return self._atom_fn(env, X)

    # -------------------------------------------------------------------------------- evaluation

    def _value(self, x, vals: tuple):
        if isinstance(x, (int, float)):
            return x
        return vals[self._index[id(x)]]

    def __call__(self, numbers: np.ndarray) -> np.ndarray:
        """numbers: [m, len(slots)] -> features [m, n_stores, 164]."""
        m = numbers.shape[0]
        env = {v.name: numbers[:, j].astype(np.int64) for j, v in enumerate(self._slot_syms)}
        ones = np.ones(m, dtype=np.int64)
        for syms in self.region_syms.values():       # provisional, refined below
            for v in syms:
                env[v.name] = ones
        vals = self._fn(env)
        W = self._atom_widths(env, vals, m)
        # regions of attached stages, consumers first (they come later in stage order)
        for name in reversed(self.stage_names):
            if name not in self.region_syms:
                continue
            shape = self._tensor_shapes[name]
            start = next(st.n_enclosing for st in self.stores if st.stage == name)
            widths = [np.zeros(m, dtype=np.int64) for _ in shape]
            for store, acc in self.readers[name]:
                loop_ext = [np.asarray(self._value(self.ext[v], vals)) * ones for v, _, _ in store.loops]
                for d, lin in enumerate(acc.dims):
                    widths[d] = np.maximum(widths[d], self._width(lin, store.loops, loop_ext, start, vals, W, m))
            for d, sym in enumerate(self.region_syms[name]):
                env[sym.name] = np.clip(widths[d] + 1, 1, shape[d])
            vals = self._fn(env)
            W = self._atom_widths(env, vals, m)
        self._W = W
        ext = np.empty((len(self._ext_rows), m))          # every loop's extent, once for all stores
        for v, row in self._ext_rows.items():
            ext[row] = self._value(self.ext[v], vals)
        shapes = np.empty((len(self._shape_rows), m))     # every buffer dimension's size
        for (buf, d), row in self._shape_rows.items():
            shapes[row] = self._shape_value(buf, d, env)
        raw = np.stack([self._store_features(s, vals, env, ext, shapes, m) for s in self.stores])   # [stores, 164, m]
        logged = np.sign(raw) * np.log2(np.abs(raw) + 1)
        out = np.where(_ONEHOT[None, :, None], raw, logged)
        return out.transpose(2, 0, 1)

    def _width(self, lin: Linear, loops: list, ext: list, start: int, vals: tuple, W: tuple, m: int):
        """Span of one index dimension when the loops from `start` inward vary (outer loops fixed)."""
        w = np.zeros(m, dtype=np.int64)
        for k in range(start, len(loops)):
            v = loops[k][0]
            if v in lin.coef:
                w = w + np.abs(np.asarray(self._value(lin.coef[v], vals))) * (ext[k] - 1)
        for a in lin.atoms:
            w = w + W[self._atom_index[(id(a), self._ranging(a, loops, start))]]
        return w

    def _plan(self, s: _Store) -> dict:
        """What about a store's features is structural, decided once per template."""
        plan = s.plan
        if plan is not None:
            return plan
        n = len(s.loops)
        ann = [a for _, a, _ in s.loops]
        plan = {"kinds": {k: [i for i, a in enumerate(ann) if a == k] for k in ("vectorize", "unroll", "parallel")},
                "gpu": {a: i for i, a in enumerate(ann) if a in _GPU_AXES},
                "vthread": [i for i, a in enumerate(ann) if a == "vthread"],
                "unroll": next((u for _, _, u in reversed(s.loops) if u is not None), None),
                "accesses": [], "spans": []}
        plan["loop_rows"] = np.array([self._ext_rows[v] for v, _, _ in s.loops], dtype=np.intp)
        plan["shape_rows"] = [np.array([self._shape_rows[(acc.buffer, d)] for d in range(len(acc.dims))],
                                       dtype=np.intp) for acc in s.accesses]
        plan["alloc_rows"] = plan["shape_rows"][0] if s.accesses else None
        pos = {v: k for k, (v, _, _) in enumerate(s.loops)}
        for acc in s.accesses:
            dims = [([(pos[v], c) for v, c in lin.coef.items() if v in pos], lin) for lin in acc.dims]
            stride = None              # (loop index, dim, coefficient or None for a non-linear use)
            for i in range(n - 1, -1, -1):
                var = s.loops[i][0]
                for d in range(len(acc.dims) - 1, -1, -1):
                    lin = acc.dims[d]
                    if var in lin.coef:
                        stride = (i, d, lin.coef[var])
                    elif any(var in self._atom_vars[id(x)] for x in lin.atoms):
                        stride = (i, d, None)
                    if stride:
                        break
                if stride:
                    break
            reuse = next((i for i in range(n - 1, -1, -1) if not self._uses(acc, s.loops[i][0])), None)
            plan["accesses"].append((dims, stride, reuse))
            # every (dim, loop, coefficient) of the access at once, for one vectorised span computation
            terms = [(d, k, c) for d, (ts, _) in enumerate(dims) for k, c in ts]
            plan["spans"].append((np.array([d for d, _, _ in terms], dtype=np.intp),
                                  np.array([k for _, k, _ in terms], dtype=np.intp), [c for _, _, c in terms],
                                  [(d, lin) for d, (_, lin) in enumerate(dims) if lin.atoms]))
        s.plan = plan
        return plan

    def _store_features(self, s: _Store, vals: tuple, env: dict, ext: np.ndarray, all_shapes: np.ndarray,
                        m: int) -> np.ndarray:
        plan = self._plan(s)
        n = len(s.loops)
        out = np.zeros((N_FEATURES, m))
        E = ext[plan["loop_rows"]]                                  # [n, m]
        outer = E.prod(axis=0) if n else np.ones(m)
        ops_at = OFFSET["ops"]
        out[ops_at:ops_at + len(OP_FIELDS)] = np.asarray(s.ops.vector(), dtype=np.float64)[:, None] * outer
        for kind, group in _ANNOTATION_GROUPS:
            row, col = OFFSET[group], COLUMN[group]
            idx = plan["kinds"][kind]
            if idx:
                out[row + col["num"]] = len(idx)
                out[row + col["prod"]] = E[idx].prod(axis=0)
                out[row + col["len"]] = E[idx[-1]]
                out[row + col["type.kPosMixed"]] = 1.0
            else:
                out[row + col["type.kPosNone"]] = 1.0
        row, col = OFFSET["gpu"], COLUMN["gpu"]
        out[row + col["is_gpu"]] = float(self.is_gpu)
        for axis in _GPU_AXES:
            out[row + col[axis.replace(".", "_") + "_len"]] = E[plan["gpu"][axis]] if axis in plan["gpu"] else 1.0
        out[row + col["vthread_len"]] = E[plan["vthread"]].prod(axis=0) if plan["vthread"] else 1.0
        # ---- buffer accesses: touched elements at every level (loops i.. vary), i = 0..n
        touched, region0, shapes = [], [], []
        for acc, rows, (dim_of, loop_of, coefs, atom_dims) in zip(s.accesses, plan["shape_rows"], plan["spans"]):
            shapes.append(all_shapes[rows])
            # span[d, i]: how far index dim d moves while loops i.. vary (outer ones fixed)
            contrib = np.zeros((len(acc.dims), n + 1, m))
            if coefs:
                coef = np.empty((len(coefs), m))
                for j, c in enumerate(coefs):
                    coef[j] = self._value(c, vals)
                contrib[dim_of, loop_of] = np.abs(coef) * (E[loop_of] - 1)
            span = np.cumsum(contrib[:, ::-1], axis=1)[:, ::-1]
            for d, lin in atom_dims:
                span[d] += self._atom_suffix(lin, s.loops, m)
            touched.append(np.prod(span + 1, axis=0))
            region0.append(list(span[:, 0] + 1))
        eb = np.array([acc.ele_bytes for acc in s.accesses], dtype=np.float64)
        mem = np.tensordot(eb, np.array(touched), axes=1) if touched else np.zeros((n + 1, m))   # [n+1, m]
        buf_feats, keys = [], []
        for a, (acc, (dims, stride_at, reuse_at)) in enumerate(zip(s.accesses, plan["accesses"])):
            e = eb[a]
            bytes_ = outer * e
            unique = touched[a][0] * e if n else np.full(m, e)
            if stride_at is None:
                stride, reduce_ratio, found = np.zeros(m), E.prod(axis=0) if n else np.ones(m), n
            else:
                i, d, c = stride_at
                below = np.prod(shapes[a][d + 1:], axis=0) if d + 1 < len(shapes[a]) else np.ones(m)
                stride = (np.abs(self._value(c, vals)) if c is not None else 1.0) * below
                reduce_ratio = E[i + 1:].prod(axis=0) if i + 1 < n else np.ones(m)
                found = i
            lines = np.maximum(outer / reduce_ratio * np.minimum(1.0, stride * e / self.cache_line), 1.0)
            n_cont = np.full(m, e)
            done = np.zeros(m, dtype=bool)
            for d in range(len(region0[a]) - 1, -1, -1):
                hit = (~done) & (region0[a][d] == shapes[a][d])
                n_cont = np.where(hit, e * region0[a][d], n_cont)
                done |= hit
            unique_lines = np.maximum(unique / np.minimum(n_cont, self.cache_line), 1.0) if n else np.ones(m)
            f = np.zeros((len(BUFFER_FIELDS), m))
            f[BUF[("acc_type.kRead", "acc_type.kWrite", "acc_type.kReadWrite")[min(acc.acc_type, 2)]]] = 1.0
            sizes = {"bytes": bytes_, "unique_bytes": unique, "lines": lines, "unique_lines": unique_lines}
            for name, x in sizes.items():
                f[BUF[name]] = x
            if reuse_at is None:
                f[BUF["reuse_type.kNoReuse"]] = 1.0
            else:
                r = reuse_at
                f[BUF["reuse_type.kLoopMultipleRead"]] = 1.0
                f[BUF["reuse_dis_iter"]] = E[r + 1:].prod(axis=0) if r + 1 < n else 1.0
                f[BUF["reuse_dis_bytes"]] = mem[r + 1] if r + 1 < n else eb.sum()
                f[BUF["reuse_ct"]] = E[r]
            ct = f[BUF["reuse_ct"]]
            big = ct > 0.5
            safe = np.where(big, ct, 1.0)
            for name, x in sizes.items():
                f[BUF[f"{name}_d_reuse_ct"]] = np.where(big, x / safe, x * 2)
            f[BUF["stride"]] = stride if found == n - 1 else 0.0
            buf_feats.append(f)
            keys.append((lines, bytes_))
        row = OFFSET["buffers"]
        out[row:row + len(BUFFER_FIELDS) * MAX_N_BUFS] = self._top_buffers(buf_feats, keys, m)
        cur = s.ops.float_ops
        if cur > 0 and n:
            ops = cur * np.cumprod(E[::-1], axis=0)                     # innermost first
            out[OFFSET["curve"]:OFFSET["curve"] + CURVE_N] = self._curve(ops, mem[n - 1::-1][:n], cur, m)
        row, col = OFFSET["alloc"], COLUMN["alloc"]
        if s.alloc:
            acc0 = s.accesses[0]
            elems = all_shapes[plan["alloc_rows"]].prod(axis=0)
            alloc_outer = E[:s.n_enclosing].prod(axis=0) if s.n_enclosing else np.ones(m)
            out[row + col["alloc_size"]] = elems * acc0.ele_bytes
            out[row + col["alloc_prod"]] = elems * alloc_outer
            out[row + col["alloc_outer_prod"]] = alloc_outer
            out[row + col["alloc_inner_prod"]] = outer / alloc_outer
        u = plan["unroll"]
        out[row + col["outer_prod"]], out[row + col["num_loops"]] = outer, n
        out[row + col["auto_unroll_max_step"]] = (env[u.name] if isinstance(u, Var) else u) if u is not None else 0.0
        return out

    def _shape_value(self, buf: str, d: int, env: dict):
        x = self.shapes[buf][d] if buf in self.shapes else 1
        return env[x.name] if isinstance(x, Var) else x

    def _uses(self, acc: _Access, var: Var) -> bool:
        return any(var in lin.coef or any(var in self._atom_vars[id(a)] for a in lin.atoms) for lin in acc.dims)

    def _atom_suffix(self, lin: Linear, loops: list, m: int) -> np.ndarray:
        """Span of the non-linear index parts at each level; it only changes where one of an atom's
        loop variables starts to vary, so each atom is bounded once per such position."""
        out = np.zeros((len(loops) + 1, m))
        for a in lin.atoms:
            prev = -1
            for p in self._atom_positions(a, loops):
                out[prev + 1:p + 1] += self._W[self._atom_index[(id(a), self._ranging(a, loops, p))]]
                prev = p
        return out

    @staticmethod
    def _top_buffers(buf_feats: list, keys: list, m: int) -> np.ndarray:
        """The MAX_N_BUFS accesses with most (lines, bytes), zero-padded: [fields * MAX_N_BUFS, m]."""
        feats = np.stack(buf_feats)                       # [n_buf, 18, m]
        lines = np.stack([k[0] for k in keys])            # [n_buf, m]
        bytes_ = np.stack([k[1] for k in keys])
        order = np.lexsort((-bytes_, -lines), axis=0)[:MAX_N_BUFS]   # [<=5, m]
        picked = np.take_along_axis(feats, order[:, None, :], axis=0)
        out = np.zeros((MAX_N_BUFS, len(BUFFER_FIELDS), m))
        out[:picked.shape[0]] = picked
        return out.reshape(MAX_N_BUFS * len(BUFFER_FIELDS), m)

    @staticmethod
    def _curve(ops: np.ndarray, mem: np.ndarray, cur_ops: float, m: int) -> np.ndarray:
        """Arithmetic intensity (ops / bytes) interpolated at CURVE_N evenly spaced op counts: [CURVE_N, m].

        `ops`, `mem`: [n, m], innermost loop level first (ops increasing)."""
        if cur_ops <= 0 or not len(ops):
            return np.zeros((CURVE_N, m))
        ratio = ops / np.maximum(mem, 1e-9)
        x = ops[-1] * (np.arange(1, CURVE_N + 1)[:, None] / CURVE_N)             # [CURVE_N, m]
        pt = np.argmax(ops[:, None, :] >= x[None] - 1e-4, axis=0)                 # [CURVE_N, m]
        prev = np.maximum(pt - 1, 0)
        at = lambda a, rows: np.take_along_axis(a, rows, axis=0)  # noqa: E731
        base, ops_prev = at(ratio, prev), at(ops, prev)
        denom = at(ops, pt) - ops_prev
        safe = np.where(denom != 0, denom, 1)
        slope = np.where(denom != 0, (at(ratio, pt) - base) / safe, 0)
        return np.where(pt == 0, ratio[0], base + slope * (x - ops_prev))


class FeatureExtractor:
    """Features of many states: grouped by structure, one cached template per structure."""

    def __init__(self, task: SearchTask, max_templates: int = 20000):
        self.task = task
        self.templates: dict[str, FeatureTemplate] = {}
        self.max_templates = max_templates

    def template(self, state, key: str | None = None) -> FeatureTemplate:
        """`state`: a State, or anything with `.steps` and a lazily replayed `.state` (a Candidate)."""
        key = key or getattr(state, "structure", None) or structure_key(state)
        tpl = self.templates.get(key)
        if tpl is None:
            if len(self.templates) >= self.max_templates:
                self.templates.clear()
            tpl = self.templates[key] = FeatureTemplate(getattr(state, "state", state), self.task)
        return tpl

    @staticmethod
    def groups(states: Sequence[Program]) -> dict[str, list[int]]:
        """Positions of `states` by structure key (kept on Candidates for the next call)."""
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(states):
            key = getattr(s, "structure", None)
            if key is None:
                key = structure_key(s)
                if hasattr(s, "structure"):
                    s.structure = key
            groups.setdefault(key, []).append(i)
        return groups

    @staticmethod
    def numbers(states: Sequence[Program], idx: list[int]) -> np.ndarray:
        """The open numbers of states[idx] (one structure): [len(idx), slots]."""
        slots = _slots(states[idx[0]])
        return np.array([state_numbers(states[i], slots) for i in idx], dtype=np.int64).reshape(len(idx), len(slots))

    def evaluate(self, key: str, representative, numbers: np.ndarray) -> np.ndarray:
        """Features [m, n_stores, 164] of the m programs of one structure (`representative` is one of
        them; it is replayed only if the structure has no template yet)."""
        return self.template(representative, key)(numbers)

    def __call__(self, states: list) -> list[np.ndarray]:
        """One [n_stores, 164] matrix per state."""
        out: list[np.ndarray | None] = [None] * len(states)
        for key, idx in self.groups(states).items():
            feats = self.evaluate(key, states[idx[0]], self.numbers(states, idx))
            for j, i in enumerate(idx):
                out[i] = feats[j]
        return out  # type: ignore[return-value]
