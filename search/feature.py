"""Ansor's per-store features (the 164 floats of TVM's feature.cc), for a whole population at once.

This is the search's hot path. Thousands of candidates share a few structures: they differ only in
tile sizes and unroll depths. So features are computed per *structure*: a `FeatureTemplate` is built
once from one representative (loop nests, buffer accesses and their linear index coefficients, all
symbolic in the tile sizes), and then evaluated with numpy over the numbers of every candidate with
that structure. Region sizes of stages computed inside other stages are inferred the same way.
A round evaluates about a thousand templates for a few programs each, so what costs is the number of
numpy calls per evaluation, not their size: all stores and buffer accesses of a template are evaluated
together, as stacked arrays indexed by a plan made once (`_Batch`), in a fixed number of numpy calls.

Deviations from feature.cc, on purpose: index coefficients are exact linear coefficients (not the
pattern-matched approximation), `lines` divides by the extents of the loops it skipped (feature.cc
divides by the innermost extent each time), serial read-write reuse between an init and an update
statement is not modelled, and unique_lines takes each buffer's contiguous run from that buffer's own
touched region (feature.cc reuses the region of the last buffer it visited). Integer op counts include
the index arithmetic of each dimension as written; feature.cc counts it in the flattened index, so it
counts more for a buffer of two or more dimensions.

A loop of extent 1 is no loop: TVM's lowering drops it before feature.cc sees the code, so an access's
stride and reuse come from the innermost loops of extent > 1 in each program, and num_loops counts
those. A structure fixes which loops there are, not their extents, so this is decided per program when
a template is evaluated. Counting such loops (as this file did until 2026-11-28) gave a 1024³ matmul
whose 32-row tile sits outside the reduction and its twin with the tile inside it one feature row,
because a split of extent 1 sat innermost in both; they ran at 20 and 164 GFLOP/s. The same holds for
annotated loops: a vectorised, unrolled or parallel loop of extent 1 is lowered to no loop, so it is
not counted in its annotation's features.

A stage computed inside another one reads at the place its region starts, an expression of the
enclosing loops (its readers' indices with their inner loops at 0), and its own buffer is indexed
relative to that place, as in TVM's lowered code: so its operands' reuse and unique bytes follow the
enclosing loops, and its readers see a buffer the size of the region.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from tensortune.schedule.loop_structure import loop_structure
from tensortune.schedule.program import Program
from tensortune.schedule.stage import Split
from tensortune.schedule.state import State
from tensortune.schedule.steps import FollowFusedSplitStep, FollowSplitStep, PragmaStep, SplitStep
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
from tensortune.search.feature_parts import (
    Part,
    ProgramParts,
    Readers,
    program_parts,
    slots,
    state_numbers,
    structure_key,
)
from tensortune.search.symbolic import FreeVars, IntervalCompiler, compile_exprs, linear_form
from tensortune.tasks import te
from tensortune.tasks.search_task import SearchTask
from tensortune.tasks.te import DTYPE_BYTES, Expr, Var

_GPU_AXES = ("blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y", "threadIdx.z")
_ANNOTATION_GROUPS = (("vectorize", "vec"), ("unroll", "unroll"), ("parallel", "parallel"))   # loop kind, group
_ONEHOT = np.array(onehot_mask())


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


_OP_KIND = {"add": "addsub", "sub": "addsub", "mul": "mul", "div": "divmod", "floordiv": "divmod",
            "floormod": "divmod"}


def _op_field(n: Expr) -> str | None:
    """The op-count feature one node adds to (None: it is no operation)."""
    if isinstance(n, (te.BinOp, te.Cmp)):
        if n.op in ("and", "or"):
            return "bool_op"
        return f"{'float' if te.is_float(n.a.dtype) else 'int'}_{_OP_KIND.get(n.op, 'cmp')}"
    if isinstance(n, te.Not):
        return "bool_op"
    if isinstance(n, te.Select):
        return "select_op"
    if isinstance(n, te.Call):
        return "float_mathfunc" if te.is_float(n.dtype) else "int_mathfunc"
    return None


def _tree_counts(roots: Sequence[tuple[Expr, int]]) -> tuple[_OpCounts, dict[Var, int]]:
    """Operations of the trees `roots` (each counted `weight` times), and how often each variable occurs
    in them: a subtree shared by two parents counts twice. Substituted loop values make index
    expressions share large subtrees, so each distinct node is looked at once and counted as often as
    paths from the roots reach it (parents before children: reversed postorder). Many roots in one walk:
    a stage's loop values share their subtrees too (a fused loop's value is in several axes' values,
    an attached stage's region start holds its reader's index); walked one value at a time, they were
    the largest single part of making a conv's template under cProfile."""
    order: list[Expr] = []
    seen: set[int] = set()
    paths: dict[int, int] = {}
    for e, weight in roots:
        paths[id(e)] = paths.get(id(e), 0) + weight
        stack: list[tuple[Expr, bool]] = [(e, False)]
        while stack:
            node, done = stack.pop()
            if done:
                order.append(node)
            elif id(node) not in seen:
                seen.add(id(node))
                stack.append((node, True))
                stack.extend((k, False) for k in te.children(node) if id(k) not in seen)
    c = _OpCounts()
    occurrences: dict[Var, int] = {}
    for node in reversed(order):
        k = paths.get(id(node), 0)
        if isinstance(node, Var):
            occurrences[node] = k
            continue
        f = _op_field(node)
        if f is not None:
            c[f] += k
        for child in te.children(node):
            paths[id(child)] = paths.get(id(child), 0) + k
    return c, occurrences


def _first_loads(e: Expr) -> dict[str, list]:
    """The indices of each tensor's first load in pre-order (a shared subtree is walked once: its first
    occurrence comes first anyway)."""
    reads: dict[str, list] = {}
    for n in te.walk_distinct(e):
        if isinstance(n, te.Load) and n.tensor.name not in reads:
            reads[n.tensor.name] = [n.indices]
    return reads


