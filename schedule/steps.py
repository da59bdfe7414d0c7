"""The transform steps of a schedule (TVM's transform_step): each one checks it is legal on a state and
returns the new state, and each writes and reads itself as compact JSON (`code` first), so a record's
step list replays anywhere.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensortune.schedule.dag_memo import DagMemo
from tensortune.schedule.loop_structure import loop_structure
from tensortune.schedule.stage import (
    ANNOTATIONS,
    PRAGMAS,
    Fuse,
    IllegalStep,
    Iterator,
    Split,
    Stage,
    fresh_copy,
    initial_stage,
)
from tensortune.tasks import te
from tensortune.tasks.te import IterVar, Load, Tensor, Var

if TYPE_CHECKING:                     # steps act on a State through its methods; state.py imports this file
    from tensortune.schedule.state import State

class Step:
    """One transform; `apply` returns the new state (with this step appended)."""

    code = ""

    def __reduce__(self):
        """Pickled as its class and field values: a dataclass's default (a state dict per step, rebuilt
        through __setstate__) took four times as long, and the search ships thousands of step lists
        between processes every round."""
        return type(self), tuple(getattr(self, f) for f in _field_names(type(self)))

    def apply(self, state: "State") -> "State":
        raise NotImplementedError

    def to_json(self) -> list:
        """[code, arguments...]: the compact JSON a record stores (TVM's step serialisation)."""
        raise NotImplementedError

    @classmethod
    def from_json(cls, args: list) -> "Step":
        """The step from its JSON arguments (the list after the code)."""
        raise NotImplementedError


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def check_stage(state: "State", stage_id: int, what: str) -> Stage:
    stages = state.stages
    if not isinstance(stage_id, int) or not 0 <= stage_id < len(stages):
        raise IllegalStep(f"{what}: stage {stage_id} does not exist (the state has {len(stages)} stages)")
    stage = stages[stage_id]
    # stage.is_placeholder, read straight from the op: every step of every replay checks its stage
    if stage.op.body is None and what != "cache_read":
        raise IllegalStep(f"{what}: stage {stage_id} ({stage.name}) is a placeholder; it has no loops")
    return stage


def check_iter(stage: Stage, iter_id: int, what: str) -> Iterator:
    if not isinstance(iter_id, int) or not 0 <= iter_id < len(stage.iters):
        raise IllegalStep(f"{what}: stage {stage.name} has iterators 0..{len(stage.iters) - 1}, got {iter_id}")
    return stage.iters[iter_id]


def _remap_attach(stages: list[Stage], target_name: str, mapping: dict[Var, Var]) -> None:
    for i, s in enumerate(stages):
        if s.attach is not None and s.attach[0] == target_name and s.attach[1] in mapping:
            stages[i] = s.replace(attach=(target_name, mapping[s.attach[1]]))


def _split(state: "State", step: Step, stage_id: int, iter_id: int, lengths: tuple[int | None, ...],
           inner_to_outer: bool) -> "State":
    """Split iterator `iter_id` of a stage by `lengths`, recorded as `step`: a SplitStep, or a follow
    split that splits like one and records itself. The hottest step of a search (about ten in each
    sampled program): a follow split calls this rather than build a SplitStep, apply it and make a
    second State to swap the step recorded."""
    stage = check_stage(state, stage_id, "split")
    it = check_iter(stage, iter_id, "split")
    lengths = tuple(lengths)          # (a tuple already, unless a caller built the step with a list)
    if not lengths:
        raise IllegalStep(f"split of {stage.name}.{it.name} needs at least one length")
    prod = 1
    for ln in lengths:
        if ln is not None:
            if not isinstance(ln, int) or isinstance(ln, bool) or ln <= 0:
                raise IllegalStep(f"split of {stage.name}.{it.name}: lengths must be positive integers, "
                                  f"got {list(lengths)}")
            prod *= ln
    extent = it.extent
    if extent is not None and prod > extent:
        raise IllegalStep(f"split lengths {list(lengths)} (product {prod}) do not fit iterator "
                          f"{it.name} of extent {extent} in stage {stage.name}")
    # The remaining piece rounds up like TVM; an open length leaves it open.
    rest = None if extent is None or None in lengths else -(-extent // prod)
    extents = (rest,) + lengths if inner_to_outer else lengths + (rest,)
    name, kind = it.name, it.kind
    names = [f"{name}.{i}" for i in range(len(extents))]
    new_vars = tuple([Var(nm) for nm in names])
    new_iters = tuple([Iterator(nm, ext, kind, "none", var) for nm, ext, var in zip(names, extents, new_vars)])
    rel = Split(it.var, extent, new_vars, extents, inner_to_outer, len(state.steps))
    stages = list(state.stages)
    stages[stage_id] = stage.replace(iters=stage.iters[:iter_id] + new_iters + stage.iters[iter_id + 1:],
                                     relations=stage.relations + (rel,))
    _remap_attach(stages, stage.name, {it.var: new_vars[-1]})
    return state._derive(stages, step)


@dataclass(frozen=True)
class SplitStep(Step):
    stage_id: int
    iter_id: int
    extent: int | None
    lengths: tuple[int | None, ...]
    inner_to_outer: bool = True
    code = "SP"

    def apply(self, state: "State") -> "State":
        return _split(state, self, self.stage_id, self.iter_id, self.lengths, self.inner_to_outer)

    def to_json(self) -> list:
        return [self.code, self.stage_id, self.iter_id, self.extent, list(self.lengths), int(self.inner_to_outer)]

    @classmethod
    def from_json(cls, args: list) -> "SplitStep":
        s, i, ext, lengths, ito = args
        return cls(int(s), int(i), ext, tuple(lengths), bool(ito))


def split_lengths_of(state: "State", step_id: int) -> tuple[int | None, ...]:
    if not 0 <= step_id < len(state.steps) or not isinstance(state.steps[step_id], SplitStep):
        raise IllegalStep(f"step {step_id} is not a split (follow-split needs a split step to follow)")
    step = state.steps[step_id]
    assert isinstance(step, SplitStep)
    return step.lengths


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
        last: int | None = 1
        for ln in src[self.n_split - 1:]:
            last = None if (last is None or ln is None) else last * ln
        return tuple(out + [last])

    def apply(self, state: "State") -> "State":
        check_iter(check_stage(state, self.stage_id, "follow_split"), self.iter_id, "follow_split")  # its own words
        return _split(state, self, self.stage_id, self.iter_id, self.lengths(state), True)

    def to_json(self) -> list:
        return [self.code, self.stage_id, self.iter_id, self.src_step_id, self.n_split]

    @classmethod
    def from_json(cls, args: list) -> "FollowSplitStep":
        s, i, src, n = args
        return cls(int(s), int(i), int(src), int(n))


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
        out: int | None = 1
        for sid in self.src_step_ids:
            src = split_lengths_of(state, sid)
            if not 0 <= self.level < len(src):
                raise IllegalStep(f"follow_fused_split: level {self.level} out of range for step {sid}")
            ln = src[self.level]
            out = None if (out is None or ln is None) else out * ln
        return out

    def apply(self, state: "State") -> "State":
        stage = check_stage(state, self.stage_id, "follow_fused_split")
        it = check_iter(stage, self.iter_id, "follow_fused_split")
        ln = self.length(state)
        if ln is not None and it.extent is not None and ln > it.extent:
            ln = it.extent          # fewer elements than threads (GPU fetch): the rest stay idle
        return _split(state, self, self.stage_id, self.iter_id, (ln,), bool(self.factor_or_nparts))

    def to_json(self) -> list:
        return [self.code, self.stage_id, self.iter_id, list(self.src_step_ids), self.level, int(self.factor_or_nparts)]

    @classmethod
    def from_json(cls, args: list) -> "FollowFusedSplitStep":
        s, i, srcs, level, fon = args
        return cls(int(s), int(i), tuple(int(x) for x in srcs), int(level), bool(fon))


@dataclass(frozen=True)
class ReorderStep(Step):
    stage_id: int
    after_ids: tuple[int, ...]
    code = "RE"

    def apply(self, state: "State") -> "State":
        stage = check_stage(state, self.stage_id, "reorder")
        n = len(stage.iters)
        if sorted(self.after_ids) != list(range(n)):
            missing = sorted(set(range(n)) - set(self.after_ids))
            raise IllegalStep(f"reorder of {stage.name} must list each of its {n} iterators exactly once; got "
                              f"{list(self.after_ids)}" + (f", missing {missing}" if missing else ""))
        stages = list(state.stages)
        stages[self.stage_id] = stage.replace(iters=tuple(stage.iters[i] for i in self.after_ids))
        return state._derive(stages, self)

    def to_json(self) -> list:
        return [self.code, self.stage_id, list(self.after_ids)]

    @classmethod
    def from_json(cls, args: list) -> "ReorderStep":
        s, ids = args
        return cls(int(s), tuple(int(x) for x in ids))


@dataclass(frozen=True)
class FuseStep(Step):
    stage_id: int
    fused_ids: tuple[int, ...]
    code = "FU"

    def apply(self, state: "State") -> "State":
        stage = check_stage(state, self.stage_id, "fuse")
        ids = list(self.fused_ids)
        if not ids:
            raise IllegalStep(f"fuse of {stage.name} needs at least one iterator")
        for i in ids:
            check_iter(stage, i, "fuse")
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
        return [self.code, self.stage_id, list(self.fused_ids)]

    @classmethod
    def from_json(cls, args: list) -> "FuseStep":
        s, ids = args
        return cls(int(s), tuple(int(x) for x in ids))


@dataclass(frozen=True)
class AnnotationStep(Step):
    stage_id: int
    iter_id: int
    annotation: str
    code = "AN"

    def apply(self, state: "State") -> "State":
        stage = check_stage(state, self.stage_id, "annotate")
        it = check_iter(stage, self.iter_id, "annotate")
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
        return [self.code, self.stage_id, self.iter_id, ANNOTATIONS.index(self.annotation)]

    @classmethod
    def from_json(cls, args: list) -> "AnnotationStep":
        s, i, ann = args
        return cls(int(s), int(i), ANNOTATIONS[int(ann)] if isinstance(ann, int) else str(ann))


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
        stage = check_stage(state, self.stage_id, "pragma")
        it = check_iter(stage, self.iter_id, "pragma")
        name, value = self.parsed()
        pragmas = tuple(p for p in it.pragmas if p[0] != name) + ((name, value),)
        iters = list(stage.iters)
        iters[self.iter_id] = Iterator(it.name, it.extent, it.kind, it.annotation, it.var, pragmas)
        stages = list(state.stages)
        stages[self.stage_id] = stage.replace(iters=tuple(iters))
        return state._derive(stages, self)

    def to_json(self) -> list:
        return [self.code, self.stage_id, self.iter_id, self.pragma]

    @classmethod
    def from_json(cls, args: list) -> "PragmaStep":
        s, i, p = args
        return cls(int(s), int(i), str(p))


@dataclass(frozen=True)
class ComputeAtStep(Step):
    stage_id: int
    target_stage_id: int
    target_iter_id: int
    code = "CA"

    def apply(self, state: "State") -> "State":
        stage = check_stage(state, self.stage_id, "compute_at")
        target = check_stage(state, self.target_stage_id, "compute_at")
        it = check_iter(target, self.target_iter_id, "compute_at")
        if target.compute_at == "inline":
            raise IllegalStep(f"compute_at: target {target.name} is inlined; it has no loops")
        if target.name not in {c.name for c in state.consumers(self.stage_id)}:
            raise IllegalStep(f"compute_at: {target.name} does not consume {stage.name}; a stage can only be "
                              f"computed inside a consumer's loops")
        cur = target
        while cur.compute_at == "iter" and cur.attach is not None:
            if cur.attach[0] == stage.name:
                raise IllegalStep(f"compute_at: {target.name} is itself computed inside {stage.name}")
            cur = state.stage_by_name(cur.attach[0])
        stages = list(state.stages)
        stages[self.stage_id] = stage.replace(compute_at="iter", attach=(target.name, it.var))
        return state._derive(stages, self)

    def to_json(self) -> list:
        return [self.code, self.stage_id, self.target_stage_id, self.target_iter_id]

    @classmethod
    def from_json(cls, args: list) -> "ComputeAtStep":
        s, ts, ti = args
        return cls(int(s), int(ts), int(ti))


def _attached_to(state: "State", name: str) -> list[str]:
    return [s.name for s in state.stages if s.compute_at == "iter" and s.attach is not None and s.attach[0] == name]


def _unattached_stage(state: "State", stage_id: int, what: str) -> Stage:
    """The stage a cache_write or rfactor rewrites, which nothing may be computed at yet. Their shared
    rewrites are keyed by what this check does not see, so each state is checked before the memo."""
    stage = check_stage(state, stage_id, what)
    if _attached_to(state, stage.name):
        raise IllegalStep(f"{what} of {stage.name} must come before stages are computed at it")
    return stage


@dataclass(frozen=True)
class ComputeInlineStep(Step):
    stage_id: int
    code = "CI"

    def apply(self, state: "State") -> "State":
        stage = check_stage(state, self.stage_id, "compute_inline")
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
        return [self.code, self.stage_id]

    @classmethod
    def from_json(cls, args: list) -> "ComputeInlineStep":
        (s,) = args
        return cls(int(s))


@dataclass(frozen=True)
class ComputeRootStep(Step):
    stage_id: int
    code = "CR"

    def apply(self, state: "State") -> "State":
        stage = check_stage(state, self.stage_id, "compute_root")
        stages = list(state.stages)
        stages[self.stage_id] = stage.replace(compute_at="root", attach=None)
        return state._derive(stages, self)

    def to_json(self) -> list:
        return [self.code, self.stage_id]

    @classmethod
    def from_json(cls, args: list) -> "ComputeRootStep":
        (s,) = args
        return cls(int(s))


def _unique_stage_name(state: "State", base: str) -> str:
    names = {s.name for s in state.stages}
    name, i = base, 1
    while name in names:
        name, i = f"{base}{i}", i + 1
    return name


# Cache read/write and rfactor make new tensors, so a program replaying one gets ops, and an access
# analysis of them, of its own: for a DAG of large expressions (a Winograd F(4) transform) that is a
# tenth of a second a rewrite, and a round replays thousands. What a rewrite does is a `Rewrite` of the
# stage list, which depends on the stages' ops alone (rfactor: on the factored stage's loops too), and
# every sample of a sketch replays it on the very same ops: they share one Rewrite and one analysis,
# per DAG the last few.
_REWRITES = DagMemo(kept=64)


@dataclass(frozen=True)
class Rewrite:
    """A cache_read / cache_write / rfactor as changes to a stage list, positions before the insert:
    `ops` replace stages' ops and keep their loops (readers now loading the new tensor), `restart`
    replace them with the new op's own loops, keeping the compute location (the rewritten tensor),
    and `inserted` goes in at `insert_at` (the new cache or rfactor stage)."""
    ops: dict[int, Tensor]
    restart: dict[int, Tensor]
    insert_at: int
    inserted: Stage

    def apply(self, state: "State", step: "Step") -> "State":
        stages = list(state.stages)
        for i, op in self.ops.items():
            stages[i] = stages[i].replace(op=op)
        for i, op in self.restart.items():
            stages[i] = initial_stage(op).replace(compute_at=stages[i].compute_at, attach=stages[i].attach)
        stages.insert(self.insert_at, self.inserted)
        return state._derive(stages, step, same_ops=False)


def _rewrite_once(step: "CacheReadStep | CacheWriteStep | RfactorStep", state: "State") -> "State":
    key = step.rewrite_key(state)
    hit = _REWRITES.get(state.dag, key)
    if hit is None:
        rewrite = step.rewrite(state)
        new = rewrite.apply(state, step)
        _REWRITES.put(state.dag, key, (state.stages, rewrite, new.analysis))   # the stages: their ids are the key
        return new
    new = hit[1].apply(state, step)
    new._analysis = hit[2]
    return new


def _op_ids(state: "State") -> tuple[int, ...]:
    return tuple(id(s.op) for s in state.stages)


def _loop_signature(stage: Stage) -> tuple:
    """A stage's loops as plain values: its iterators (name, extent, kind) and split/fuse relations, each
    loop variable named by its place (the op's axes first, then in order of appearance). Two stages of
    the same op with equal signatures have the same loop structure, whatever their variable objects."""
    index: dict[Var, int] = {v: i for i, v in enumerate(stage.op.axes + stage.op.reduce_axes)}

    def at(v: Var) -> int:
        return index.setdefault(v, len(index))

    relations = tuple(("split", at(r.parent), r.parent_extent, tuple(map(at, r.children)), r.extents,
                       r.inner_to_outer) if isinstance(r, Split) else
                      ("fuse", tuple(map(at, r.parents)), r.extents, at(r.fused)) for r in stage.relations)
    return relations, tuple((at(it.var), it.name, it.extent, it.kind) for it in stage.iters)


def _redirect_loads(ops: list[Tensor], replaced: dict[Tensor, Tensor]) -> dict[int, Tensor]:
    """Point every later reader of a replaced op at its replacement, transitively (TVM's
    ReplaceDataFlow): a consumer that kept loading the old op would no longer be its consumer.
    Returns the positions in `ops` whose op is replaced, and by what."""
    replaced = dict(replaced)
    out: dict[int, Tensor] = {}
    for i, op in enumerate(ops):
        if op in replaced.values() or op.is_placeholder:
            continue
        assert op.body is not None                # not a placeholder
        if not any(isinstance(n, Load) and n.tensor in replaced for n in te.walk(op.body)):
            continue
        body = te.transform(op.body, lambda n: Load(replaced[n.tensor], n.indices)
                            if isinstance(n, Load) and n.tensor in replaced else None)
        out[i] = replaced[op] = Tensor(op.name, op.shape, op.dtype, op.axes, body, op.attrs)
    return out


@dataclass(frozen=True)
class CacheReadStep(Step):
    """Copy a tensor into `scope` for the given readers (GPU shared memory, CPU packing)."""
    stage_id: int
    scope_name: str
    reader_stage_ids: tuple[int, ...]
    code = "CHR"

    def apply(self, state: "State") -> "State":
        return _rewrite_once(self, state)

    def rewrite_key(self, state: "State") -> tuple:
        return self, _op_ids(state)

    def rewrite(self, state: "State") -> Rewrite:
        stage = check_stage(state, self.stage_id, "cache_read")
        if not self.reader_stage_ids:
            raise IllegalStep("cache_read needs at least one reader stage")
        readers = [check_stage(state, r, "cache_read") for r in self.reader_stage_ids]
        for r in readers:
            if stage.op not in r.op.inputs():
                raise IllegalStep(f"cache_read: {r.name} does not read {stage.name}")
        old = stage.op
        name = _unique_stage_name(state, f"{old.name}.{self.scope_name}")
        cache = te.compute(old.shape, lambda *i: old[i], name=name)
        ops = [s.op for s in state.stages]
        replaced = {}
        for rid, r in zip(self.reader_stage_ids, readers):
            assert r.op.body is not None             # a reader computes
            body = te.transform(r.op.body, lambda n: Load(cache, n.indices)
                                if isinstance(n, Load) and n.tensor is old else None)
            replaced[r.op] = ops[rid] = Tensor(r.op.name, r.op.shape, r.op.dtype, r.op.axes, body, r.op.attrs)
        changed = {rid: ops[rid] for rid in self.reader_stage_ids} | _redirect_loads(ops, replaced)
        return Rewrite(changed, {}, self.stage_id + 1, initial_stage(cache, self.scope_name, "cache_read"))

    def to_json(self) -> list:
        return [self.code, self.stage_id, self.scope_name, list(self.reader_stage_ids)]

    @classmethod
    def from_json(cls, args: list) -> "CacheReadStep":
        s, scope, readers = args
        return cls(int(s), str(scope), tuple(int(x) for x in readers))


@dataclass(frozen=True)
class CacheWriteStep(Step):
    """Compute into a `scope` buffer, then copy out: the register tile of multi-level tiling."""
    stage_id: int
    scope_name: str
    code = "CHW"

    def apply(self, state: "State") -> "State":
        return _rewrite_once(self, state)

    def rewrite_key(self, state: "State") -> tuple:
        """The ops, once the stage is known to have nothing computed at it (which they do not say)."""
        _unattached_stage(state, self.stage_id, "cache_write")
        return self, _op_ids(state)

    def rewrite(self, state: "State") -> Rewrite:
        stage = check_stage(state, self.stage_id, "cache_write")
        old = stage.op
        local = fresh_copy(old, _unique_stage_name(state, f"{old.name}.{self.scope_name}"))
        axes = tuple(IterVar(a.name, a.extent, "spatial") for a in old.axes)
        out = Tensor(old.name, old.shape, old.dtype, axes, Load(local, axes), old.attrs)
        ops = [s.op for s in state.stages]
        ops[self.stage_id] = out
        return Rewrite(_redirect_loads(ops, {old: out}), {self.stage_id: out}, self.stage_id,
                       initial_stage(local, self.scope_name, "cache_write"))

    def to_json(self) -> list:
        return [self.code, self.stage_id, self.scope_name]

    @classmethod
    def from_json(cls, args: list) -> "CacheWriteStep":
        s, scope = args
        return cls(int(s), str(scope))


@dataclass(frozen=True)
class RfactorStep(Step):
    """Factor a reduction: the iterator `iter_id` becomes a spatial axis of a new `.rf` stage."""
    stage_id: int
    iter_id: int
    factor_iter_id: int
    code = "RF"

    def apply(self, state: "State") -> "State":
        return _rewrite_once(self, state)

    def rewrite_key(self, state: "State") -> tuple:
        """The ops and the factored stage's loops (the new ops follow them), as `_loop_signature`: every
        sample of a sketch splits the reduction before this step, so keyed by the stage objects each
        one made its own ops and access analysis (a pool's round replayed 2 500 of them, a third of its
        search). Whether a stage is computed at it is checked on each state: the key does not say."""
        return self, _op_ids(state), _loop_signature(_unattached_stage(state, self.stage_id, "rfactor"))

    def rewrite(self, state: "State") -> Rewrite:
        stage = check_stage(state, self.stage_id, "rfactor")
        it = check_iter(stage, self.iter_id, "rfactor")
        op = stage.op
        if not isinstance(op.body, te.Reduce) or it.kind != "reduce":
            raise IllegalStep(f"rfactor: iterator {it.name} of {stage.name} is not a reduction iterator")
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
        f_axis = IterVar(f"{it.name}", it.known_extent, "spatial")
        sp_axes = new_sp[:self.factor_iter_id] + [f_axis] + new_sp[self.factor_iter_id:]
        red_axes = [IterVar(x.name, x.known_extent, "reduce") for x in reduce_leaves if x is not it]
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
        rf_body: te.Expr
        if red_axes:
            rf_body = te.Reduce(op.body.combiner, src, tuple(red_axes))
        else:
            rf_body = src
        rf = Tensor(rf_name, rf_shape, op.dtype, tuple(sp_axes), rf_body, {})
        out_axes = tuple(IterVar(a.name, a.extent, "spatial") for a in op.axes)
        r = IterVar(f"{it.name}_v", it.known_extent, "reduce")
        idx = list(out_axes[:self.factor_iter_id]) + [r] + list(out_axes[self.factor_iter_id:])
        out = Tensor(op.name, op.shape, op.dtype, out_axes,
                     te.Reduce(op.body.combiner, Load(rf, tuple(idx)), (r,)), op.attrs)
        ops = [s.op for s in state.stages]
        ops[self.stage_id] = out
        return Rewrite(_redirect_loads(ops, {op: out}), {self.stage_id: out}, self.stage_id,
                       initial_stage(rf, origin="rfactor"))

    def to_json(self) -> list:
        return [self.code, self.stage_id, self.iter_id, self.factor_iter_id]

    @classmethod
    def from_json(cls, args: list) -> "RfactorStep":
        s, i, fi = args
        return cls(int(s), int(i), int(fi))


@dataclass(frozen=True)
class StorageAlignStep(Step):
    stage_id: int
    iter_id: int
    factor: int
    offset: int
    code = "SA"

    def apply(self, state: "State") -> "State":
        stage = check_stage(state, self.stage_id, "storage_align")
        it = check_iter(stage, self.iter_id, "storage_align")
        if it.var not in stage.op.axes:
            raise IllegalStep(f"storage_align: {it.name} of {stage.name} is not an axis of the tensor")
        if self.factor <= 0 or not 0 <= self.offset < self.factor:
            raise IllegalStep(f"storage_align needs factor > 0 and 0 <= offset < factor, got "
                              f"{self.factor}, {self.offset}")
        axis = list[Var](stage.op.axes).index(it.var)
        stages = list(state.stages)
        aligns = tuple(a for a in stage.storage_align if a[0] != axis) + ((axis, self.factor, self.offset),)
        stages[self.stage_id] = stage.replace(storage_align=aligns)
        return state._derive(stages, self)

    def to_json(self) -> list:
        return [self.code, self.stage_id, self.iter_id, self.factor, self.offset]

    @classmethod
    def from_json(cls, args: list) -> "StorageAlignStep":
        s, i, f, o = args
        return cls(int(s), int(i), int(f), int(o))


STEP_TYPES: dict[str, type[Step]] = {cls.code: cls for cls in (
    SplitStep, FollowSplitStep, FollowFusedSplitStep, ReorderStep, FuseStep, AnnotationStep, PragmaStep,
    ComputeAtStep, ComputeInlineStep, ComputeRootStep, CacheReadStep, CacheWriteStep, RfactorStep, StorageAlignStep)}


def step_from_json(item: list) -> Step:
    """Parse one step; malformed input raises IllegalStep naming the step."""
    step_type = STEP_TYPES.get(item[0]) if isinstance(item, list) and item and isinstance(item[0], str) else None
    if step_type is None:
        raise IllegalStep(f"malformed step {item!r}: unknown step code {item[0] if item else None!r}")
    try:
        return step_type.from_json(item[1:])
    except (TypeError, ValueError, IndexError) as err:
        raise IllegalStep(f"malformed step {item!r}: {err}") from None
