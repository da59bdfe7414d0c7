"""Lowering: State -> loop-nest program (codegen.ir), with inlining and bound inference.

A stage computed at another stage's loop only computes the region its consumers read inside that
loop (TVM's InferBound): the region is bounded symbolically in the enclosing loop variables, its
extent becomes the stage's loop extents (split pieces are tightened to it) and the size of its local
buffer, and stores are guarded where an imperfect split or a clamped region could step outside.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from tensortune.codegen.ir import (
    Allocate,
    Barrier,
    Buffer,
    BufferLoad,
    For,
    IfThenElse,
    LoweredFunc,
    Seq,
    Stmt,
    Store,
    dense_strides,
    seq,
    walk_stmts,
)
from tensortune.schedule.layout_rewrite import WeightLayout
from tensortune.schedule.loop_structure import loop_structure
from tensortune.schedule.stage import GPU_BINDINGS, Stage
from tensortune.schedule.state import State
from tensortune.tasks import te
from tensortune.tasks.arith import Affine, affine_max, affine_min, const_bounds, simplify, symbolic_bounds
from tensortune.tasks.te import Expr, Load, Var

AUTO_UNROLL_MAX_DEPTH = 8
THREAD_ALLREDUCE = "tvm_thread_allreduce"     # cuda: Call name prefix of a block-level all-reduce
_THREAD_AXES = ("threadIdx.x", "threadIdx.y", "threadIdx.z")


class LoweringError(ValueError):
    """A state that cannot become a program (unfilled tile sizes, a stage read outside its scope...)."""


@dataclass
class _StageInfo:
    sid: int
    stage: Stage
    body: Expr                     # the op body with inlined producers substituted
    lo: list[Expr] = field(default_factory=list)       # region start per spatial dim (0 for full)
    extent: list[int] = field(default_factory=list)    # region extent per spatial dim
    loops: dict = field(default_factory=dict)          # leaf var -> extent
    values: dict = field(default_factory=dict)         # root axis -> absolute index expr
    conds: list[Expr] = field(default_factory=list)
    buffer: Buffer | None = None  # set by _make_buffers, before any statement is built
    offset: bool = False          # buffer holds the region only (indices are shifted by lo)

    @property
    def buf(self) -> Buffer:
        """The stage's buffer, once _make_buffers has given every stage one."""
        assert self.buffer is not None, f"{self.stage.name}: statements are built only after _make_buffers"
        return self.buffer


def _attach(st: Stage) -> tuple[str, Var]:
    """(target stage, its loop var) of a stage computed at another stage's loop (compute_at 'iter')."""
    assert st.attach is not None, f"{st.name} is computed at a loop ('iter') but names no loop"
    return st.attach


def _all(conds: list[Expr]) -> Expr:
    """The conjunction of a non-empty list of conditions."""
    out = conds[0]
    for c in conds[1:]:
        out = te.compare("and", out, c)
    return out