@dataclass
class _BodyFacts:
    """What the features need of a stage body before its loop values go in: substituting the values
    (new nodes for every index of a 16 000-node Winograd transform) and walking the result was most of
    a template's making, and it changes nothing but the index expressions. Loop values hold a loop
    variable, so substitution folds nothing: the substituted body's tree counts are these plus each
    variable's occurrences times its value's counts, and its first loads are these with the values put
    into their indices. The one exception: a loop of extent 1 fused into another has the value 0 (a
    reduction drawn as one tile, its outer loop fused with a spatial one in an rfactor sketch; an axis
    of extent 1, such as a batch of one), and substitution folds `k.0 * 64 + k.1` to `k.1`. Those
    constants go in first, and the facts of the folded body are kept per set of constants (structures
    of a sketch share them): the other values then fold nothing, as above."""
    body: Expr
    ops: _OpCounts
    occurrences: dict[Var, int]
    first_loads: dict[str, list]
    folded: dict[tuple, "_BodyFacts"] = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def of(body: Expr) -> "_BodyFacts":
        ops, occurrences = _tree_counts([(body, 1)])
        return _BodyFacts(body, ops, occurrences, _first_loads(body))

    def substituted(self, values: dict) -> tuple[_OpCounts, dict[str, list]]:
        """(op counts, first loads) of the body with `values` (root axis -> expression) put in."""
        consts = tuple((var, c.value, c.dtype) for var in self.occurrences
                       if isinstance(c := values.get(var), te.Const))
        if consts:
            facts = self.folded.get(consts)
            if facts is None:
                folded = te.substitute(self.body, {v: values[v] for v, _, _ in consts})
                facts = self.folded[consts] = _BodyFacts.of(folded)
            return facts.substituted(values)
        ops = _OpCounts(self.ops)
        for f, n in _tree_counts([(values[var], k) for var, k in self.occurrences.items() if var in values])[0].items():
            ops[f] += n
        loads = {t: [[te.substitute(i, values) for i in idx] for idx in lst] for t, lst in self.first_loads.items()}
        return ops, loads


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


@dataclass
class _Batch:
    """A template's stores as index arrays (`FeatureTemplate._make_batch`): S stores, A buffer accesses
    (each of one store), N = the most loops of a store, D = the most dims of a buffer. V (the values
    `_features` stacks) holds every compiled expression, then constants, 1 and 0; rows past a store's
    loops or an access's dims point at 1, so products over them are unchanged."""
    n_stores: int
    n_access: int
    n_loops: int
    n_dims: int
    n_vrows: int
    consts: np.ndarray           # V's rows after the expressions
    shape_consts: np.ndarray     # every buffer dim's size (0 where it is a region symbol), then 1
    shape_env: list              # (row, symbol name) of the region-sized dims
    loop_v: np.ndarray           # [S, N] V row of each loop's extent
    prod_v: np.ndarray           # [rows, N] sets of loop extents to multiply (row s < S: store s's loops)
    shape_prod: np.ndarray       # [rows, D] sets of buffer dims to multiply
    static: np.ndarray           # [S, 164] what does not depend on the numbers
    opvec: np.ndarray            # [S, 16] op counts of one execution of the store
    dyn_store: np.ndarray        # the other per-store features: out[dyn_store, dyn_col] = [P; V[pick_v]][dyn_src]
    dyn_col: np.ndarray
    pick_v: np.ndarray
    dyn_src: np.ndarray
    acc_store: np.ndarray        # [A] per access: its store, its place among the store's accesses, ...
    acc_slot: np.ndarray
    acc_shape: np.ndarray        # [A, D] SH rows of its dims
    dim_valid: np.ndarray        # [A, D]
    eb: np.ndarray               # [A] element bytes
    has_loops: np.ndarray        # [A] its store has loops
    term_acc: np.ndarray         # linear index terms: (access, dim, loop, V row of the coefficient)
    term_dim: np.ndarray
    term_loop: np.ndarray
    term_v: np.ndarray
    atom_rows: np.ndarray        # the spans (rows of [A * D * (N + 1)]) non-linear index parts add to
    atom_matrix: np.ndarray | None   # [len(atom_rows), atoms]: how often each atom's width adds there
    eb_matrix: np.ndarray        # [S, A] element bytes of each store's accesses
    ann_store: np.ndarray        # [G] per (store, annotation kind) with annotated loops: its store,
    ann_at: np.ndarray           # [G] the kind's group offset in the row, and
    ann_loop: np.ndarray         # [G, K] its annotated loops, innermost first (-1: none left)
    stride_loop: np.ndarray      # [A, K] loops that move the access, innermost first (-1: none left)
    stride_v: np.ndarray         # [A, K] V row of each one's coefficient (1: a non-linear use)
    below_at: np.ndarray         # [A, K] shape_prod row: the dims inside the dim each one moves
    reuse_loop: np.ndarray       # [A, K] loops that do not move the access, innermost first (-1: none left)
    buf_static: np.ndarray       # [A, 18] access type flags (the reuse type is per program)
    max_access: int
    curve_store: np.ndarray      # stores with float ops and loops: the curve's inputs
    curve_ops: np.ndarray
    curve_v: np.ndarray          # [C, N] V rows of the extents, innermost first
    curve_level: np.ndarray      # [C, N] the loop level each of those is
    curve_n: np.ndarray
    alloc_store: np.ndarray      # stores whose buffer is allocated
    elems_at: np.ndarray
    alloc_outer_at: np.ndarray
    alloc_bytes: np.ndarray
    unroll_env: list             # (store, symbol name) of unroll depths left open


def _dyn_sources(dyn: list, n_prods: int) -> list[int]:
    """Rows of [P; V[pick_v]] for the (store, column, "P" or "V", row) entries of `dyn`."""
    out, picked = [], 0
    for _, _, kind, row in dyn:
        if kind == "P":
            out.append(row)
        else:
            out.append(n_prods + picked)
            picked += 1
    return out


_CURVE_AT = np.arange(1, CURVE_N + 1)[:, None] / CURVE_N      # the curve's points, fractions of all ops


def _padded(rows: list[list[int]], fill: int) -> np.ndarray:
    """Lists of indices as one [len(rows), K] array (K >= 1), short rows filled with `fill`."""
    width = max((len(r) for r in rows), default=0) or 1
    return np.array([r + [fill] * (width - len(r)) for r in rows], dtype=np.intp).reshape(len(rows), width)


