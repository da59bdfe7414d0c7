"""Loop State: a schedule as transform steps applied to a ComputeDAG (TVM's loop_state + transform_step).

A State is immutable: every transform returns a new State whose `steps` end with the step that made
it, so replaying `steps` on the DAG rebuilds it anywhere (a worker, a resumed run). Iterators carry a
loop variable; each stage records how its leaf loops derive from its root axes (`relations`), which is
all lowering needs to compute index expressions and bounds.

Stage ids and iterator ids follow TVM: placeholders are stages; cache_read/cache_write/rfactor insert
stages and shift later ids.
"""
from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from tasks import te
from tasks.compute_dag import AccessAnalysis, ComputeDAG
from tasks.te import IterVar, Load, Tensor, Var

ANNOTATIONS = ("none", "unroll", "vectorize", "parallel", "vthread", "blockIdx.x", "blockIdx.y", "blockIdx.z",
               "threadIdx.x", "threadIdx.y", "threadIdx.z", "tensorize")
GPU_BINDINGS = ANNOTATIONS[4:11]
PRAGMAS = ("auto_unroll_max_step", "unroll_explicit", "debug_skip_region")


class IllegalStep(ValueError):
    """A transform that cannot apply to this state; the message says which stage/iterator and why."""


@dataclass(frozen=True, slots=True)
class Iterator:
    name: str
    extent: int | None
    kind: str                    # "spatial" | "reduce"
    annotation: str = "none"
    var: Var = field(default=None, compare=False, repr=False)
    pragmas: tuple = ()          # (("auto_unroll_max_step", 64),)


@dataclass(frozen=True, slots=True, eq=False)
class Split:
    parent: Var
    parent_extent: int | None
    children: tuple[Var, ...]
    extents: tuple[int | None, ...]   # as seen by the State (before region tightening)
    inner_to_outer: bool = True
    step: int = -1                    # index of the step that made it (feature templates map lengths)


@dataclass(frozen=True, slots=True, eq=False)
class Fuse:
    parents: tuple[Var, ...]
    extents: tuple[int | None, ...]
    fused: Var


@dataclass(frozen=True, slots=True)
class Stage:
    op: Tensor
    iters: tuple[Iterator, ...]
    relations: tuple = ()
    compute_at: str = "root"               # "root" | "inline" | "iter"
    attach: tuple[str, Var] | None = None  # (target op name, target iterator var)
    scope: str = "global"
    storage_align: tuple = ()              # ((axis, factor, offset),)
    origin: str = ""                       # "cache_write" | "cache_read" | "rfactor" | "" (from the DAG)

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def is_placeholder(self) -> bool:
        return self.op.is_placeholder

    def replace(self, **kw) -> "Stage":
        get = kw.get
        return Stage(get("op", self.op), get("iters", self.iters), get("relations", self.relations),
                     get("compute_at", self.compute_at), get("attach", self.attach), get("scope", self.scope),
                     get("storage_align", self.storage_align), get("origin", self.origin))

    def iter_index(self, var: Var) -> int:
        for i, it in enumerate(self.iters):
            if it.var is var:
                return i
        raise KeyError(var)


def initial_stage(op: Tensor, scope: str = "global", origin: str = "") -> Stage:
    axes = op.axes + op.reduce_axes
    iters = tuple(Iterator(a.name, a.extent, a.kind, var=a) for a in axes)
    return Stage(op, iters, scope=scope, origin=origin)


_INITIAL_STAGES: "weakref.WeakKeyDictionary[ComputeDAG, tuple[Stage, ...]]" = weakref.WeakKeyDictionary()


def _initial_stages(dag: ComputeDAG) -> tuple[Stage, ...]:
    """The naive state's stages, made once per DAG (they are immutable; every replay starts here)."""
    stages = _INITIAL_STAGES.get(dag)
    if stages is None:
        stages = _INITIAL_STAGES[dag] = tuple(initial_stage(t) for t in dag.tensors)
    return stages


def _fresh_copy(op: Tensor, name: str, body_map=None) -> Tensor:
    """The same compute with new axis variables (two stages must never share loop variables)."""
    axes = tuple(IterVar(a.name, a.extent, a.kind) for a in op.axes)
    red = tuple(IterVar(a.name, a.extent, a.kind) for a in op.reduce_axes)
    mapping = dict(zip(op.axes + op.reduce_axes, axes + red))
    body = op.body
    if isinstance(body, te.Reduce):
        body = te.Reduce(body.combiner, te.substitute(body.source, mapping), red)
    else:
        body = te.substitute(body, mapping)
    if body_map is not None:
        body = body_map(body)
    return Tensor(name, op.shape, op.dtype, axes, body, op.attrs)


@dataclass
class LoopStructure:
    """Loop extents and root-axis values of a stage for given root extents (its inferred region)."""
    extents: dict            # Var -> int, every iterator var (leaf and intermediate)
    values: dict             # root axis Var -> Expr over leaf vars
    conds: list              # guards for imperfect splits


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else te.minimum(a, b)