class _Lowering:
    def __init__(self, state: State, target_kind: str, layouts: Mapping[str, WeightLayout] | None = None):
        if not state.concrete:
            raise LoweringError("the state still has unfilled split lengths (a sketch); fill them first")
        self.state, self.target_kind = state, target_kind
        self.layouts = dict(layouts or {})
        unknown = set(self.layouts) - {t.name for t in state.dag.inputs}
        if unknown:
            raise LoweringError(f"layouts for {sorted(unknown)}, which are not inputs of the DAG")
        self.stages = state.stages
        self.by_name = {s.name: i for i, s in enumerate(self.stages)}
        self.inlined = {s.name for s in self.stages if s.compute_at == "inline"}
        self.arg_names = {t.name for t in state.dag.args}
        self.info: dict[str, _StageInfo] = {}
        self.ranges: dict[Var, tuple[int, int]] = {}
        # cuda: loops bound to threads of a block (a shared buffer is filled by all of them)
        self.block_local = {it.var for st in self.stages for it in st.iters
                            if it.annotation in _THREAD_AXES + ("vthread",)} if target_kind == "cuda" else set()

    # ------------------------------------------------------------------ scopes

    def _enclosing(self, name: str) -> list[Var]:
        """Loop vars around the point where stage `name` is computed, outermost first."""
        st = self.stages[self.by_name[name]]
        if st.compute_at != "iter":
            return []
        target_name, target_var = _attach(st)
        target = self.stages[self.by_name[target_name]]
        j = target.iter_index(target_var)
        return self._enclosing(target.name) + [it.var for it in target.iters[:j + 1]]

    # ------------------------------------------------------------------ bound inference

    def _region(self, info: _StageInfo, readers: list[str]) -> None:
        op = info.stage.op
        if info.stage.compute_at != "iter":
            info.lo, info.extent = [te.const(0)] * op.ndim, list(op.shape)
            return
        fixed = set(self._enclosing(info.stage.name))
        if info.stage.scope == "shared":
            fixed -= self.block_local
        ranging = {v: r for v, r in self.ranges.items() if v not in fixed}
        lows: list[Affine | None] = [None] * op.ndim
        highs: list[Affine | None] = [None] * op.ndim
        failed = [False] * op.ndim
        for reader in readers:
            if not self.state.computed_within(reader, info.stage.name):
                raise LoweringError(f"{info.stage.name} is computed inside {_attach(info.stage)[0]}'s loop but "
                                    f"{reader} reads it outside that loop; compute it at a common loop instead")
            rinfo = self.info[reader]
            roots = rinfo.values
            bounded: set[tuple] = set()     # (dim, index structure): a Winograd transform reads its tile
            for n in te.walk_distinct(rinfo.body):    # at each index in many equal Load objects
                if not (isinstance(n, Load) and n.tensor.name == op.name):
                    continue
                for d, idx in enumerate(n.indices):
                    if failed[d]:
                        continue
                    key = (d, te.structural_key(idx))
                    if key in bounded:
                        continue
                    bounded.add(key)
                    b = symbolic_bounds(te.substitute(idx, roots), ranging)
                    if b is None:
                        failed[d] = True
                        continue
                    lo, hi = b
                    low, high = lows[d], highs[d]
                    lows[d] = lo if low is None else affine_min(low, lo)
                    highs[d] = hi if high is None else affine_max(high, hi)
                    if lows[d] is None or highs[d] is None:
                        failed[d] = True
        info.lo, info.extent = [], []
        for d, size in enumerate(op.shape):
            low, high = lows[d], highs[d]
            # (both bounds are set or neither: a dimension whose min or max failed is marked failed)
            if failed[d] or low is None or high is None:
                info.lo.append(te.const(0))
                info.extent.append(size)
                continue
            width = high - low
            if width.is_const():
                ext = width.const + 1
            else:
                _, top = const_bounds(width.to_expr(), self.ranges)
                ext = size if top == float("inf") else int(top) + 1
            ext = max(1, min(ext, size))
            # A region as large as the tensor is the whole tensor: no offset, no guards.
            info.lo.append(te.const(0) if ext == size else low.to_expr())
            info.extent.append(ext)

    def _fill_structure(self, info: _StageInfo) -> None:
        op = info.stage.op
        ls = loop_structure(info.stage, list(info.extent) + [a.extent for a in op.reduce_axes])
        info.loops = {it.var: ls.extents[it.var] for it in info.stage.iters}
        for v, e in info.loops.items():
            self.ranges[v] = (0, e - 1)
        info.conds = list(ls.conds)
        info.values = {}
        for d, ax in enumerate(op.axes):
            rel = ls.values[ax]
            info.values[ax] = simplify(info.lo[d] + rel, self.ranges) if info.lo else rel
            if info.stage.compute_at == "iter":
                lo_min, lo_max = const_bounds(info.lo[d], self.ranges)
                if lo_min < 0:
                    info.conds.append(info.values[ax] >= 0)
                if lo_max + info.extent[d] > op.shape[d]:
                    info.conds.append(info.values[ax] < op.shape[d])
        for ax in op.reduce_axes:
            info.values[ax] = ls.values[ax]

    # ------------------------------------------------------------------ buffers and loads

    def _make_buffers(self) -> list[Buffer]:
        args = []
        for t in self.state.dag.args:
            # a rewritten weight is the argument in its new layout (_buffer_index maps the indices)
            shape = self.layouts[t.name].new_shape if t.name in self.layouts else t.shape
            b = Buffer(t.name, t.dtype, shape, dense_strides(shape), "arg")
            args.append(b)
            if t.name in self.info:
                self.info[t.name].buffer = b
        self.arg_buffers = {b.name: b for b in args}
        for info in self.info.values():
            if info.buffer is not None:
                continue
            st = info.stage
            align = {a: (f, o) for a, f, o in st.storage_align}
            if st.compute_at == "iter":
                scope = st.scope if st.scope in ("shared", "local") else "local"
                info.buffer = Buffer(st.name, st.op.dtype, tuple(info.extent), dense_strides(info.extent, align),
                                     scope)
                info.offset = True
            else:
                info.buffer = Buffer(st.name, st.op.dtype, st.op.shape, dense_strides(st.op.shape, align),
                                     "shared" if st.scope == "shared" else "global")
        return args

    def _buffer_index(self, name: str, indices) -> tuple[Buffer, Expr]:
        if name in self.info:
            info = self.info[name]
            if info.offset:
                indices = [i - lo for i, lo in zip(indices, info.lo)]
            return info.buf, info.buf.flat(indices)
        if name in self.layouts:
            indices = self.layouts[name].index(indices)
        return self.arg_buffers[name], self.arg_buffers[name].flat(indices)

    def _lower_expr(self, e: Expr, values: dict) -> Expr:
        e = te.substitute(e, values)
        lowered: dict[tuple, BufferLoad] = {}     # equal loads (by structure) lowered once

        def repl(n: Expr):
            if isinstance(n, Load) and not isinstance(n, BufferLoad):
                key = (n.tensor.name, tuple(te.structural_key(i) for i in n.indices))
                load = lowered.get(key)
                if load is None:
                    buf, idx = self._buffer_index(n.tensor.name, n.indices)
                    load = lowered[key] = BufferLoad(buf, (simplify(idx, self.ranges),))
                return load
            return None
        return te.transform(e, repl)

    # ------------------------------------------------------------------ statements

    def _loop(self, it, extent: int, body: Stmt) -> For:
        kind = {"none": "serial", "unroll": "unroll", "vectorize": "vectorize", "parallel": "parallel",
                "vthread": "vthread", "tensorize": "serial"}.get(it.annotation, it.annotation)
        if kind in GPU_BINDINGS[1:] and self.target_kind != "cuda":
            raise LoweringError(f"iterator {it.name} is bound to {kind}, which needs a CUDA target")
        if kind == "vthread" and self.target_kind != "cuda":
            kind = "serial"
        return For(it.var, extent, kind, body, dict(it.pragmas))

    def _init_nest(self, info: _StageInfo, store_idx: Expr, first_reduce: int) -> Stmt:
        op = info.stage.op
        reduce_vars = {it.var for it in info.stage.iters if it.kind == "reduce"}
        assert isinstance(op.body, te.Reduce), f"{op.name}: only a reduction has an init nest"
        init: Stmt = Store(info.buf, store_idx, op.body.identity)
        conds = [c for c in info.conds if not (te.free_vars(c) & reduce_vars)]
        if conds:
            init = IfThenElse(_all(conds), init)
        for it in reversed(info.stage.iters[first_reduce + 1:]):
            if it.kind == "spatial":
                init = self._loop(it, info.loops[it.var], init)
        return init

    def _attached_at(self, target: str, var: Var) -> list[str]:
        return [s.name for s in self.stages
                if s.compute_at == "iter" and s.attach == (target, var) and s.name in self.info]

    def _nest(self, name: str) -> Stmt:
        """The stage's loops with attached stages (and their allocations) inside them."""
        info = self.info[name]
        st = info.stage
        op = st.op
        out_idx = [info.values[ax] for ax in op.axes]
        buf, store_idx = self._buffer_index(name, out_idx)
        store_idx = simplify(store_idx, self.ranges)
        reduce = op.body if isinstance(op.body, te.Reduce) else None
        if reduce is not None and self.target_kind == "cuda" and \
                any(it.kind == "reduce" and it.annotation in _THREAD_AXES for it in st.iters):
            return self._cross_thread_nest(info, buf, store_idx)
        if reduce is None:
            core: Stmt = Store(buf, store_idx, self._lower_expr(info.body, info.values))
        else:
            assert isinstance(info.body, te.Reduce), f"{name}: inlining keeps a reduction's body a Reduce"
            src = self._lower_expr(info.body.source, info.values)
            comb = {"sum": lambda a, b: a + b, "max": te.maximum, "min": te.minimum}[reduce.combiner]
            core = Store(buf, store_idx, comb(BufferLoad(buf, (store_idx,)), src))
        if info.conds:
            core = IfThenElse(_all(info.conds), core)
        iters = st.iters
        first_reduce = next((k for k, it in enumerate(iters) if it.kind == "reduce"), None)
        body: Stmt = core
        for k in range(len(iters) - 1, -1, -1):
            it = iters[k]
            inner = body
            if first_reduce is not None and k == first_reduce - 1:
                inner = seq([self._init_nest(info, store_idx, first_reduce), inner])
            attached = self._attached_at(name, it.var)
            if attached:
                inner = self._wrap_attached(attached, inner)
            body = self._loop(it, info.loops[it.var], inner)
        if first_reduce == 0:
            body = seq([self._init_nest(info, store_idx, 0), body])
        return body

    def _cross_thread_nest(self, info: _StageInfo, buf: Buffer, store_idx: Expr) -> Stmt:
        """cuda: a reduction with a reduce loop bound to threadIdx.x (TVM's cross-thread reduction).
        Each thread folds its share into a register, one block-level all-reduce combines the
        threads, and every thread stores the result (the same value: a local buffer needs it in
        every thread, a global one gets identical writes)."""
        st = info.stage
        reduce = st.op.body
        assert isinstance(reduce, te.Reduce), f"{st.name}: a cross-thread nest is built only for a reduction"
        reduce_body = info.body
        assert isinstance(reduce_body, te.Reduce), f"{st.name}: inlining keeps a reduction's body a Reduce"
        iters = st.iters
        first = next(k for k, it in enumerate(iters) if it.kind == "reduce")
        if any(it.kind == "spatial" for it in iters[first:]):
            raise LoweringError(f"{st.name}: a cross-thread reduction needs its spatial loops outside its reduce loops")
        bound = [it for it in iters[first:] if it.annotation in _THREAD_AXES]
        if len(bound) != 1 or bound[0].annotation != "threadIdx.x":
            raise LoweringError(f"{st.name}: a cross-thread reduction binds exactly one reduce loop to threadIdx.x")
        for it in iters[first:]:
            if self._attached_at(st.name, it.var):
                raise LoweringError(f"{st.name}: stages computed inside a cross-thread reduction's reduce loops")
        acc = Buffer(st.name + ".red", st.op.dtype, (1,), (1,), "local")
        zero = te.const(0)
        comb = {"sum": lambda a, b: a + b, "max": te.maximum, "min": te.minimum}[reduce.combiner]
        src = self._lower_expr(reduce_body.source, info.values)
        update: Stmt = Store(acc, zero, comb(BufferLoad(acc, (zero,)), src))
        if info.conds:
            update = IfThenElse(_all(info.conds), update)
        for it in reversed(iters[first:]):
            update = self._loop(it, info.loops[it.var], update)
        reduce_vars = {it.var for it in iters[first:]}
        allreduce = Store(acc, zero, te.Call(f"{THREAD_ALLREDUCE}.{reduce.combiner}", (BufferLoad(acc, (zero,)),),
                                            st.op.dtype))
        write: Stmt = Store(buf, store_idx, BufferLoad(acc, (zero,)))
        spatial_conds = [c for c in info.conds if not (te.free_vars(c) & reduce_vars)]
        if spatial_conds:
            write = IfThenElse(_all(spatial_conds), write)
        body: Stmt = Allocate(acc, seq([Store(acc, zero, reduce.identity), update, allreduce, write]))
        for k in range(first - 1, -1, -1):
            it = iters[k]
            attached = self._attached_at(st.name, it.var)
            if attached:
                body = self._wrap_attached(attached, body)
            body = self._loop(it, info.loops[it.var], body)
        return body

    def _wrap_attached(self, names: list[str], inner: Stmt) -> Stmt:
        stmts = [self._nest(n) for n in names] + [inner]
        if self.target_kind == "cuda" and any(self.info[n].buf.scope == "shared" for n in names):
            # the block's threads fill shared buffers together: wait until all have read the previous
            # contents, and until all have written the new ones
            stmts = [Barrier()] + stmts[:-1] + [Barrier(), inner]
        out = seq(stmts)
        for n in reversed(names):
            if self.info[n].buf.scope != "arg":
                out = Allocate(self.info[n].buf, out)
        return out

    # ------------------------------------------------------------------ driver

    def run(self, name: str) -> LoweredFunc:
        bodies = self.state.effective_bodies()
        readers: dict[str, list[str]] = {}
        for i, st in enumerate(self.stages):
            if st.is_placeholder or st.compute_at == "inline":
                continue
            body = bodies[st.name]
            self.info[st.name] = _StageInfo(i, st, body)
            for n in te.walk_distinct(body):
                if isinstance(n, Load):
                    readers.setdefault(n.tensor.name, [])
                    if st.name not in readers[n.tensor.name]:
                        readers[n.tensor.name].append(st.name)
        for st in self.stages:
            if st.compute_at == "iter" and _attach(st)[0] in self.inlined:
                raise LoweringError(f"{st.name} is computed at {_attach(st)[0]}, which is inlined")
        for name_ in reversed(list(self.info)):
            info = self.info[name_]
            self._region(info, readers.get(name_, []))
            self._fill_structure(info)
        args = self._make_buffers()
        roots = [n for n, info in self.info.items() if info.stage.compute_at == "root"]
        program = seq([self._nest(n) for n in roots])
        for root in reversed(roots):
            if self.info[root].buf.scope != "arg":
                program = Allocate(self.info[root].buf, program)
        program = _mark_unroll(program)
        _legalize_loops(program)
        return LoweredFunc(name, args, program, self.state.dag.flop_ct)