def _real_loops(loops: np.ndarray, E: np.ndarray, store: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The extents [R, K, m] of each row's candidate `loops` [R, K] (-1 past the last) in every program,
    and which of them are loops there (extent over 1): [R, K, m]."""
    ext = E[store[:, None], np.maximum(loops, 0)]
    return ext, (ext > 1) & (loops >= 0)[:, :, None]


def _first_real(loops: np.ndarray, E: np.ndarray, store: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each access's candidate `loops` [A, K] (innermost first, -1 past the last) and every program:
    whether one of them has an extent over 1 in that program, and which (its column): [A, m] each."""
    _, real = _real_loops(loops, E, store)
    return np.asarray(real.any(axis=1)), np.argmax(real, axis=1)


class FeatureTemplate:
    """Features of every state with one structure, as a function of its open numbers."""

    def __init__(self, state: State, task: SearchTask, body_facts: Callable[[Expr], _BodyFacts] = _BodyFacts.of,
                 part: Part | None = None):
        """`part` (of `state`, `feature_parts.program_parts`): the rows of its stores alone, as a function
        of its open numbers. The program's other numbers are symbols too, which no evaluation binds: a
        feature that depended on one would fail to evaluate, not quietly keep this program's value."""
        every_slot = slots(state)
        self.slots = list(part.slots) if part is not None else every_slot
        self.is_gpu = task.target_kind == "cuda"
        self.cache_line = task.hardware.cache_line_bytes
        names: dict[Var, str] = {}
        sym: dict[tuple[int, int], Var] = {}
        for i, k in every_slot:
            v = Var(f"L{i}_{k}" if k >= 0 else f"P{i}")
            sym[(i, k)], names[v] = v, v.name
        self._slot_syms = [sym[slot] for slot in self.slots]

        def lengths(rel: Split) -> list:
            return _split_lengths(state.steps, sym, rel.step)

        # stage ids do not move after the annotation steps, so a pragma step's stage is final
        pragma_sym: dict[str, Var] = {}
        for i, k in every_slot:
            step = state.steps[i]
            if k < 0 and isinstance(step, PragmaStep):
                pragma_sym[state.stages[step.stage_id].name] = sym[(i, -1)]
        self._tensor_shapes = {st.name: list(st.op.shape) for st in state.stages}
        bodies = state.effective_bodies()
        outputs = {t.name for t in task.dag.args}
        mine = set(part.stages) if part is not None else range(len(state.stages))
        self.stage_names = [s.name for i, s in enumerate(state.stages)
                            if i in mine and not s.is_placeholder and s.compute_at != "inline"]
        self.shapes: dict[str, list] = {}
        self.region_syms: dict[str, list[Var]] = {}
        self.ext: dict[Var, object] = {}
        nests: dict[str, list] = {}
        enclosing: dict[str, int] = {}
        values: dict[str, dict] = {}
        by_name = {s.name: s for s in state.stages}
        for s in state.stages:
            if s.is_placeholder or s.compute_at == "root":     # (a part's stages: set again below)
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
        loads: dict[str, dict[str, list]] = {}
        ops: dict[str, _OpCounts] = {}
        for name in reversed(self.stage_names):
            st = by_name[name]
            vals = values[name]
            if name in self.region_syms:
                base = _region_base(name, nests, enclosing, loads, self.stage_names)
                if base is not None:
                    vals = {**vals, **{a: te.binary("add", b, vals[a]) for a, b in zip(st.op.axes, base)}}
            body = bodies[name]
            ops[name], loads[name] = body_facts(body.source if isinstance(body, te.Reduce) else body).substituted(vals)
        self.stores: list[_Store] = []
        free_vars = FreeVars()
        for name in self.stage_names:
            st = by_name[name]
            loops = nests[name]
            loop_vars = {v for v, _, _ in loops}
            body = bodies[name]
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
                if buf in by_name and by_name[buf].compute_at == "iter" and buf not in self.region_syms:
                    raise ValueError(f"{name} reads {buf}, computed inside another stage, from outside its part")
                idx = idx_list[0]
                if buf in self.region_syms:       # a region buffer: its enclosing loops only move the region
                    fixed = {v: te.const(0) for v, _, _ in nests[buf][:enclosing[buf]]}
                    idx = [te.substitute(i, fixed) for i in idx]
                accesses.append(_Access(buf, [linear_form(i, loop_vars, free_vars) for i in idx], 0,
                                        DTYPE_BYTES[dtype]))
            if isinstance(body, te.Reduce):
                ops[name]["float_addsub"] += 1 if te.is_float(st.op.dtype) and body.combiner == "sum" else 0
                ops[name]["float_cmp"] += 1 if te.is_float(st.op.dtype) and body.combiner != "sum" else 0
            self.stores.append(_Store(name, loops, enclosing[name], accesses, ops[name], name not in outputs))
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
        self._batch = self._make_batch()

    def _compile_atoms(self) -> None:
        """Numpy functions for every (non-linear index part, set of varying loops) the features need:
        one for the per-level touched regions of the stores (`_atom_index`: where each lands), one for
        the region inference of attached stages (`_region_index`), which runs once per attached stage
        and needs only the readers' few."""
        in_order = list(dict.fromkeys(v for st in self.stores for v, _, _ in st.loops))
        loop_vars = set(in_order)
        # named in the order the stores run them, so the same loop nest compiles to the same source
        self._loop_names = {v: f"x{k}" for k, v in enumerate(in_order)}
        stores, regions = [], []
        for store in self.stores:
            for acc in store.accesses:
                for lin in acc.dims:
                    for a in lin.atoms:
                        for p in self._atom_positions(a, store.loops):
                            stores.append((a, self._ranging(a, store.loops, p)))
        for name, readers in self.readers.items():
            start = next(st.n_enclosing for st in self.stores if st.stage == name)
            for store, acc in readers:
                for lin in acc.dims:
                    for a in lin.atoms:
                        regions.append((a, self._ranging(a, store.loops, start)))
        self._atom_index, self._atom_fn, self._atom_x = self._compile_atom_set(loop_vars, stores)
        self._region_index, self._region_fn, self._region_x = self._compile_atom_set(loop_vars, regions)
        # region inference, consumers first (they come later in stage order): per attached stage, its
        # shape, its size symbols and, per reader access dim, the (coefficient, extent) of each loop
        # inside the attach point and the widths of the non-linear parts
        self._regions: list[tuple[list, list[str], list]] = []
        for name in reversed(self.stage_names):
            if name not in self.region_syms:
                continue
            start = next(st.n_enclosing for st in self.stores if st.stage == name)
            dims = []
            for store, acc in self.readers[name]:
                for d, lin in enumerate(acc.dims):
                    terms = [(lin.coef[v], self.ext[v]) for v, _, _ in store.loops[start:] if v in lin.coef]
                    atoms = [self._region_index[(id(a), self._ranging(a, store.loops, start))] for a in lin.atoms]
                    dims.append((d, terms, atoms))
            self._regions.append((self._tensor_shapes[name], [v.name for v in self.region_syms[name]], dims))

    def _compile_atom_set(self, loop_vars: set, wanted: list) -> tuple[dict, Callable | None, list]:
        """(position of each (id(atom), ranging) in the result, f(e, X) computing the widths, the
        (X name, extent) of the loops f reads)."""
        # split lengths (L..) and region sizes (R..) are at least 1, unroll depths (P..) at least 0
        floors = {name: 1 if name[0] in "LR" else 0 for name in self._names.values()}
        comp = IntervalCompiler({**self._names, **self._loop_names}, loop_vars, floors)
        index: dict = {}
        outputs: list[str] = []
        for a, ranging in wanted:
            key = (id(a), ranging)
            if key not in index:
                lo, hi = comp.bound(a, ranging)
                index[key] = len(outputs)
                outputs.append(f"np.abs(({hi}) - ({lo}))")
        if not outputs:
            return index, None, []
        source = "\n".join(comp.lines + outputs)
        fn = comp.function(outputs)                     # compiled once per source (symbolic.compiled)
        read = set(re.findall(r"X\['(\w+)'\]", source))
        return index, fn, [(x, self.ext[v]) for v, x in self._loop_names.items() if x in read]

    def _atom_positions(self, a, loops: list) -> list[int]:
        return sorted(k for k, (v, _, _) in enumerate(loops) if v in self._atom_vars[id(a)])

    def _ranging(self, a, loops: list, start: int) -> frozenset:
        return frozenset(v for v, _, _ in loops[start:] if v in self._atom_vars[id(a)])

    def _atom_widths(self, fn: Callable | None, loops: list, env: dict, vals: tuple, m: int) -> tuple:
        if fn is None:
            return ()
        ones = np.ones(m, dtype=np.int64)
        return fn(env, {name: np.asarray(self._value(x, vals)) * ones for name, x in loops})

    # -------------------------------------------------------------------------------- evaluation

    def _value(self, x, vals: tuple):
        if isinstance(x, (int, float)):
            return x
        return vals[self._index[id(x)]]

    def __call__(self, numbers: np.ndarray) -> np.ndarray:
        """numbers: [m, len(slots)] -> features [m, n_stores, 164]."""
        m = numbers.shape[0]
        env = dict(zip((v.name for v in self._slot_syms), np.asarray(numbers, dtype=np.int64).T.copy()))
        ones = np.ones(m, dtype=np.int64)
        for region in self.region_syms.values():     # provisional, refined below
            for v in region:
                env[v.name] = ones
        vals = self._fn(env)
        for shape, syms, dims in self._regions:        # refine them, consumers first
            RW = self._atom_widths(self._region_fn, self._region_x, env, vals, m)
            widths = [np.zeros(m, dtype=np.int64) for _ in shape]
            for d, terms, atoms in dims:               # the span of each reader's index inside the attach point
                w = np.zeros(m, dtype=np.int64)
                for c, x in terms:
                    w = w + np.abs(np.asarray(self._value(c, vals))) * (np.asarray(self._value(x, vals)) * ones - 1)
                for i in atoms:
                    w = w + RW[i]
                widths[d] = np.maximum(widths[d], w)
            for d, sym in enumerate(syms):
                env[sym] = np.minimum(np.maximum(widths[d] + 1, 1), shape[d])   # np.clip, without its overhead
            vals = self._fn(env)
        W = self._atom_widths(self._atom_fn, self._atom_x, env, vals, m)
        raw = self._features(vals, W, env, m)                # [stores, 164, m]
        logged = np.sign(raw) * np.log2(np.abs(raw) + 1)
        out = np.where(_ONEHOT[None, :, None], raw, logged)
        return out.transpose(2, 0, 1)

    def _features(self, vals: tuple, W: tuple, env: dict, m: int) -> np.ndarray:
        """The raw features [stores, 164, m] of every store at once: a fixed number of numpy operations
        on stacked arrays (stores x loops, buffer accesses x dims x loop levels), whatever the structure.

        Everything structural (which loop a product runs over, where a value goes) is an index array of
        `_Batch`, made once per template. Products and sums here only ever combine integers (extents,
        sizes, coefficients, bytes: exact in float64 below 2**53), so padding with ones and zeros and
        stacking leave them bit for bit what a store-by-store loop computes; every operation on
        fractions (cache lines, reuse ratios, the curve) is the same elementwise formula."""
        b = self._batch
        S, A, N, D = b.n_stores, b.n_access, b.n_loops, b.n_dims
        V = np.empty((b.n_vrows, m))           # every extent and coefficient, then constants, 1 and 0
        for i, x in enumerate(vals):
            V[i] = x
        V[len(vals):] = b.consts[:, None]
        SH = np.empty((len(b.shape_consts), m))  # every buffer dimension's size, then 1
        SH[:] = b.shape_consts[:, None]
        for row, name in b.shape_env:
            SH[row] = env[name]
        E = V[b.loop_v]                                   # [S, N, m] loop extents (1 past a store's own)
        P = V[b.prod_v].prod(axis=1)                      # [rows, m] products of sets of extents
        Q = SH[b.shape_prod].prod(axis=1)                 # [rows, m] products of sets of buffer dims
        outer = P[:S]
        out = np.empty((S, N_FEATURES, m))
        out[:] = b.static[:, :, None]
        ops_at = OFFSET["ops"]
        out[:, ops_at:ops_at + len(OP_FIELDS)] = b.opvec[:, :, None] * outer[:, None, :]
        out[b.dyn_store, b.dyn_col] = np.concatenate([P, V[b.pick_v]])[b.dyn_src]
        if len(b.ann_store):                    # annotated loops: those of extent > 1 only, as lowered
            ext, real = _real_loops(b.ann_loop, E, b.ann_store)                    # [G, K, m]
            num = real.sum(axis=1)
            some = num > 0
            innermost = ext[np.arange(len(num))[:, None], np.argmax(real, axis=1), np.arange(m)]
            col = COLUMN["vec"]                 # the three groups' fields are laid out alike
            gs, group = b.ann_store, b.ann_at
            out[gs, group + col["num"]] = num
            out[gs, group + col["prod"]] = np.where(some, np.where(real, ext, 1.0).prod(axis=1), 0.0)
            out[gs, group + col["len"]] = np.where(some, innermost, 0.0)
            out[gs, group + col["type.kPosMixed"]] = some
            out[gs, group + col["type.kPosNone"]] = ~some
        # ---- buffer accesses: span of each index dim while loops i.. vary (outer ones fixed), i = 0..n
        sa = b.acc_store
        contrib = np.zeros((A, D, N + 1, m))
        if len(b.term_v):
            contrib[b.term_acc, b.term_dim, b.term_loop] = np.abs(V[b.term_v]) * (E[sa[b.term_acc], b.term_loop] - 1)
        span = np.cumsum(contrib[:, :, ::-1], axis=2)[:, :, ::-1]
        if b.atom_matrix is not None:
            Wm = np.empty((len(W), m))
            for i, w in enumerate(W):
                Wm[i] = w
            span = np.ascontiguousarray(span)
            span.reshape(A * D * (N + 1), m)[b.atom_rows] += b.atom_matrix @ Wm
        touched = np.prod(span + 1, axis=1)               # [A, N+1, m]
        region0 = span[:, :, 0] + 1                       # [A, D, m]
        mem = (b.eb_matrix @ touched.reshape(A, -1)).reshape(S, N + 1, m)
        eb = b.eb[:, None]
        bytes_ = outer[sa] * eb
        unique = touched[:, 0] * eb
        # the loops a program really has: a loop of extent 1 is no loop in the code (TVM's lowering
        # drops it), so an access's stride and reuse come from the innermost loops of extent > 1
        inner = np.ones((S, N + 1, m))                     # [S, N+1, m] products of the extents of loops i..
        inner[:, :N] = np.cumprod(E[:, ::-1], axis=1)[:, ::-1]
        acc_m = (np.arange(A)[:, None], np.arange(m))
        has_stride, ks = _first_real(b.stride_loop, E, sa)
        i = b.stride_loop[acc_m[0], ks]                      # [A, m]
        inside = inner[sa[:, None], i + 1, acc_m[1]]        # the loops inside the stride's loop
        stride = np.where(has_stride, np.abs(V[b.stride_v[acc_m[0], ks], acc_m[1]])
                          * Q[b.below_at[acc_m[0], ks], acc_m[1]], 0.0)
        lines = np.maximum(outer[sa] / np.where(has_stride, inside, outer[sa])
                           * np.minimum(1.0, stride * eb / self.cache_line), 1.0)
        n_cont = np.broadcast_to(eb, (A, m))
        if D:
            hit = (region0 == SH[b.acc_shape]) & b.dim_valid[:, :, None]
            last = D - 1 - np.argmax(hit[:, ::-1], axis=1)
            at_last = region0[np.arange(A)[:, None], last, np.arange(m)]
            n_cont = np.where(hit.any(axis=1), eb * at_last, eb)
        unique_lines = np.where(b.has_loops[:, None], np.maximum(unique / np.minimum(n_cont, self.cache_line), 1.0),
                                1.0)
        F = np.empty((A, len(BUFFER_FIELDS), m))
        F[:] = b.buf_static[:, :, None]
        sizes = {"bytes": bytes_, "unique_bytes": unique, "lines": lines, "unique_lines": unique_lines}
        for name, x in sizes.items():
            F[:, BUF[name]] = x
        reuse, kr = _first_real(b.reuse_loop, E, sa)
        r = b.reuse_loop[acc_m[0], kr]                       # [A, m]
        F[:, BUF["reuse_type.kLoopMultipleRead"]] = reuse
        F[:, BUF["reuse_type.kNoReuse"]] = ~reuse
        F[:, BUF["reuse_dis_iter"]] = np.where(reuse, inner[sa[:, None], r + 1, acc_m[1]], 0.0)
        F[:, BUF["reuse_dis_bytes"]] = np.where(reuse, mem[sa[:, None], r + 1, acc_m[1]], 0.0)
        ct = np.where(reuse, E[sa[:, None], r, acc_m[1]], 0.0)
        F[:, BUF["reuse_ct"]] = ct
        big = ct > 0.5
        safe = np.where(big, ct, 1.0)
        for name, x in sizes.items():
            F[:, BUF[f"{name}_d_reuse_ct"]] = np.where(big, x / safe, x * 2)
        F[:, BUF["stride"]] = np.where(has_stride & (inside == 1), stride, 0.0)   # only the innermost loop's
        # ---- the MAX_N_BUFS accesses of each store with most (lines, bytes), zero-padded
        slots = (sa, b.acc_slot)
        Fp = np.zeros((S, b.max_access, len(BUFFER_FIELDS), m))
        Fp[slots] = F
        neg_lines = np.full((S, b.max_access, m), np.inf)
        neg_bytes = np.full((S, b.max_access, m), np.inf)
        neg_lines[slots], neg_bytes[slots] = -lines, -bytes_
        order = np.lexsort((neg_bytes, neg_lines), axis=1)[:, :MAX_N_BUFS]          # [S, <=5, m]
        picked = Fp[np.arange(S)[:, None, None, None], order[:, :, None, :], np.arange(len(BUFFER_FIELDS))[:, None],
                    np.arange(m)]
        row = OFFSET["buffers"]
        out[:, row:row + picked.shape[1] * len(BUFFER_FIELDS)] = picked.reshape(S, -1, m)   # the rest stays 0
        # ---- arithmetic intensity (ops / bytes) at CURVE_N evenly spaced op counts, innermost level first
        if len(b.curve_store):
            cs = b.curve_store
            ops = b.curve_ops[:, None, None] * np.cumprod(V[b.curve_v], axis=1)      # [C, N, m]
            ratio = ops / np.maximum(mem[cs[:, None], b.curve_level], 1e-9)
            x = ops[np.arange(len(cs)), b.curve_n - 1][:, None, :] * _CURVE_AT[None]  # [C, CURVE_N, m]
            pt = np.argmax(ops[:, :, None, :] >= x[:, None] - 1e-4, axis=1)          # [C, CURVE_N, m]
            prev = np.maximum(pt - 1, 0)
            at = (np.arange(len(cs))[:, None, None], prev, np.arange(m))      # take_along_axis, without its overhead
            base, ops_prev = ratio[at], ops[at]
            at = (at[0], pt, at[2])
            denom = ops[at] - ops_prev
            safe = np.where(denom != 0, denom, 1)
            slope = np.where(denom != 0, (ratio[at] - base) / safe, 0)
            out[cs, OFFSET["curve"]:OFFSET["curve"] + CURVE_N] = np.where(pt == 0, ratio[:, :1],
                                                                          base + slope * (x - ops_prev))
        # ---- allocation of the stage's own buffer (its first access)
        if len(b.alloc_store):
            al = b.alloc_store
            row, col = OFFSET["alloc"], COLUMN["alloc"]
            elems, alloc_outer = Q[b.elems_at], P[b.alloc_outer_at]
            out[al, row + col["alloc_size"]] = elems * b.alloc_bytes[:, None]
            out[al, row + col["alloc_prod"]] = elems * alloc_outer
            out[al, row + col["alloc_outer_prod"]] = alloc_outer
            out[al, row + col["alloc_inner_prod"]] = outer[al] / alloc_outer
        for s, name in b.unroll_env:
            out[s, OFFSET["alloc"] + COLUMN["alloc"]["auto_unroll_max_step"]] = env[name]
        out[:, OFFSET["alloc"] + COLUMN["alloc"]["num_loops"]] = (E > 1).sum(axis=1)   # loops of extent > 1
        return out

    def _make_batch(self) -> "_Batch":
        """What about the stores' features is structural, as index arrays for `_features` (made once)."""
        stores = self.stores
        consts: dict = {}
        n_exprs = len(self._exprs)

        def vrow(x) -> int:
            """The row of V that holds `x` (a compiled expression, or a number)."""
            if isinstance(x, (int, float)):
                return consts.setdefault(x, n_exprs + len(consts))
            return self._index[id(x)]

        one, zero = vrow(1), vrow(0)
        S, N = len(stores), max((len(s.loops) for s in stores), default=0)
        loop_v = [[vrow(self.ext[v]) for v, _, _ in s.loops] + [one] * (N - len(s.loops)) for s in stores]
        prods: list[list[int]] = []              # rows of V[prod_v]: sets of loops whose extents multiply

        def prod(si: int, ks) -> int:
            r = [one] * N
            for k in ks:
                r[k] = loop_v[si][k]
            prods.append(r)
            return len(prods) - 1

        for si, s in enumerate(stores):
            prod(si, range(len(s.loops)))        # row si: the store's outer product
        shape_consts: list[float] = []
        shape_env: list[tuple[int, str]] = []
        shape_row: dict[tuple[str, int], int] = {}
        for s in stores:
            for acc in s.accesses:
                for d in range(len(acc.dims)):
                    if (acc.buffer, d) not in shape_row:
                        x = self.shapes[acc.buffer][d] if acc.buffer in self.shapes else 1
                        shape_row[(acc.buffer, d)] = len(shape_consts)
                        if isinstance(x, Var):
                            shape_env.append((len(shape_consts), x.name))
                            shape_consts.append(0.0)
                        else:
                            shape_consts.append(float(x))
        shape_one = len(shape_consts)
        shape_consts.append(1.0)
        D = max((len(acc.dims) for s in stores for acc in s.accesses), default=0)
        shape_prods: list[list[int]] = []

        def shape_prod(rows: list[int]) -> int:
            shape_prods.append(rows + [shape_one] * (D - len(rows)))
            return len(shape_prods) - 1

        static = np.zeros((S, N_FEATURES))
        dyn: list[tuple[int, int, str, int]] = []    # (store, column, "P" or "V", row)
        opvec = np.array([s.ops.vector() for s in stores], dtype=np.float64).reshape(S, len(OP_FIELDS))
        acc_store: list[int] = []
        acc_slot: list[int] = []
        acc_shape: list[list[int]] = []
        dim_valid: list[list[bool]] = []
        eb: list[float] = []
        has_loops: list[bool] = []
        term_acc: list[int] = []
        term_dim: list[int] = []
        term_loop: list[int] = []
        term_v: list[int] = []
        stride_loop: list[list[int]] = []
        stride_v: list[list[int]] = []
        below_at: list[list[int]] = []
        reuse_loop: list[list[int]] = []
        buf_static: list[np.ndarray] = []
        atoms: list[tuple[int, int, int, int]] = []     # (access, dim, level, W row): W adds there
        curve_store, curve_ops, curve_v, curve_level, curve_n = [], [], [], [], []
        alloc_store, elems_at, alloc_outer_at, alloc_bytes = [], [], [], []
        unroll_env: list[tuple[int, str]] = []
        ann_store: list[int] = []
        ann_at: list[int] = []
        ann_loop: list[list[int]] = []
        for si, s in enumerate(stores):
            n = len(s.loops)
            ann = [a for _, a, _ in s.loops]
            for kind, group in _ANNOTATION_GROUPS:
                idx = [i for i, a in enumerate(ann) if a == kind]
                if idx:                          # whether they are loops is per program
                    ann_store.append(si)
                    ann_at.append(OFFSET[group])
                    ann_loop.append(idx[::-1])
                else:
                    static[si, OFFSET[group] + COLUMN[group]["type.kPosNone"]] = 1.0
            row, col = OFFSET["gpu"], COLUMN["gpu"]
            static[si, row + col["is_gpu"]] = float(self.is_gpu)
            gpu = {a: i for i, a in enumerate(ann) if a in _GPU_AXES}
            for axis in _GPU_AXES:
                c = row + col[axis.replace(".", "_") + "_len"]
                if axis in gpu:
                    dyn.append((si, c, "V", loop_v[si][gpu[axis]]))
                else:
                    static[si, c] = 1.0
            vthread = [i for i, a in enumerate(ann) if a == "vthread"]
            if vthread:
                dyn.append((si, row + col["vthread_len"], "P", prod(si, vthread)))
            else:
                static[si, row + col["vthread_len"]] = 1.0
            pos = {v: k for k, (v, _, _) in enumerate(s.loops)}
            for j, acc in enumerate(s.accesses):
                a = len(acc_store)
                acc_store.append(si)
                acc_slot.append(j)
                rows = [shape_row[(acc.buffer, d)] for d in range(len(acc.dims))]
                acc_shape.append(rows + [shape_one] * (D - len(rows)))
                dim_valid.append([True] * len(rows) + [False] * (D - len(rows)))
                eb.append(float(acc.ele_bytes))
                has_loops.append(n > 0)
                for d, lin in enumerate(acc.dims):
                    for v, c in lin.coef.items():
                        if v in pos:
                            term_acc.append(a)
                            term_dim.append(d)
                            term_loop.append(pos[v])
                            term_v.append(vrow(c))
                    for x in lin.atoms:
                        prev = -1
                        for p in self._atom_positions(x, s.loops):
                            w = self._atom_index[(id(x), self._ranging(x, s.loops, p))]
                            atoms += [(a, d, level, w) for level in range(prev + 1, p + 1)]
                            prev = p
                moves: list[tuple[int, int, int]] = []     # (loop, V row of its coefficient, shape_prod row)
                for i in range(n - 1, -1, -1):             # each loop's innermost-varying dim of the access
                    var = s.loops[i][0]
                    for d in range(len(acc.dims) - 1, -1, -1):
                        lin = acc.dims[d]
                        if var in lin.coef or any(var in self._atom_vars[id(x)] for x in lin.atoms):
                            c = lin.coef.get(var)
                            moves.append((i, one if c is None else vrow(c), shape_prod(rows[d + 1:])))
                            break
                stride_loop.append([i for i, _, _ in moves])
                stride_v.append([v for _, v, _ in moves])
                below_at.append([q for _, _, q in moves])
                reuse_loop.append([i for i in range(n - 1, -1, -1) if i not in stride_loop[-1]])   # the rest
                f = np.zeros(len(BUFFER_FIELDS))
                f[BUF[("acc_type.kRead", "acc_type.kWrite", "acc_type.kReadWrite")[min(acc.acc_type, 2)]]] = 1.0
                buf_static.append(f)
            if s.ops.float_ops > 0 and n:
                curve_store.append(si)
                curve_ops.append(float(s.ops.float_ops))
                curve_v.append([loop_v[si][n - 1 - j] if j < n else one for j in range(N)])
                curve_level.append([n - 1 - j if j < n else 0 for j in range(N)])
                curve_n.append(n)
            if s.alloc:
                first = s.accesses[0]
                alloc_store.append(si)
                elems_at.append(shape_prod([shape_row[(first.buffer, d)] for d in range(len(first.dims))]))
                alloc_outer_at.append(prod(si, range(s.n_enclosing)))
                alloc_bytes.append(float(first.ele_bytes))
            row, col = OFFSET["alloc"], COLUMN["alloc"]
            dyn.append((si, row + col["outer_prod"], "P", si))
            u = next((u for _, _, u in reversed(s.loops) if u is not None), None)
            if isinstance(u, Var):
                unroll_env.append((si, u.name))
            else:
                static[si, row + col["auto_unroll_max_step"]] = u if u is not None else 0.0
        A = len(acc_store)
        no_dims = shape_prod([])            # the product of no dims (1): where an access has no more strides
        atom_rows = sorted({(a * D + d) * (N + 1) + level for a, d, level, _ in atoms})
        atom_matrix = None
        if atoms:
            at_row = {r: i for i, r in enumerate(atom_rows)}
            atom_matrix = np.zeros((len(atom_rows), len(self._atom_index)))
            for a, d, level, w in atoms:
                atom_matrix[at_row[(a * D + d) * (N + 1) + level], w] += 1.0
        eb_matrix = np.zeros((S, A))
        eb_matrix[acc_store, np.arange(A)] = eb
        n_p = len(prods)
        ints = lambda xs: np.array(xs, dtype=np.intp)  # noqa: E731
        return _Batch(
            n_stores=S, n_access=A, n_loops=N, n_dims=D, n_vrows=n_exprs + len(consts),
            consts=np.array(list(consts), dtype=np.float64), shape_consts=np.array(shape_consts),
            shape_env=shape_env, loop_v=np.array(loop_v, dtype=np.intp).reshape(S, N),
            prod_v=np.array(prods, dtype=np.intp).reshape(n_p, N),
            shape_prod=np.array(shape_prods, dtype=np.intp).reshape(len(shape_prods), D),
            static=static, opvec=opvec, dyn_store=ints([x[0] for x in dyn]), dyn_col=ints([x[1] for x in dyn]),
            pick_v=ints([x[3] for x in dyn if x[2] == "V"]),
            dyn_src=ints(_dyn_sources(dyn, n_p)),
            acc_store=ints(acc_store), acc_slot=ints(acc_slot), acc_shape=ints(acc_shape).reshape(A, D),
            dim_valid=np.array(dim_valid, dtype=bool).reshape(A, D), eb=np.array(eb), has_loops=np.array(has_loops),
            term_acc=ints(term_acc), term_dim=ints(term_dim), term_loop=ints(term_loop), term_v=ints(term_v),
            atom_rows=ints(atom_rows), atom_matrix=atom_matrix, eb_matrix=eb_matrix,
            ann_store=ints(ann_store), ann_at=ints(ann_at), ann_loop=_padded(ann_loop, -1),
            stride_loop=_padded(stride_loop, -1), stride_v=_padded(stride_v, zero),
            below_at=_padded(below_at, no_dims), reuse_loop=_padded(reuse_loop, -1),
            buf_static=np.array(buf_static).reshape(A, -1),
            max_access=max((len(s.accesses) for s in stores), default=0),
            curve_store=ints(curve_store), curve_ops=np.array(curve_ops), curve_v=ints(curve_v).reshape(-1, N),
            curve_level=ints(curve_level).reshape(-1, N), curve_n=ints(curve_n), alloc_store=ints(alloc_store),
            elems_at=ints(elems_at), alloc_outer_at=ints(alloc_outer_at), alloc_bytes=np.array(alloc_bytes),
            unroll_env=unroll_env)


class _BodyFactsCache:
    """`_BodyFacts` per body object, for the templates of one task: structures of a sketch share their
    stages' bodies (`State.effective_bodies` and the rewrites hand out the same objects), so one walk
    of a large body serves every structure. Each entry holds its body (`_BodyFacts.body`), so no other
    takes its id."""

    def __init__(self, max_bodies: int = 4096):
        self.entries: dict[int, _BodyFacts] = {}
        self.max_bodies = max_bodies

    def __call__(self, body: Expr) -> _BodyFacts:
        hit = self.entries.get(id(body))
        if hit is not None:
            return hit
        if len(self.entries) >= self.max_bodies:
            self.entries.clear()
        facts = self.entries[id(body)] = _BodyFacts.of(body)
        return facts


def _replayed(program: Program | None) -> State:
    """The State of a State or of a Candidate (replayed on first use)."""
    state = getattr(program, "state", program)
    if not isinstance(state, State):
        raise TypeError(f"features are made from a State or a Candidate, not {type(program).__name__}")
    return state


class FeatureExtractor:
    """Features of many states, each program in parts (`feature_parts`): one cached template per part
    structure, evaluated for every program that has such a part."""

    def __init__(self, task: SearchTask, max_templates: int = 20000):
        self.task = task
        self.templates: dict[str, FeatureTemplate] = {}
        self.max_templates = max_templates
        self.body_facts = _BodyFactsCache()
        self.layouts: dict[str, Readers] = {}
        self.structures: dict[tuple, ProgramParts] = {}       # structure_key -> its parts
        self.n_initial = len(task.dag.tensors)

    def _readers(self, layout: str, program: Program) -> Readers:
        hit = self.layouts.get(layout)
        if hit is None:
            hit = self.layouts[layout] = Readers.of(_replayed(program))
        return hit

    def parts(self, program: Program) -> ProgramParts:
        """The parts of a State or a Candidate (kept on a Candidate: number-only mutations keep them), made
        once per structure (`structure_key`): a round's 2048 fresh programs have a few hundred."""
        got = getattr(program, "structure", None)
        if got is None:
            key = structure_key(program)
            got = self.structures.get(key)
            if got is None:
                if len(self.structures) >= self.max_templates:
                    self.structures.clear()
                got = self.structures[key] = program_parts(program, self.n_initial, self._readers)
            if hasattr(program, "structure"):
                program.structure = got
        return got

    def groups(self, states: Sequence[Program]) -> dict[str, list[tuple[int, Part]]]:
        """(position in `states`, part) of every part, by part structure."""
        groups: dict[str, list[tuple[int, Part]]] = {}
        for i, s in enumerate(states):
            for part in self.parts(s).parts:
                groups.setdefault(part.key, []).append((i, part))
        return groups

    @staticmethod
    def numbers(states: Sequence[Program], members: list[tuple[int, Part]]) -> np.ndarray:
        """The open numbers of parts of one structure: [len(members), slots]."""
        n = len(members[0][1].slots)
        return np.array([state_numbers(states[i], part.slots) for i, part in members],
                        dtype=np.int64).reshape(len(members), n)

    def evaluate(self, key: str, representative: Program | None, part: Part, numbers: np.ndarray) -> np.ndarray:
        """Features [m, stores of the part, 164] of m parts of one structure; `representative` (the
        program `part` is of) is replayed only if the structure has no template yet."""
        tpl = self.templates.get(key)
        if tpl is None:
            if len(self.templates) >= self.max_templates:
                self.templates.clear()
            tpl = self.templates[key] = FeatureTemplate(_replayed(representative), self.task, self.body_facts, part)
        return tpl(numbers)

    def evaluate_members(self, key: str, states: Sequence[Program], members: list[tuple[int, Part]]) -> np.ndarray:
        """`evaluate` for the members of one part structure among `states` (from `groups`)."""
        i, part = members[0]
        return self.evaluate(key, states[i], part, self.numbers(states, members))

    def rows(self, states: Sequence[Program], dtype: type = np.float64) -> tuple[np.ndarray, np.ndarray]:
        """An empty [stores of all states, 164] matrix, each state's rows one after the other, and where each
        state's rows start. Filled one part structure at a time (`place`), it is split into the states'
        matrices at the end (`split`): placing each member's rows into a matrix of its own cost a numpy
        call per member, about 4 ms for each of the search's 2000-program calls."""
        counts = np.fromiter((self.parts(s).n_rows for s in states), dtype=np.int64, count=len(states))
        starts = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        return np.empty((int(starts[-1]), N_FEATURES), dtype=dtype), starts

    @staticmethod
    def place(out: np.ndarray, starts: np.ndarray, members: list[tuple[int, Part]], block: np.ndarray) -> None:
        """Put each member's rows of `block` (an `evaluate`) where they go among its program's, in `out` (`rows`)."""
        at = starts[[i for i, _ in members]][:, None] + np.array([part.rows for _, part in members], dtype=np.int64)
        out[at.ravel()] = block.reshape(-1, N_FEATURES)

    @staticmethod
    def split(out: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
        """Each state's [n_stores, 164] matrix, a view of `out` (one kept keeps all of `out`: XGBModel.add
        stores copies)."""
        return [out[a:b] for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())]

    def __call__(self, states: list) -> list[np.ndarray]:
        """One [n_stores, 164] matrix per state, its stores in stage order."""
        out, starts = self.rows(states)
        for key, members in self.groups(states).items():
            self.place(out, starts, members, self.evaluate_members(key, states, members))
        return self.split(out, starts)
