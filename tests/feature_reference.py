"""The feature computation as it was before it was batched over stores and buffers (commit 7010618):
a frozen copy that tests/test_feature_fast.py compares the fast path with, bit for bit.

`ReferenceTemplate` is a FeatureTemplate (the same structure analysis) whose evaluation is the old
per-store, per-buffer code; `reference_count_ops`, `reference_tree_counts` and `reference_first_loads`
are the old walks of the whole expression tree. Nothing in the package uses this file. One rule has
changed since the copy, in both places: loops of extent 1 are not loops (a program's stride and reuse
loops are the innermost of extent > 1, and num_loops counts those), here written store by store.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from tensortune.search.feature import (
    _ANNOTATION_GROUPS,
    _GPU_AXES,
    _ONEHOT,
    FeatureTemplate,
    _Access,
    _OpCounts,
    _Store,
)
from tensortune.search.feature_layout import (
    BUF,
    BUFFER_FIELDS,
    COLUMN,
    CURVE_N,
    MAX_N_BUFS,
    N_FEATURES,
    OFFSET,
    OP_FIELDS,
)
from tensortune.search.symbolic import IntervalCompiler, Linear
from tensortune.tasks import te
from tensortune.tasks.te import Expr, Var


def reference_count_ops(e: Expr) -> _OpCounts:
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



def reference_tree_counts(roots) -> tuple[_OpCounts, dict]:
    """`feature._tree_counts` by the old walk: every tree walked path by path, its op counts and its
    variables' occurrences times its weight."""
    c = _OpCounts()
    occurrences: dict = {}
    for e, weight in roots:
        for f, n in reference_count_ops(e).items():
            c[f] += weight * n
        for n in te.walk(e):
            if isinstance(n, Var):
                occurrences[n] = occurrences.get(n, 0) + weight
    return c, occurrences


def reference_first_loads(e: Expr) -> dict[str, list]:
    """Every load's indices per tensor, in pre-order, by walking the whole tree."""
    reads: dict[str, list] = {}
    for n in te.walk(e):
        if isinstance(n, te.Load):
            reads.setdefault(n.tensor.name, []).append(n.indices)
    return reads

