"""A stage of a schedule: one op's loop nest as iterators, how its leaf loops derive from its root axes
(`relations`: splits and fuses), where it is computed (`attach`) and its annotations.

Stage ids and iterator ids follow TVM: placeholders are stages; cache_read/cache_write/rfactor insert
stages and shift later ids.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field, fields

from tensortune.tasks import te
from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.te import IterVar, Tensor, Var

ANNOTATIONS = ("none", "unroll", "vectorize", "parallel", "vthread", "blockIdx.x", "blockIdx.y", "blockIdx.z",
               "threadIdx.x", "threadIdx.y", "threadIdx.z", "tensorize")
GPU_BINDINGS = ANNOTATIONS[4:11]
PRAGMAS = ("auto_unroll_max_step", "unroll_explicit", "debug_skip_region")


class IllegalStep(ValueError):
    """A transform that cannot apply to this state; the message says which stage/iterator and why."""


# Iterator, Split and Stage are frozen dataclasses whose __init__ is written out (init=False): the
# generated one sets each field through object.__setattr__, which finds the slot by name, and a replay
# builds some sixty of these objects per program. Setting the slots through their descriptors
# (`_slot_setters`, taken below each class) builds one in a third less time. Equality, hashing, repr
# and immutability are still the dataclass's.

def _slot_setters(cls: type) -> tuple:
    """The __set__ of each field's slot descriptor, in field order."""
    return tuple(cls.__dict__[f.name].__set__ for f in fields(cls))


@dataclass(frozen=True, slots=True, init=False)
class Iterator:
    name: str
    extent: int | None
    kind: str                    # "spatial" | "reduce"
    annotation: str = "none"
    var: Var = field(default=None, compare=False, repr=False)  # type: ignore[assignment]  # set by every maker
    pragmas: tuple = ()          # (("auto_unroll_max_step", 64),)

    def __init__(self, name: str, extent: int | None, kind: str, annotation: str = "none",
                 var: Var = None, pragmas: tuple = ()):  # type: ignore[assignment]
        set_name, set_extent, set_kind, set_annotation, set_var, set_pragmas = _ITERATOR_SLOTS
        set_name(self, name)
        set_extent(self, extent)
        set_kind(self, kind)
        set_annotation(self, annotation)
        set_var(self, var)
        set_pragmas(self, pragmas)

    @property
    def known_extent(self) -> int:
        """The extent, where the caller knows it is known (every split so far has concrete lengths)."""
        if self.extent is None:
            raise ValueError(f"the extent of {self.name} is not known (a split with an open length)")
        return self.extent


_ITERATOR_SLOTS = _slot_setters(Iterator)


@dataclass(frozen=True, slots=True, eq=False, init=False)
class Split:
    parent: Var
    parent_extent: int | None
    children: tuple[Var, ...]
    extents: tuple[int | None, ...]   # as seen by the State (before region tightening)
    inner_to_outer: bool = True
    step: int = -1                    # index of the step that made it (feature templates map lengths)

    def __init__(self, parent: Var, parent_extent: int | None, children: tuple[Var, ...],
                 extents: tuple[int | None, ...], inner_to_outer: bool = True, step: int = -1):
        set_parent, set_parent_extent, set_children, set_extents, set_inner_to_outer, set_step = _SPLIT_SLOTS
        set_parent(self, parent)
        set_parent_extent(self, parent_extent)
        set_children(self, children)
        set_extents(self, extents)
        set_inner_to_outer(self, inner_to_outer)
        set_step(self, step)


_SPLIT_SLOTS = _slot_setters(Split)


@dataclass(frozen=True, slots=True, eq=False)
class Fuse:
    parents: tuple[Var, ...]
    extents: tuple[int | None, ...]
    fused: Var


@dataclass(frozen=True, slots=True, init=False)
class Stage:
    op: Tensor
    iters: tuple[Iterator, ...]
    relations: tuple = ()
    compute_at: str = "root"               # "root" | "inline" | "iter"
    attach: tuple[str, Var] | None = None  # (target op name, target iterator var)
    scope: str = "global"
    storage_align: tuple = ()              # ((axis, factor, offset),)
    origin: str = ""                       # "cache_write" | "cache_read" | "rfactor" | "" (from the DAG)

    def __init__(self, op: Tensor, iters: tuple[Iterator, ...], relations: tuple = (), compute_at: str = "root",
                 attach: tuple[str, Var] | None = None, scope: str = "global", storage_align: tuple = (),
                 origin: str = ""):
        (set_op, set_iters, set_relations, set_compute_at, set_attach, set_scope, set_storage_align,
         set_origin) = _STAGE_SLOTS
        set_op(self, op)
        set_iters(self, iters)
        set_relations(self, relations)
        set_compute_at(self, compute_at)
        set_attach(self, attach)
        set_scope(self, scope)
        set_storage_align(self, storage_align)
        set_origin(self, origin)

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


_STAGE_SLOTS = _slot_setters(Stage)


def initial_stage(op: Tensor, scope: str = "global", origin: str = "") -> Stage:
    axes = op.axes + op.reduce_axes
    iters = tuple(Iterator(a.name, a.extent, a.kind, var=a) for a in axes)
    return Stage(op, iters, scope=scope, origin=origin)


_INITIAL_STAGES: "weakref.WeakKeyDictionary[ComputeDAG, tuple[Stage, ...]]" = weakref.WeakKeyDictionary()


def initial_stages(dag: ComputeDAG) -> tuple[Stage, ...]:
    """The naive state's stages, made once per DAG (they are immutable; every replay starts here)."""
    stages = _INITIAL_STAGES.get(dag)
    if stages is None:
        stages = _INITIAL_STAGES[dag] = tuple(initial_stage(t) for t in dag.tensors)
    return stages


def fresh_copy(op: Tensor, name: str, body_map=None) -> Tensor:
    """The same compute with new axis variables (two stages must never share loop variables)."""
    axes = tuple(IterVar(a.name, a.extent, a.kind) for a in op.axes)
    red = tuple(IterVar(a.name, a.extent, a.kind) for a in op.reduce_axes)
    mapping = dict(zip(op.axes + op.reduce_axes, axes + red))
    body = op.body
    assert body is not None                          # a compute, not a placeholder
    if isinstance(body, te.Reduce):
        body = te.Reduce(body.combiner, te.substitute(body.source, mapping), red)
    else:
        body = te.substitute(body, mapping)
    if body_map is not None:
        body = body_map(body)
    return Tensor(name, op.shape, op.dtype, axes, body, op.attrs)

