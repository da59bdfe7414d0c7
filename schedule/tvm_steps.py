"""TVM auto_scheduler's step lists, converted to ours and back.

Our steps are TVM's (same codes, same arguments, same iterator numbering: a stage's iterators are its
axes then its reduce axes, and splits, fuses and reorders renumber them the same way), with three
differences this file converts:

- Stage ids. Both number stages by a topological order of the DAG, but not the same one: TVM's
  TopoSortOps (src/auto_scheduler/compute_dag.cc) walks depth first from the workload's tensors,
  gives each op the time it was first popped, then emits ready ops (no unemitted inputs) latest-first;
  ours is a post-order from the outputs. `tvm_stage_order` runs TVM's walk on our DAG. Cache read,
  cache write and rfactor insert a stage at the same place in both (read: after the stage; write,
  rfactor: before it), so the map is carried through them.
- Annotation numbers ("AN"): TVM's IteratorAnnotation enum orders the GPU axes blockIdx.x,
  threadIdx.x, blockIdx.y, threadIdx.y, ...; ours (schedule.stage.ANNOTATIONS) groups them by kind.
- A split's extent ("SP", third argument): TVM writes 0 when the iterator's range is unknown (it clears
  ranges at compute_at), ours null. Neither applies it (a split works from the iterator's own range),
  so on import it is recomputed the way our own State.split records it.

Where TVM's function builds a stage ours does not (topi's conv2d keeps a `pad_temp` copy at padding
0), the caller passes TVM's form of the DAG (`tvm_dag`, tasks.tvm_workloads.tvm_form); stages are
matched by name, and such a stage must be inlined in TVM's program: its "CI" step is dropped on
import (later step ids move down) and written first on export.

A step that does not apply on our side (TVM allows some we refuse, e.g. fusing a spatial with a reduce
iterator) makes the whole program unconvertible: `UnconvertibleSteps` names the step and why.
"""
from __future__ import annotations

from typing import Sequence

from tensortune.schedule.stage import ANNOTATIONS, IllegalStep
from tensortune.schedule.state import State
from tensortune.schedule.steps import (
    AnnotationStep,
    CacheReadStep,
    CacheWriteStep,
    ComputeAtStep,
    ComputeInlineStep,
    ComputeRootStep,
    FollowFusedSplitStep,
    FollowSplitStep,
    FuseStep,
    PragmaStep,
    ReorderStep,
    RfactorStep,
    SplitStep,
    Step,
    StorageAlignStep,
)
from tensortune.tasks import te
from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.te import Tensor

# TVM's IteratorAnnotation enum (transform_step.h), index = the number in an "AN" step
TVM_ANNOTATIONS = ("none", "unroll", "vectorize", "parallel", "vthread", "blockIdx.x", "threadIdx.x",
                   "blockIdx.y", "threadIdx.y", "blockIdx.z", "threadIdx.z", "tensorize")
assert sorted(TVM_ANNOTATIONS) == sorted(ANNOTATIONS)
TVM_PRAGMAS = ("auto_unroll_max_step", "debug_skip_region")    # what PragmaStep::ApplyToState accepts


class UnconvertibleSteps(ValueError):
    """A TVM program that has no tensortune form (or the reverse); the message names the step."""