VECTOR_STEP_LANES = 16


def _mark_unroll(s: Stmt) -> Stmt:
    """TVM's UnrollLoop: under auto_unroll_max_step, unroll a loop when everything inside it is unrolled,
    at most AUTO_UNROLL_MAX_DEPTH unrolled loops are nested inside it, and extent x statements stays
    within the limit; `unroll` annotations always unroll.

    Counted from the inside out, as TVM counts (post order), over the loops TVM's UnrollLoop sees: a
    loop of extent 1 is a let there (MakeLoopNest), a thread binding an attribute, and a vthread was
    expanded into copies of its body (InjectVirtualThread runs first), so none of them is a loop that
    blocks an unroll or counts toward the depth. (Counting the depth from the root instead, as this did
    before, left every loop of a GPU program, under its block, thread and extent-1 tile loops, and the
    innermost loops of deep CPU nests rolled whatever the pragma said: the search's unroll choices
    changed no kernel there.)"""

    def visit(s: Stmt, max_step: int) -> tuple[int, int, int]:
        """(statements after unrolling, loops inside left rolled, unrolled loops nested inside): TVM's
        step_count_, normal_loop_depth_ and unroll_depth_."""
        if isinstance(s, For):
            step = s.pragmas.get("auto_unroll_max_step", max_step)
            count, rolled, unrolled = visit(s.body, step)
            if s.kind in GPU_BINDINGS:
                return (count * s.extent if s.kind == "vthread" else count), rolled, unrolled
            if s.extent == 1 and s.kind in ("serial", "unroll"):
                return count, rolled, unrolled
            if s.kind == "unroll":
                return count * s.extent, rolled, unrolled + 1
            if s.kind == "vectorize":
                # up to VECTOR_STEP_LANES lanes is one step (TVM's annotation never vectorizes wider);
                # a wider loop (a packing copy's whole row) becomes that many native operations
                return count * -(-s.extent // VECTOR_STEP_LANES), rolled, unrolled
            if (s.kind == "serial" and step > 0 and rolled == 0 and unrolled <= AUTO_UNROLL_MAX_DEPTH
                    and s.extent * count <= step):
                s.kind = "unroll"
                return count * s.extent, 0, unrolled + 1
            return count * s.extent, rolled + 1, unrolled
        if isinstance(s, Seq):
            res = [visit(c, max_step) for c in s.stmts]
            return sum(r[0] for r in res), max(r[1] for r in res), max(r[2] for r in res)
        if isinstance(s, IfThenElse):
            a = visit(s.then, max_step)
            b = visit(s.orelse, max_step) if s.orelse is not None else (0, 0, 0)
            return a[0] + b[0], max(a[1], b[1]), max(a[2], b[2])
        if isinstance(s, Allocate):
            return visit(s.body, max_step)
        return 1, 0, 0

    visit(s, 0)
    return s


def _legalize_loops(body: Stmt) -> None:
    """Downgrade annotations that cannot hold: nested parallel, vectorized loops with no lane-distinct
    stores (a vectorized reduction axis) or with allocations or parallel loops inside."""

    def visit(s: Stmt, in_parallel: bool, in_vector: bool) -> None:
        if isinstance(s, For):
            if s.kind == "parallel" and (in_parallel or in_vector):
                s.kind = "serial"
            if s.kind == "vectorize":
                if in_vector or not _vectorizable(s):
                    s.kind = "unroll" if s.extent <= 64 else "serial"
            visit(s.body, in_parallel or s.kind == "parallel", in_vector or s.kind == "vectorize")
        elif isinstance(s, Seq):
            for c in s.stmts:
                visit(c, in_parallel, in_vector)
        elif isinstance(s, IfThenElse):
            visit(s.then, in_parallel, in_vector)
            if s.orelse is not None:
                visit(s.orelse, in_parallel, in_vector)
        elif isinstance(s, Allocate):
            visit(s.body, in_parallel, in_vector)

    visit(body, False, False)


def _vectorizable(loop: For) -> bool:
    for s in walk_stmts(loop.body):
        if isinstance(s, (Allocate,)) or (isinstance(s, For) and s.kind == "parallel"):
            return False
        if isinstance(s, Store) and loop.var not in te.free_vars(s.index):
            return False
    return True


def lower(state: State, name: str = "default_function", target_kind: str = "cpu",
          layouts: Mapping[str, WeightLayout] | None = None) -> LoweredFunc:
    """The loop-nest program of a concrete state (target_kind 'cpu' or 'cuda'). `layouts` names inputs
    the kernel takes in a rewritten layout (schedule.layout_rewrite): their argument buffers have the
    new shape and every load reads through the layout's index map."""
    return _Lowering(state, target_kind, layouts).run(name)