def _ceildiv(a, b):
    return -(-a // b) if isinstance(a, int) and isinstance(b, int) else (a + b - 1) // b


def split_lengths(rel: "Split") -> tuple:
    """The lengths a split was made with (factors of the inner pieces, or part counts)."""
    return rel.extents[1:] if rel.inner_to_outer else rel.extents[:-1]


def loop_structure(stage: Stage, root_extents: Sequence | None = None, lengths=split_lengths) -> LoopStructure:
    """Propagate root extents down the split/fuse relations (TVM's PassDownDomain: a split piece is
    min(factor, parent extent)), then express each root axis by the leaf loop variables.

    Works on ints, or on expressions when `root_extents`/`lengths(rel)` are symbolic (the feature
    templates); guards are only computed for ints."""
    roots = stage.op.axes + stage.op.reduce_axes
    ext: dict = dict(zip(roots, root_extents if root_extents is not None else [a.extent for a in roots]))
    mults: dict = {}
    for rel in stage.relations:
        if isinstance(rel, Split):
            rest = ext[rel.parent]
            lens = lengths(rel)
            if rel.inner_to_outer:      # lengths are factors of the inner pieces
                pieces = []
                for ln in reversed(lens):
                    pieces.append(_min(ln, rest))
                    rest = _ceildiv(rest, ln)
                child_ext = [rest] + pieces[::-1]
                mults[rel] = list(lens)
            else:                       # lengths are part counts of the outer pieces
                child_ext, strides = [], []
                for ln in lens:
                    child_ext.append(_min(ln, rest))
                    rest = _ceildiv(rest, ln)
                    strides.append(rest)
                child_ext.append(rest)
                mults[rel] = strides
            for c, e in zip(rel.children, child_ext):
                ext[c] = e
        else:
            ext[rel.fused] = _prod(ext[v] for v in rel.parents)
    val: dict[Var, te.Expr] = {it.var: it.var for it in stage.iters}
    conds: list[te.Expr] = []
    for rel in reversed(stage.relations):
        if isinstance(rel, Split):
            m = mults[rel]
            if rel.inner_to_outer:
                expr, top = val[rel.children[0]], ext[rel.children[0]] - 1
                for child, factor in zip(rel.children[1:], m):
                    expr = expr * factor + val[child]
                    top = top * factor + ext[child] - 1
            else:
                expr, top = val[rel.children[-1]], ext[rel.children[-1]] - 1
                for child, stride in zip(reversed(rel.children[:-1]), reversed(m)):
                    expr = expr + val[child] * stride
                    top = top + (ext[child] - 1) * stride
            val[rel.parent] = expr
            if isinstance(top, int) and isinstance(ext[rel.parent], int) and top >= ext[rel.parent]:
                conds.append(expr < ext[rel.parent])
        else:
            f, stride = val[rel.fused], 1
            for k in range(len(rel.parents) - 1, -1, -1):
                q = f // stride if not (isinstance(stride, int) and stride == 1) else f
                val[rel.parents[k]] = q if k == 0 else q % ext[rel.parents[k]]
                stride = stride * ext[rel.parents[k]]
    return LoopStructure(ext, {r: val[r] for r in roots}, conds)


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


# --------------------------------------------------------------------------------------- steps

class Step:
    """One transform; `apply` returns the new state (with this step appended)."""

    code = ""

    def apply(self, state: "State") -> "State":
        raise NotImplementedError

    def to_json(self) -> list:
        raise NotImplementedError


def _check_stage(state: "State", stage_id: int, what: str) -> Stage:
    if not isinstance(stage_id, int) or not 0 <= stage_id < len(state.stages):
        raise IllegalStep(f"{what}: stage {stage_id} does not exist (the state has {len(state.stages)} stages)")
    stage = state.stages[stage_id]
    if stage.is_placeholder and what not in ("cache_read",):
        raise IllegalStep(f"{what}: stage {stage_id} ({stage.name}) is a placeholder; it has no loops")
    return stage


def _check_iter(stage: Stage, iter_id: int, what: str) -> Iterator:
    if not isinstance(iter_id, int) or not 0 <= iter_id < len(stage.iters):
        raise IllegalStep(f"{what}: stage {stage.name} has iterators 0..{len(stage.iters) - 1}, got {iter_id}")
    return stage.iters[iter_id]


def _remap_attach(stages: list[Stage], target_name: str, mapping: dict[Var, Var]) -> None:
    for i, s in enumerate(stages):
        if s.attach is not None and s.attach[0] == target_name and s.attach[1] in mapping:
            stages[i] = s.replace(attach=(target_name, mapping[s.attach[1]]))


@dataclass(frozen=True)
class SplitStep(Step):
    stage_id: int
    iter_id: int
    extent: int | None
    lengths: tuple[int | None, ...]
    inner_to_outer: bool = True
    code = "SP"

    def apply(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "split")
        it = _check_iter(stage, self.iter_id, "split")
        if not self.lengths:
            raise IllegalStep(f"split of {stage.name}.{it.name} needs at least one length")
        for ln in self.lengths:
            if ln is not None and (not isinstance(ln, int) or isinstance(ln, bool) or ln <= 0):
                raise IllegalStep(f"split of {stage.name}.{it.name}: lengths must be positive integers, "
                                  f"got {list(self.lengths)}")
        known = [ln for ln in self.lengths if ln is not None]
        prod = 1
        for ln in known:
            prod *= ln
        if it.extent is not None and prod > it.extent:
            raise IllegalStep(f"split lengths {list(self.lengths)} (product {prod}) do not fit iterator "
                              f"{it.name} of extent {it.extent} in stage {stage.name}")
        lengths = list(self.lengths) if self.inner_to_outer else list(self.lengths)
        # Extents from the innermost piece outwards, rounding up like TVM.
        extents: list[int | None] = []
        rest = it.extent
        n = len(lengths)
        order = range(n - 1, -1, -1) if self.inner_to_outer else range(n)
        pieces = [None] * n
        for i in order:
            ln = lengths[i]
            pieces[i] = ln
            rest = None if (rest is None or ln is None) else -(-rest // ln)
        if self.inner_to_outer:
            extents = [rest] + pieces
            names = [f"{it.name}.0"] + [f"{it.name}.{i + 1}" for i in range(n)]
        else:
            extents = pieces + [rest]
            names = [f"{it.name}.{i}" for i in range(n + 1)]
        new_iters = tuple(Iterator(nm, ext, it.kind, var=Var(nm)) for nm, ext in zip(names, extents))
        rel = Split(it.var, it.extent, tuple(x.var for x in new_iters), tuple(extents), self.inner_to_outer,
                    len(state.steps))
        iters = stage.iters[:self.iter_id] + new_iters + stage.iters[self.iter_id + 1:]
        stages = list(state.stages)
        stages[self.stage_id] = stage.replace(iters=iters, relations=stage.relations + (rel,))
        _remap_attach(stages, stage.name, {it.var: new_iters[-1].var})
        return state._derive(stages, self)

    def to_json(self) -> list:
        return ["SP", self.stage_id, self.iter_id, self.extent, list(self.lengths), int(self.inner_to_outer)]


def split_lengths_of(state: "State", step_id: int) -> tuple[int | None, ...]:
    if not 0 <= step_id < len(state.steps) or not isinstance(state.steps[step_id], SplitStep):
        raise IllegalStep(f"step {step_id} is not a split (follow-split needs a split step to follow)")
    return state.steps[step_id].lengths


@dataclass(frozen=True)
class FollowSplitStep(Step):
    """Split like an earlier split step (used to tile a fused consumer like its producer)."""
    stage_id: int
    iter_id: int
    src_step_id: int
    n_split: int
    code = "FSP"

    def lengths(self, state: "State") -> tuple[int | None, ...]:
        src = split_lengths_of(state, self.src_step_id)
        if not 1 <= self.n_split <= len(src):
            raise IllegalStep(f"follow_split: n_split {self.n_split} must be in 1..{len(src)}")
        out = list(src[:self.n_split - 1])
        last = 1
        for ln in src[self.n_split - 1:]:
            last = None if (last is None or ln is None) else last * ln
        return tuple(out + [last])

    def apply(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "follow_split")
        it = _check_iter(stage, self.iter_id, "follow_split")
        inner = SplitStep(self.stage_id, self.iter_id, it.extent, self.lengths(state), True)
        return inner.apply(state)._replace_last_step(self)

    def to_json(self) -> list:
        return ["FSP", self.stage_id, self.iter_id, self.src_step_id, self.n_split]


@dataclass(frozen=True)
class FollowFusedSplitStep(Step):
    """Split by the product of one level of several earlier splits (GPU: fused thread extents)."""
    stage_id: int
    iter_id: int
    src_step_ids: tuple[int, ...]
    level: int
    factor_or_nparts: bool
    code = "FFSP"

    def length(self, state: "State") -> int | None:
        out = 1
        for sid in self.src_step_ids:
            src = split_lengths_of(state, sid)
            if not 0 <= self.level < len(src):
                raise IllegalStep(f"follow_fused_split: level {self.level} out of range for step {sid}")
            ln = src[self.level]
            out = None if (out is None or ln is None) else out * ln
        return out

    def apply(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "follow_fused_split")
        it = _check_iter(stage, self.iter_id, "follow_fused_split")
        ln = self.length(state)
        if self.factor_or_nparts:
            if ln is not None and it.extent is not None and ln > it.extent:
                ln = it.extent          # fewer elements than threads (GPU fetch): the rest stay idle
            inner = SplitStep(self.stage_id, self.iter_id, it.extent, (ln,), True)
        else:
            if ln is not None and it.extent is not None and ln > it.extent:
                ln = it.extent
            inner = SplitStep(self.stage_id, self.iter_id, it.extent, (ln,), False)
        return inner.apply(state)._replace_last_step(self)

    def to_json(self) -> list:
        return ["FFSP", self.stage_id, self.iter_id, list(self.src_step_ids), self.level, int(self.factor_or_nparts)]


@dataclass(frozen=True)
class ReorderStep(Step):
    stage_id: int
    after_ids: tuple[int, ...]
    code = "RE"

    def apply(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "reorder")
        n = len(stage.iters)
        if sorted(self.after_ids) != list(range(n)):
            missing = sorted(set(range(n)) - set(self.after_ids))
            raise IllegalStep(f"reorder of {stage.name} must list each of its {n} iterators exactly once; got "
                              f"{list(self.after_ids)}" + (f", missing {missing}" if missing else ""))
        stages = list(state.stages)
        stages[self.stage_id] = stage.replace(iters=tuple(stage.iters[i] for i in self.after_ids))
        return state._derive(stages, self)

    def to_json(self) -> list:
        return ["RE", self.stage_id, list(self.after_ids)]


@dataclass(frozen=True)
class FuseStep(Step):
    stage_id: int
    fused_ids: tuple[int, ...]
    code = "FU"

    def apply(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "fuse")
        ids = list(self.fused_ids)
        if not ids:
            raise IllegalStep(f"fuse of {stage.name} needs at least one iterator")
        for i in ids:
            _check_iter(stage, i, "fuse")
        if ids != list(range(ids[0], ids[0] + len(ids))):
            raise IllegalStep(f"fuse of {stage.name}: iterators {ids} must be consecutive and in order")
        parts = [stage.iters[i] for i in ids]
        kinds = {p.kind for p in parts}
        if len(kinds) > 1:
            raise IllegalStep(f"fuse of {stage.name}: cannot fuse spatial and reduce iterators "
                              f"({', '.join(p.name + ':' + p.kind for p in parts)})")
        if len(ids) == 1:
            return state._derive(list(state.stages), self)
        ext: int | None = 1
        for p in parts:
            ext = None if (ext is None or p.extent is None) else ext * p.extent
        name = "@".join(p.name for p in parts) + "@"
        fused = Iterator(name, ext, parts[0].kind, var=Var(name))
        rel = Fuse(tuple(p.var for p in parts), tuple(p.extent for p in parts), fused.var)
        iters = stage.iters[:ids[0]] + (fused,) + stage.iters[ids[-1] + 1:]
        stages = list(state.stages)
        stages[self.stage_id] = stage.replace(iters=iters, relations=stage.relations + (rel,))
        _remap_attach(stages, stage.name, {p.var: fused.var for p in parts})
        return state._derive(stages, self)

    def to_json(self) -> list:
        return ["FU", self.stage_id, list(self.fused_ids)]


@dataclass(frozen=True)
class AnnotationStep(Step):
    stage_id: int
    iter_id: int
    annotation: str
    code = "AN"

    def apply(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "annotate")
        it = _check_iter(stage, self.iter_id, "annotate")
        if self.annotation not in ANNOTATIONS:
            raise IllegalStep(f"unknown annotation {self.annotation!r}; use one of {', '.join(ANNOTATIONS)}")
        if self.annotation == "parallel" and it.kind == "reduce":
            raise IllegalStep(f"cannot parallelize reduction iterator {it.name} of {stage.name}: threads would "
                              f"race on the same outputs; rfactor it into a spatial axis first")
        iters = list(stage.iters)
        iters[self.iter_id] = Iterator(it.name, it.extent, it.kind, self.annotation, it.var, it.pragmas)
        stages = list(state.stages)
        stages[self.stage_id] = stage.replace(iters=tuple(iters))
        return state._derive(stages, self)

    def to_json(self) -> list:
        return ["AN", self.stage_id, self.iter_id, ANNOTATIONS.index(self.annotation)]


@dataclass(frozen=True)
class PragmaStep(Step):
    stage_id: int
    iter_id: int
    pragma: str  # "auto_unroll_max_step$64"
    code = "PR"

    def parsed(self) -> tuple[str, int]:
        name, _, value = self.pragma.partition("$")
        if name not in PRAGMAS:
            raise IllegalStep(f"unknown pragma {name!r}; use one of {', '.join(PRAGMAS)}")
        try:
            return name, int(value) if value else 1
        except ValueError:
            raise IllegalStep(f"pragma {self.pragma!r}: the value after '$' must be an integer") from None

    def apply(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "pragma")
        it = _check_iter(stage, self.iter_id, "pragma")
        name, value = self.parsed()
        pragmas = tuple(p for p in it.pragmas if p[0] != name) + ((name, value),)
        iters = list(stage.iters)
        iters[self.iter_id] = Iterator(it.name, it.extent, it.kind, it.annotation, it.var, pragmas)
        stages = list(state.stages)
        stages[self.stage_id] = stage.replace(iters=tuple(iters))
        return state._derive(stages, self)

    def to_json(self) -> list:
        return ["PR", self.stage_id, self.iter_id, self.pragma]


@dataclass(frozen=True)
class ComputeAtStep(Step):
    stage_id: int
    target_stage_id: int
    target_iter_id: int
    code = "CA"

    def apply(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "compute_at")
        target = _check_stage(state, self.target_stage_id, "compute_at")
        it = _check_iter(target, self.target_iter_id, "compute_at")
        if target.compute_at == "inline":
            raise IllegalStep(f"compute_at: target {target.name} is inlined; it has no loops")
        if target.name not in {c.name for c in state.consumers(self.stage_id)}:
            raise IllegalStep(f"compute_at: {target.name} does not consume {stage.name}; a stage can only be "
                              f"computed inside a consumer's loops")
        cur = target
        while cur.compute_at == "iter":
            if cur.attach[0] == stage.name:
                raise IllegalStep(f"compute_at: {target.name} is itself computed inside {stage.name}")
            cur = state.stage_by_name(cur.attach[0])
        stages = list(state.stages)
        stages[self.stage_id] = stage.replace(compute_at="iter", attach=(target.name, it.var))
        return state._derive(stages, self)

    def to_json(self) -> list:
        return ["CA", self.stage_id, self.target_stage_id, self.target_iter_id]


def _attached_to(state: "State", name: str) -> list[str]:
    return [s.name for s in state.stages if s.compute_at == "iter" and s.attach[0] == name]


@dataclass(frozen=True)
class ComputeInlineStep(Step):
    stage_id: int
    code = "CI"

    def apply(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "compute_inline")
        if stage.op.reduce_axes:
            raise IllegalStep(f"compute_inline: {stage.name} is a reduction and cannot be inlined")
        if stage.name in {t.name for t in state.dag.outputs} or not state.consumers(self.stage_id):
            raise IllegalStep(f"compute_inline: {stage.name} is an output and cannot be inlined")
        if _attached_to(state, stage.name):
            raise IllegalStep(f"compute_inline: stages {_attached_to(state, stage.name)} are computed inside "
                              f"{stage.name}; move them first")
        stages = list(state.stages)
        stages[self.stage_id] = stage.replace(compute_at="inline", attach=None)
        return state._derive(stages, self)

    def to_json(self) -> list:
        return ["CI", self.stage_id]


@dataclass(frozen=True)
class ComputeRootStep(Step):
    stage_id: int
    code = "CR"

    def apply(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "compute_root")
        stages = list(state.stages)
        stages[self.stage_id] = stage.replace(compute_at="root", attach=None)
        return state._derive(stages, self)

    def to_json(self) -> list:
        return ["CR", self.stage_id]


def _unique_stage_name(state: "State", base: str) -> str:
    names = {s.name for s in state.stages}
    name, i = base, 1
    while name in names:
        name, i = f"{base}{i}", i + 1
    return name


# Cache read/write and rfactor make new tensors, so a program replaying one gets ops, and an access
# analysis of them, of its own. Most replays apply them to the very same stages (every sample of a
# sketch starts from the DAG's own), so those share one result: per DAG, the last few rewrites.
_REWRITES: "weakref.WeakKeyDictionary[ComputeDAG, OrderedDict]" = weakref.WeakKeyDictionary()
_REWRITES_KEPT = 64


def _rewrite_once(step: "CacheReadStep | CacheWriteStep | RfactorStep", state: "State") -> "State":
    memo = _REWRITES.setdefault(state.dag, OrderedDict())
    key = (step, tuple(map(id, state.stages)))
    hit = memo.get(key)
    if hit is None:
        done = step.rewrite(state)
        # the entry holds the old stages, so no other object can take their ids while it lives, and
        # no State: one refers to the DAG, which would then never leave this weak-keyed memo
        hit = memo[key] = (state.stages, done.stages, done.analysis)
        if len(memo) > _REWRITES_KEPT:
            memo.popitem(last=False)
    else:
        memo.move_to_end(key)
    new = State(state.dag, hit[1], state.steps + (step,))
    new._analysis = hit[2]
    return new


def _redirect_loads(stages: list[Stage], replaced: dict[Tensor, Tensor]) -> None:
    """Point every later reader of a replaced op at its replacement, transitively (TVM's
    ReplaceDataFlow): a consumer that kept loading the old op would no longer be its consumer."""
    replaced = dict(replaced)
    for i, st in enumerate(stages):
        if st.op in replaced.values() or st.is_placeholder:
            continue
        if not any(isinstance(n, Load) and n.tensor in replaced for n in te.walk(st.op.body)):
            continue
        body = te.transform(st.op.body, lambda n: Load(replaced[n.tensor], n.indices)
                            if isinstance(n, Load) and n.tensor in replaced else None)
        new = Tensor(st.op.name, st.op.shape, st.op.dtype, st.op.axes, body, st.op.attrs)
        replaced[st.op] = new
        stages[i] = st.replace(op=new)


@dataclass(frozen=True)
class CacheReadStep(Step):
    """Copy a tensor into `scope` for the given readers (GPU shared memory, CPU packing)."""
    stage_id: int
    scope_name: str
    reader_stage_ids: tuple[int, ...]
    code = "CHR"

    def apply(self, state: "State") -> "State":
        return _rewrite_once(self, state)

    def rewrite(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "cache_read")
        if not self.reader_stage_ids:
            raise IllegalStep("cache_read needs at least one reader stage")
        readers = [_check_stage(state, r, "cache_read") for r in self.reader_stage_ids]
        for r in readers:
            if stage.op not in r.op.inputs():
                raise IllegalStep(f"cache_read: {r.name} does not read {stage.name}")
        old = stage.op
        name = _unique_stage_name(state, f"{old.name}.{self.scope_name}")
        cache = te.compute(old.shape, lambda *i: old[i], name=name)
        stages = list(state.stages)
        replaced = {}
        for rid, r in zip(self.reader_stage_ids, readers):
            body = te.transform(r.op.body, lambda n: Load(cache, n.indices)
                                if isinstance(n, Load) and n.tensor is old else None)
            replaced[r.op] = Tensor(r.op.name, r.op.shape, r.op.dtype, r.op.axes, body, r.op.attrs)
            stages[rid] = r.replace(op=replaced[r.op])
        _redirect_loads(stages, replaced)
        stages.insert(self.stage_id + 1, initial_stage(cache, self.scope_name, "cache_read"))
        return state._derive(stages, self)

    def to_json(self) -> list:
        return ["CHR", self.stage_id, self.scope_name, list(self.reader_stage_ids)]


@dataclass(frozen=True)
class CacheWriteStep(Step):
    """Compute into a `scope` buffer, then copy out: the register tile of multi-level tiling."""
    stage_id: int
    scope_name: str
    code = "CHW"

    def apply(self, state: "State") -> "State":
        return _rewrite_once(self, state)

    def rewrite(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "cache_write")
        if _attached_to(state, stage.name):
            raise IllegalStep(f"cache_write of {stage.name} must come before stages are computed at it")
        old = stage.op
        local = _fresh_copy(old, _unique_stage_name(state, f"{old.name}.{self.scope_name}"))
        axes = tuple(IterVar(a.name, a.extent, "spatial") for a in old.axes)
        out = Tensor(old.name, old.shape, old.dtype, axes, Load(local, axes), old.attrs)
        stages = list(state.stages)
        stages[self.stage_id] = initial_stage(out).replace(compute_at=stage.compute_at, attach=stage.attach)
        _redirect_loads(stages, {old: out})
        stages.insert(self.stage_id, initial_stage(local, self.scope_name, "cache_write"))
        return state._derive(stages, self)

    def to_json(self) -> list:
        return ["CHW", self.stage_id, self.scope_name]


@dataclass(frozen=True)
class RfactorStep(Step):
    """Factor a reduction: the iterator `iter_id` becomes a spatial axis of a new `.rf` stage."""
    stage_id: int
    iter_id: int
    factor_iter_id: int
    code = "RF"

    def apply(self, state: "State") -> "State":
        return _rewrite_once(self, state)

    def rewrite(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "rfactor")
        it = _check_iter(stage, self.iter_id, "rfactor")
        op = stage.op
        if not isinstance(op.body, te.Reduce) or it.kind != "reduce":
            raise IllegalStep(f"rfactor: iterator {it.name} of {stage.name} is not a reduction iterator")
        if _attached_to(state, stage.name):
            raise IllegalStep(f"rfactor of {stage.name} must come before stages are computed at it")
        spatial = [x for x in stage.iters if x.kind == "spatial"]
        if [x.var for x in spatial] != list(op.axes):
            raise IllegalStep(f"rfactor needs the spatial axes of {stage.name} untouched; apply it before "
                              f"splitting or reordering them")
        if any(x.extent is None for x in stage.iters):
            raise IllegalStep(f"rfactor of {stage.name} needs concrete split lengths")
        if not 0 <= self.factor_iter_id <= len(op.axes):
            raise IllegalStep(f"rfactor: factor_iter_id must be in 0..{len(op.axes)}")
        reduce_leaves = [x for x in stage.iters if x.kind == "reduce"]
        # rf op: spatial axes + the factored iterator; reduce over the other reduce leaves.
        new_sp = [IterVar(a.name, a.extent, "spatial") for a in op.axes]
        f_axis = IterVar(f"{it.name}", it.extent, "spatial")
        sp_axes = new_sp[:self.factor_iter_id] + [f_axis] + new_sp[self.factor_iter_id:]
        red_axes = [IterVar(x.name, x.extent, "reduce") for x in reduce_leaves if x is not it]
        leaf_map = {x.var: ax for x, ax in zip([x for x in reduce_leaves if x is not it], red_axes)}
        leaf_map[it.var] = f_axis
        leaf_map.update({x.var: ax for x, ax in zip(spatial, new_sp)})
        structure = loop_structure(stage)
        values, conds = structure.values, structure.conds
        sub = {root: te.substitute(expr, leaf_map) for root, expr in values.items()}
        src = te.substitute(op.body.source, sub)
        guard = te.all(*[te.substitute(c, leaf_map) for c in conds])
        if not (isinstance(guard, te.Const) and guard.value):
            src = te.if_then_else(guard, src, op.body.identity)
        rf_name = _unique_stage_name(state, f"{op.name}.rf")
        rf_shape = tuple(a.extent for a in sp_axes)
        if red_axes:
            rf_body = te.Reduce(op.body.combiner, src, tuple(red_axes))
        else:
            rf_body = src
        rf = Tensor(rf_name, rf_shape, op.dtype, tuple(sp_axes), rf_body, {})
        out_axes = tuple(IterVar(a.name, a.extent, "spatial") for a in op.axes)
        r = IterVar(f"{it.name}_v", it.extent, "reduce")
        idx = list(out_axes[:self.factor_iter_id]) + [r] + list(out_axes[self.factor_iter_id:])
        out = Tensor(op.name, op.shape, op.dtype, out_axes,
                     te.Reduce(op.body.combiner, Load(rf, tuple(idx)), (r,)), op.attrs)
        stages = list(state.stages)
        stages[self.stage_id] = initial_stage(out).replace(compute_at=stage.compute_at, attach=stage.attach)
        _redirect_loads(stages, {op: out})
        stages.insert(self.stage_id, initial_stage(rf, origin="rfactor"))
        return state._derive(stages, self)

    def to_json(self) -> list:
        return ["RF", self.stage_id, self.iter_id, self.factor_iter_id]


@dataclass(frozen=True)
class StorageAlignStep(Step):
    stage_id: int
    iter_id: int
    factor: int
    offset: int
    code = "SA"

    def apply(self, state: "State") -> "State":
        stage = _check_stage(state, self.stage_id, "storage_align")
        it = _check_iter(stage, self.iter_id, "storage_align")
        if it.var not in stage.op.axes:
            raise IllegalStep(f"storage_align: {it.name} of {stage.name} is not an axis of the tensor")
        if self.factor <= 0 or not 0 <= self.offset < self.factor:
            raise IllegalStep(f"storage_align needs factor > 0 and 0 <= offset < factor, got "
                              f"{self.factor}, {self.offset}")
        axis = list(stage.op.axes).index(it.var)
        stages = list(state.stages)
        aligns = tuple(a for a in stage.storage_align if a[0] != axis) + ((axis, self.factor, self.offset),)
        stages[self.stage_id] = stage.replace(storage_align=aligns)
        return state._derive(stages, self)

    def to_json(self) -> list:
        return ["SA", self.stage_id, self.iter_id, self.factor, self.offset]


def step_from_json(item: list) -> Step:
    """Parse one step; malformed input raises IllegalStep naming the step."""
    try:
        code, args = item[0], item[1:]
        if code == "SP":
            s, i, ext, lengths, ito = args
            return SplitStep(int(s), int(i), ext, tuple(lengths), bool(ito))
        if code == "FSP":
            s, i, src, n = args
            return FollowSplitStep(int(s), int(i), int(src), int(n))
        if code == "FFSP":
            s, i, srcs, level, fon = args
            return FollowFusedSplitStep(int(s), int(i), tuple(int(x) for x in srcs), int(level), bool(fon))
        if code == "RE":
            s, ids = args
            return ReorderStep(int(s), tuple(int(x) for x in ids))
        if code == "FU":
            s, ids = args
            return FuseStep(int(s), tuple(int(x) for x in ids))
        if code == "AN":
            s, i, ann = args
            return AnnotationStep(int(s), int(i), ANNOTATIONS[int(ann)] if isinstance(ann, int) else str(ann))
        if code == "PR":
            s, i, p = args
            return PragmaStep(int(s), int(i), str(p))
        if code == "CA":
            s, ts, ti = args
            return ComputeAtStep(int(s), int(ts), int(ti))
        if code == "CI":
            (s,) = args
            return ComputeInlineStep(int(s))
        if code == "CR":
            (s,) = args
            return ComputeRootStep(int(s))
        if code == "CHR":
            s, scope, readers = args
            return CacheReadStep(int(s), str(scope), tuple(int(x) for x in readers))
        if code == "CHW":
            s, scope = args
            return CacheWriteStep(int(s), str(scope))
        if code == "RF":
            s, i, fi = args
            return RfactorStep(int(s), int(i), int(fi))
        if code == "SA":
            s, i, f, o = args
            return StorageAlignStep(int(s), int(i), int(f), int(o))
    except (TypeError, ValueError, IndexError) as err:
        raise IllegalStep(f"malformed step {item!r}: {err}") from None
    raise IllegalStep(f"malformed step {item!r}: unknown step code {item[0] if item else None!r}")


# --------------------------------------------------------------------------------------- state

class State:
    """Stages + the steps that made them from the DAG."""

    __slots__ = ("dag", "stages", "steps", "_analysis")

    def __init__(self, dag: ComputeDAG, stages: tuple[Stage, ...] | None = None, steps: tuple[Step, ...] = ()):
        self.dag = dag
        self.stages = stages if stages is not None else _initial_stages(dag)
        self.steps = steps
        self._analysis = None

    def _derive(self, stages: list[Stage], step: Step) -> "State":
        new = State(self.dag, tuple(stages), self.steps + (step,))
        # most steps keep every stage's op: the access analysis of the ops carries over
        if self._analysis is not None and len(stages) == len(self.stages) and \
                all(a.op is b.op for a, b in zip(stages, self.stages)):
            new._analysis = self._analysis
        return new

    def _replace_last_step(self, step: Step) -> "State":
        new = State(self.dag, self.stages, self.steps[:-1] + (step,))
        new._analysis = self._analysis
        return new

    # ----------------------------------------------------------------- lookup

    def stage_id(self, stage: int | str | Tensor) -> int:
        if isinstance(stage, int):
            return stage
        name = stage.name if isinstance(stage, Tensor) else stage
        for i, s in enumerate(self.stages):
            if s.name == name:
                return i
        raise KeyError(f"no stage named {name!r}; stages: {', '.join(s.name for s in self.stages)}")

    def stage_by_name(self, name: str) -> Stage:
        return self.stages[self.stage_id(name)]

    @property
    def analysis(self) -> AccessAnalysis:
        """Access analysis of the current ops (they change with cache_read/cache_write/rfactor)."""
        if self._analysis is None:
            if all(s.op is t for s, t in zip(self.stages, self.dag.tensors)) and \
                    len(self.stages) == len(self.dag.tensors):
                self._analysis = self.dag.analysis
            else:
                outputs = [s.op for s in self.stages if s.name in {t.name for t in self.dag.outputs}]
                self._analysis = AccessAnalysis([s.op for s in self.stages], outputs)
        return self._analysis

    def consumers(self, stage_id: int) -> list[Stage]:
        """Stages reading this one, looking through inlined stages (TVM's GetConsumers)."""
        return self._through_inlined(stage_id, self.analysis.consumers)

    def producers(self, stage_id: int) -> list[Stage]:
        return self._through_inlined(stage_id, self.analysis.producers)

    def computed_within(self, consumer: str, producer: str) -> bool:
        """Stage `consumer` runs inside the loop that `producer` is computed at (after it), so it may
        read what that loop computed."""
        target, var = self.stage_by_name(producer).attach
        target_stage = self.stage_by_name(target)
        at = target_stage.iter_index(var)
        cur = consumer
        while cur != target:
            st = self.stage_by_name(cur)
            if st.compute_at != "iter":
                return False
            if st.attach[0] == target:
                j = target_stage.iter_index(st.attach[1])
                return j > at or (j == at and self.stage_id(cur) > self.stage_id(producer))
            cur = st.attach[0]
        return True

    def _through_inlined(self, stage_id: int, neighbours: Callable[[Tensor], Iterable[Tensor]]) -> list[Stage]:
        # a work list, not a recursive closure (that would be a reference cycle holding this state)
        by_op = {s.op: s for s in self.stages}
        out: dict[str, Stage] = {}
        stack = [iter(neighbours(self.stages[stage_id].op))]
        while stack:
            n = next(stack[-1], None)
            if n is None:
                stack.pop()
            elif by_op[n].compute_at == "inline":
                stack.append(iter(neighbours(n)))      # depth first, in the order recursion would visit
            else:
                out[by_op[n].name] = by_op[n]
        return list(out.values())

    def effective_bodies(self) -> dict[str, te.Expr]:
        """Each non-inlined compute stage's body with the inlined stages it reads substituted."""
        inline: dict[str, tuple[Tensor, te.Expr]] = {}
        out: dict[str, te.Expr] = {}

        def expand(body: te.Expr) -> te.Expr:
            if not inline:
                return body

            def repl(n: te.Expr):
                if isinstance(n, Load) and n.tensor.name in inline:
                    t, b = inline[n.tensor.name]
                    return te.substitute(b, dict(zip(t.axes, n.indices)))
                return None
            return te.transform(body, repl)

        for st in self.stages:
            if st.is_placeholder:
                continue
            if st.compute_at == "inline":
                inline[st.name] = (st.op, expand(st.op.body))
            else:
                out[st.name] = expand(st.op.body)
        return out

    @property
    def concrete(self) -> bool:
        return all(it.extent is not None for s in self.stages for it in s.iters)

    # ----------------------------------------------------------------- transforms (TVM's names)

    def apply(self, step: Step) -> "State":
        return step.apply(self)

    def split(self, stage, iter_id: int, lengths: Sequence[int | None], inner_to_outer: bool = True) -> "State":
        sid = self.stage_id(stage)
        st = _check_stage(self, sid, "split")
        return SplitStep(sid, iter_id, _check_iter(st, iter_id, "split").extent, tuple(lengths),
                         inner_to_outer).apply(self)

    def follow_split(self, stage, iter_id: int, src_step_id: int, n_split: int) -> "State":
        return FollowSplitStep(self.stage_id(stage), iter_id, src_step_id, n_split).apply(self)

    def follow_fused_split(self, stage, iter_id: int, src_step_ids: Sequence[int], level: int,
                           factor_or_nparts: bool) -> "State":
        return FollowFusedSplitStep(self.stage_id(stage), iter_id, tuple(src_step_ids), level,
                                    factor_or_nparts).apply(self)

    def reorder(self, stage, order: Sequence[int]) -> "State":
        return ReorderStep(self.stage_id(stage), tuple(order)).apply(self)

    def fuse(self, stage, iter_ids: Sequence[int]) -> "State":
        return FuseStep(self.stage_id(stage), tuple(iter_ids)).apply(self)

    def annotate(self, stage, iter_id: int, annotation: str) -> "State":
        return AnnotationStep(self.stage_id(stage), iter_id, annotation).apply(self)

    def vectorize(self, stage, iter_id: int) -> "State":
        return self.annotate(stage, iter_id, "vectorize")

    def parallel(self, stage, iter_id: int) -> "State":
        return self.annotate(stage, iter_id, "parallel")

    def unroll(self, stage, iter_id: int) -> "State":
        return self.annotate(stage, iter_id, "unroll")

    def bind(self, stage, iter_id: int, thread: str) -> "State":
        if thread not in GPU_BINDINGS:
            raise IllegalStep(f"bind: {thread!r} is not a GPU thread axis ({', '.join(GPU_BINDINGS)})")
        return self.annotate(stage, iter_id, thread)

    def pragma(self, stage, iter_id: int, pragma: str) -> "State":
        return PragmaStep(self.stage_id(stage), iter_id, pragma).apply(self)

    def compute_at(self, stage, target, target_iter_id: int) -> "State":
        return ComputeAtStep(self.stage_id(stage), self.stage_id(target), target_iter_id).apply(self)

    def compute_inline(self, stage) -> "State":
        return ComputeInlineStep(self.stage_id(stage)).apply(self)

    def compute_root(self, stage) -> "State":
        return ComputeRootStep(self.stage_id(stage)).apply(self)

    def cache_read(self, stage, scope: str, readers: Sequence) -> "State":
        return CacheReadStep(self.stage_id(stage), scope, tuple(self.stage_id(r) for r in readers)).apply(self)

    def cache_write(self, stage, scope: str = "local") -> "State":
        return CacheWriteStep(self.stage_id(stage), scope).apply(self)

    def rfactor(self, stage, iter_id: int, factor_iter_id: int) -> "State":
        return RfactorStep(self.stage_id(stage), iter_id, factor_iter_id).apply(self)

    def storage_align(self, stage, iter_id: int, factor: int, offset: int) -> "State":
        return StorageAlignStep(self.stage_id(stage), iter_id, factor, offset).apply(self)

    # ----------------------------------------------------------------- replay and records

    @staticmethod
    def replay(dag: ComputeDAG, steps: Iterable[Step]) -> "State":
        state = State(dag)
        for i, step in enumerate(steps):
            try:
                state = step.apply(state)
            except IllegalStep as err:
                raise IllegalStep(f"step {i} {step.to_json()}: {err}") from None
        return state

    def steps_json(self) -> str:
        """Compact JSON of the step list (TVM's record format): the identity of a program."""
        return json.dumps([s.to_json() for s in self.steps], separators=(",", ":"))

    @staticmethod
    def from_json(dag: ComputeDAG, steps: str | list) -> "State":
        if isinstance(steps, str):
            try:
                steps = json.loads(steps)
            except json.JSONDecodeError as err:
                raise IllegalStep(f"malformed step JSON: {err}; expected a list like "
                                  f"[[\"SP\",2,0,512,[16],1], ...]") from None
        if not isinstance(steps, list) or not all(isinstance(s, list) and s for s in steps):
            raise IllegalStep("malformed step JSON: expected a list of steps, each a non-empty list")
        return State.replay(dag, [step_from_json(s) for s in steps])

    # ----------------------------------------------------------------- printing (TVM's State::ToStr)

    def __str__(self) -> str:
        lines = ["Placeholder: " + ", ".join(s.name for s in self.stages if s.is_placeholder)]

        def emit(sid: int, indent: int) -> None:
            stage = self.stages[sid]
            pad = " " * indent
            for it in stage.iters:
                if it.pragmas:
                    for name, value in it.pragmas:
                        lines.append(f"{pad}{stage.name} {name}: {value}")
            depth = indent
            for it in stage.iters:
                ext = "None" if it.extent is None else str(it.extent)
                lines.append(f"{' ' * depth}{it.annotation if it.annotation != 'none' else 'for'} "
                             f"{it.name} (0,{ext})")
                depth += 2
                for j, other in enumerate(self.stages):
                    if other.compute_at == "iter" and other.attach == (stage.name, it.var):
                        emit(j, depth)
            lines.append(f"{' ' * depth}{stage.name} = ...")

        for i, s in enumerate(self.stages):
            if not s.is_placeholder and s.compute_at == "root":
                emit(i, 0)
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return f"State({self.dag.name or 'dag'}, {len(self.steps)} steps)"