def _input_tensors(t: Tensor) -> list[Tensor]:
    """TVM's ComputeOp::InputTensors: the tensors the body loads, in post-order of first visit."""
    if t.body is None:
        return []
    seen: dict[Tensor, None] = {}
    stack: list[tuple[te.Expr, bool]] = [(t.body, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            if isinstance(node, te.Load):
                seen.setdefault(node.tensor, None)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(te.children(node)))
    return list(seen)


def tvm_stage_order(dag: ComputeDAG) -> list[int]:
    """TVM's stage order of the DAG, as indices into `dag.tensors` (our stage ids): TopoSortOps run on
    the workload's tensors (`dag.args`, the list the workload function returns, as TVM gets it)."""
    priority: dict[Tensor, int] = {}
    degree: dict[Tensor, int] = {}
    consumers: dict[Tensor, list[Tensor]] = {}
    stack = list(dag.args)
    while stack:
        op = stack.pop()
        if op in priority:
            continue
        priority[op] = len(priority)
        inputs = _input_tensors(op)
        degree[op] = len(inputs)
        for i in inputs:
            consumers.setdefault(i, []).append(op)
            stack.append(i)
    ready = [op for op, d in degree.items() if d == 0]
    order: list[Tensor] = []
    while ready:
        op = max(ready, key=priority.__getitem__)
        ready.remove(op)
        order.append(op)
        for c in consumers.get(op, []):
            degree[c] -= 1
            if degree[c] == 0:
                ready.append(c)
    index = {t: i for i, t in enumerate(dag.tensors)}
    if sorted(order, key=index.__getitem__) != dag.tensors:
        raise UnconvertibleSteps("TVM's topological order does not cover the DAG's tensors")
    return [index[t] for t in order]


class _StageMap:
    """TVM stage id <-> our stage id (None: a stage only TVM's DAG has), carried through the steps that
    insert stages."""

    def __init__(self, dag: ComputeDAG, tvm_dag: ComputeDAG | None = None):
        tvm_dag = tvm_dag if tvm_dag is not None else dag
        ours = {t.name: i for i, t in enumerate(dag.tensors)}
        self.names = [tvm_dag.tensors[i].name for i in tvm_stage_order(tvm_dag)]
        self.tvm_to_ours: list[int | None] = [ours.get(n) for n in self.names]
        if sorted(o for o in self.tvm_to_ours if o is not None) != list(range(len(dag.tensors))):
            raise UnconvertibleSteps("TVM's form of the DAG does not hold every stage of ours")

    @property
    def only_tvm(self) -> list[int]:
        """TVM's ids of the stages ours lacks."""
        return [i for i, o in enumerate(self.tvm_to_ours) if o is None]

    def check(self, tvm_id: object) -> int:
        if not isinstance(tvm_id, int) or isinstance(tvm_id, bool) or not 0 <= tvm_id < len(self.tvm_to_ours):
            raise UnconvertibleSteps(f"stage {tvm_id!r} does not exist (the state has {len(self.tvm_to_ours)} "
                                     "stages)")
        return tvm_id

    def ours(self, tvm_id: object) -> int:
        our = self.tvm_to_ours[self.check(tvm_id)]
        if our is None:
            raise UnconvertibleSteps(f"stage {tvm_id} is TVM's {self.names[self.check(tvm_id)]}, a copy stage "
                                     "tensortune's DAG does not have; only its inlining converts")
        return our

    def tvm(self, our_id: int) -> int:
        return self.tvm_to_ours.index(our_id)

    def insert(self, tvm_at: int, our_at: int, name: str = "") -> None:
        """A stage inserted at TVM position `tvm_at` and our position `our_at`."""
        self.tvm_to_ours = [None if o is None else o + (o >= our_at) for o in self.tvm_to_ours]
        self.tvm_to_ours.insert(tvm_at, our_at)
        self.names.insert(tvm_at, name)

    def after(self, step: Step, tvm_stage: int, our_stage: int) -> None:
        if isinstance(step, CacheReadStep):
            self.insert(tvm_stage + 1, our_stage + 1)
        elif isinstance(step, (CacheWriteStep, RfactorStep)):
            self.insert(tvm_stage, our_stage)


def _ints(values: object, what: str) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise UnconvertibleSteps(f"{what} must be a list of integers, got {values!r}")
    return tuple(values)


def _step_from_tvm(item: list, state: State, stages: _StageMap, step_ids: list[int | None]) -> tuple[Step, int]:
    """Our step for one TVM step on `state`, and the TVM stage it acts on (`step_ids`: TVM's step index
    -> ours, for the steps that follow earlier splits)."""
    code, args = item[0], item[1:]
    arity = {"SP": 5, "FSP": 4, "FFSP": 5, "RE": 2, "FU": 2, "AN": 3, "PR": 3, "CA": 3, "CI": 1, "CR": 1,
             "CHR": 3, "CHW": 2, "RF": 3, "SA": 4}
    if code not in arity:
        raise UnconvertibleSteps(f"unknown step code {code!r}")
    if len(args) != arity[code]:
        raise UnconvertibleSteps(f"{code} takes {arity[code]} arguments, got {len(args)}")
    tvm_stage = args[0]
    s = stages.ours(tvm_stage)
    if code == "SP":
        _, i, _, lengths, inner_to_outer = args
        lengths = _ints(lengths, "split lengths")
        stage = state.stages[s]
        extent = stage.iters[i].extent if isinstance(i, int) and 0 <= i < len(stage.iters) else None
        return SplitStep(s, i, extent, lengths, bool(inner_to_outer)), tvm_stage
    if code == "FSP":
        return FollowSplitStep(s, args[1], _step_id(args[2], step_ids), args[3]), tvm_stage
    if code == "FFSP":
        sources = tuple(_step_id(i, step_ids) for i in _ints(args[2], "source steps"))
        return FollowFusedSplitStep(s, args[1], sources, args[3], bool(args[4])), tvm_stage
    if code == "RE":
        return ReorderStep(s, _ints(args[1], "reorder")), tvm_stage
    if code == "FU":
        return FuseStep(s, _ints(args[1], "fuse")), tvm_stage
    if code == "AN":
        ann = args[2]
        if not isinstance(ann, int) or not 0 <= ann < len(TVM_ANNOTATIONS):
            raise UnconvertibleSteps(f"annotation {ann!r} is not one of TVM's 0..{len(TVM_ANNOTATIONS) - 1}")
        return AnnotationStep(s, args[1], TVM_ANNOTATIONS[ann]), tvm_stage
    if code == "PR":
        return PragmaStep(s, args[1], str(args[2])), tvm_stage
    if code == "CA":
        return ComputeAtStep(s, stages.ours(args[1]), args[2]), tvm_stage
    if code == "CI":
        return ComputeInlineStep(s), tvm_stage
    if code == "CR":
        return ComputeRootStep(s), tvm_stage
    if code == "CHR":
        readers = tuple(stages.ours(r) for r in _ints(args[2], "cache_read readers"))
        return CacheReadStep(s, str(args[1]), readers), tvm_stage
    if code == "CHW":
        return CacheWriteStep(s, str(args[1])), tvm_stage
    if code == "RF":
        return RfactorStep(s, args[1], args[2]), tvm_stage
    return StorageAlignStep(s, args[1], args[2], args[3]), tvm_stage


def _step_id(tvm_id: int, step_ids: list[int | None]) -> int:
    if not 0 <= tvm_id < len(step_ids) or step_ids[tvm_id] is None:
        raise UnconvertibleSteps(f"step {tvm_id} is not an earlier split")
    return step_ids[tvm_id]  # type: ignore[return-value]  # checked just above


def from_tvm(dag: ComputeDAG, tvm_steps: Sequence[list], tvm_dag: ComputeDAG | None = None) -> State:
    """Our program for TVM's step list on the workload whose DAG is `dag` (ours) and `tvm_dag` as TVM's
    function builds it, where that has stages ours lacks."""
    stages = _StageMap(dag, tvm_dag)
    inlined: set[int] = set()
    step_ids: list[int | None] = []
    state = State(dag)
    for n, item in enumerate(tvm_steps):
        try:
            if not isinstance(item, list) or not item or not isinstance(item[0], str):
                raise UnconvertibleSteps("a step is a list starting with its code")
            if item[0] == "CI" and len(item) == 2 and stages.tvm_to_ours[stages.check(item[1])] is None:
                inlined.add(item[1])             # TVM inlines a copy stage ours never had
                step_ids.append(None)
                continue
            step, tvm_stage = _step_from_tvm(item, state, stages, step_ids)
            before = stages.ours(tvm_stage)
            state = step.apply(state)
        except (UnconvertibleSteps, IllegalStep, TypeError, ValueError, IndexError) as err:
            raise UnconvertibleSteps(f"step {n} {item!r:.120}: {err}") from None
        step_ids.append(len(state.steps) - 1)
        stages.after(step, tvm_stage, before)
    kept = [stages.names[i] for i in stages.only_tvm if i not in inlined]
    if kept:
        raise UnconvertibleSteps(f"TVM's program keeps its copy stage(s) {', '.join(kept)} (never inlined); "
                                 "tensortune's DAG has none")
    return state


def _step_to_tvm(step: Step, stages: _StageMap, shift: int) -> list:
    tvm = stages.tvm
    if isinstance(step, SplitStep):
        return ["SP", tvm(step.stage_id), step.iter_id, step.extent or 0, list(step.lengths),
                int(step.inner_to_outer)]
    if isinstance(step, AnnotationStep):
        return ["AN", tvm(step.stage_id), step.iter_id, TVM_ANNOTATIONS.index(step.annotation)]
    if isinstance(step, ComputeAtStep):
        return ["CA", tvm(step.stage_id), tvm(step.target_stage_id), step.target_iter_id]
    if isinstance(step, CacheReadStep):
        return ["CHR", tvm(step.stage_id), step.scope_name, [tvm(r) for r in step.reader_stage_ids]]
    if isinstance(step, FollowSplitStep):
        return ["FSP", tvm(step.stage_id), step.iter_id, step.src_step_id + shift, step.n_split]
    if isinstance(step, FollowFusedSplitStep):
        return ["FFSP", tvm(step.stage_id), step.iter_id, [i + shift for i in step.src_step_ids], step.level,
                int(step.factor_or_nparts)]
    item = step.to_json()             # the rest name one stage first and carry no other stage ids
    return [item[0], tvm(item[1])] + item[2:]


def to_tvm(state: State, tvm_dag: ComputeDAG | None = None) -> list[list]:
    """TVM's step list for our program `state` (TVM stage ids and annotation numbers; `tvm_dag` as in
    from_tvm: the copy stages only TVM's DAG has are inlined first). A split of a stage computed inside
    another gets extent 0, "unknown": TVM's own extent there is the bounded region (our State keeps
    the full one), and TVM's tile-size mutation reads the extent, so a wrong one is worse than none."""
    stages = _StageMap(state.dag, tvm_dag)
    out: list[list] = [["CI", i] for i in stages.only_tvm]
    shift = len(out)
    replay = State(state.dag)
    for step in state.steps:
        if isinstance(step, SplitStep) and any(length is None for length in step.lengths):
            raise UnconvertibleSteps(f"{step.to_json()}: TVM records only concrete split lengths")
        if isinstance(step, PragmaStep) and step.parsed()[0] not in TVM_PRAGMAS:
            raise UnconvertibleSteps(f"{step.to_json()}: TVM's loop state takes only the pragmas "
                                     f"{', '.join(TVM_PRAGMAS)}")
        item = _step_to_tvm(step, stages, shift)
        if item[0] == "SP" and replay.stages[step.to_json()[1]].compute_at == "iter":
            item[3] = 0
        out.append(item)
        our_stage = int(step.to_json()[1])           # every step type names its stage first
        stages.after(step, stages.tvm(our_stage), our_stage)
        replay = step.apply(replay)
    return out