class ReferenceTemplate(FeatureTemplate):
    """Evaluated by the old code (plans kept here, not on the shared stores)."""

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
        self._ext_rows = {v: r for r, v in enumerate(dict.fromkeys(v for st in self.stores for v, _, _ in st.loops))}
        self._shape_rows = {key: r for r, key in enumerate(dict.fromkeys(
            (acc.buffer, d) for st in self.stores for acc in st.accesses for d in range(len(acc.dims))))}
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

    def _plan(self, s: _Store) -> dict:
        """What about a store's features is structural, decided once per template."""
        plans = self.__dict__.setdefault("_reference_plans", {})
        plan = plans.get(id(s))
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
            strides = []               # (loop index, dim, coefficient or None for a non-linear use), innermost first
            for i in range(n - 1, -1, -1):
                var = s.loops[i][0]
                for d in range(len(acc.dims) - 1, -1, -1):
                    lin = acc.dims[d]
                    if var in lin.coef:
                        strides.append((i, d, lin.coef[var]))
                        break
                    if any(var in self._atom_vars[id(x)] for x in lin.atoms):
                        strides.append((i, d, None))
                        break
            reuse = [i for i in range(n - 1, -1, -1) if not self._uses(acc, s.loops[i][0])]
            plan["accesses"].append((dims, strides, reuse))
            # every (dim, loop, coefficient) of the access at once, for one vectorised span computation
            terms = [(d, k, c) for d, (ts, _) in enumerate(dims) for k, c in ts]
            plan["spans"].append((np.array([d for d, _, _ in terms], dtype=np.intp),
                                  np.array([k for _, k, _ in terms], dtype=np.intp), [c for _, _, c in terms],
                                  [(d, lin) for d, (_, lin) in enumerate(dims) if lin.atoms]))
        plans[id(s)] = plan
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
            for j in range(m):                       # a loop of extent 1 is lowered to no loop
                real = [i for i in plan["kinds"][kind] if E[i, j] > 1]
                if real:
                    out[row + col["num"], j] = len(real)
                    out[row + col["prod"], j] = np.prod([E[i, j] for i in real])
                    out[row + col["len"], j] = E[real[-1], j]
                    out[row + col["type.kPosMixed"], j] = 1.0
                else:
                    out[row + col["type.kPosNone"], j] = 1.0
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
        # a loop of extent 1 is no loop in the code (TVM's lowering drops it): each program's stride and
        # reuse loops are the innermost candidates of extent > 1 in that program
        inner = [E[i:].prod(axis=0) if i < n else np.ones(m) for i in range(n + 1)]
        for a, (acc, (dims, strides, reuse_loops)) in enumerate(zip(s.accesses, plan["accesses"])):
            e = eb[a]
            bytes_ = outer * e
            unique = touched[a][0] * e if n else np.full(m, e)
            stride, reduce_ratio, innermost = np.zeros(m), outer.copy(), np.zeros(m, dtype=bool)
            for i, d, c in reversed(strides):              # outermost first: inner ones win
                below = np.prod(shapes[a][d + 1:], axis=0) if d + 1 < len(shapes[a]) else np.ones(m)
                real = E[i] > 1
                stride = np.where(real, (np.abs(self._value(c, vals)) if c is not None else 1.0) * below, stride)
                reduce_ratio = np.where(real, inner[i + 1], reduce_ratio)
                innermost = np.where(real, inner[i + 1] == 1, innermost)
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
            f[BUF["reuse_type.kNoReuse"]] = 1.0
            for r in reversed(reuse_loops):                # outermost first: inner ones win
                real = E[r] > 1
                f[BUF["reuse_type.kNoReuse"]] = np.where(real, 0.0, f[BUF["reuse_type.kNoReuse"]])
                f[BUF["reuse_type.kLoopMultipleRead"]] = np.where(real, 1.0, f[BUF["reuse_type.kLoopMultipleRead"]])
                f[BUF["reuse_dis_iter"]] = np.where(real, inner[r + 1], f[BUF["reuse_dis_iter"]])
                f[BUF["reuse_dis_bytes"]] = np.where(real, mem[r + 1], f[BUF["reuse_dis_bytes"]])
                f[BUF["reuse_ct"]] = np.where(real, E[r], f[BUF["reuse_ct"]])
            ct = f[BUF["reuse_ct"]]
            big = ct > 0.5
            safe = np.where(big, ct, 1.0)
            for name, x in sizes.items():
                f[BUF[f"{name}_d_reuse_ct"]] = np.where(big, x / safe, x * 2)
            f[BUF["stride"]] = np.where(innermost, stride, 0.0)
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
        out[row + col["outer_prod"]], out[row + col["num_loops"]] = outer, (E > 1).sum(axis=0) if n else 0
        out[row + col["auto_unroll_max_step"]] = (env[u.name] if isinstance(u, Var) else u) if u is not None else 0.0
        return out

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

    def _shape_value(self, buf: str, d: int, env: dict):
        x = self.shapes[buf][d] if buf in self.shapes else 1
        return env[x.name] if isinstance(x, Var) else x

    def _uses(self, acc: _Access, var: Var) -> bool:
        return any(var in lin.coef or any(var in self._atom_vars[id(a)] for a in lin.atoms) for lin in acc.dims)

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

    def _atom_widths(self, env: dict, vals: tuple, m: int) -> tuple:
        if self._atom_fn is None:
            return ()
        ones = np.ones(m, dtype=np.int64)
        X = {name: np.asarray(self._value(self.ext[v], vals)) * ones for v, name in self._loop_names.items()}
        return self._atom_fn(env, X)
