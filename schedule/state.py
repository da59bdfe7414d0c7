"""Loop State: a schedule as transform steps applied to a ComputeDAG (TVM's loop_state).

A State is immutable: every transform returns a new State whose `steps` end with the step that made
it, so replaying `steps` on the DAG rebuilds it anywhere (a worker, a resumed run). Iterators carry a
loop variable; each stage records how its leaf loops derive from its root axes (`relations`), which is
all lowering needs to compute index expressions and bounds.
"""
from __future__ import annotations

import itertools
import json
from typing import Callable, Iterable, Sequence

from tensortune.schedule.dag_memo import DagMemo
from tensortune.schedule.stage import GPU_BINDINGS, IllegalStep, Stage, initial_stages
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
    check_iter,
    check_stage,
    step_from_json,
)
from tensortune.tasks import te
from tensortune.tasks.compute_dag import AccessAnalysis, ComputeDAG
from tensortune.tasks.te import Load, Tensor

# effective bodies per DAG, the last few stage lists' (by their ops and inlining)
_EFFECTIVE_BODIES = DagMemo(kept=64)


class State:
    """Stages + the steps that made them from the DAG."""

    __slots__ = ("dag", "stages", "steps", "_analysis")

    def __init__(self, dag: ComputeDAG, stages: tuple[Stage, ...] | None = None, steps: tuple[Step, ...] = ()):
        self.dag = dag
        self.stages = stages if stages is not None else initial_stages(dag)
        self.steps = steps
        self._analysis: AccessAnalysis | None = None

    def _derive(self, stages: list[Stage], step: Step, same_ops: bool = True) -> "State":
        """The state `step` makes, with `stages`. Only cache_read, cache_write and rfactor give stages
        new ops (same_ops=False); every other step keeps each stage's op, so the access analysis of the
        ops carries over, and the step says so rather than a scan of the ops on every step of a replay."""
        new = State(self.dag, tuple(stages), self.steps + (step,))
        if same_ops:
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
        attach = self.stage_by_name(producer).attach
        assert attach is not None, f"{producer} is not computed at a loop"
        target, var = attach
        target_stage = self.stage_by_name(target)
        at = target_stage.iter_index(var)
        cur = consumer
        while cur != target:
            st = self.stage_by_name(cur)
            if st.compute_at != "iter" or st.attach is None:
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
        """Each non-inlined compute stage's body with the inlined stages it reads substituted. They
        depend on the stages' ops and which are inlined alone, so states that share both (the samples
        of a sketch) get the same body objects, which the cost model's feature templates count once."""
        key = tuple((id(s.op), s.compute_at == "inline") for s in self.stages)
        hit = _EFFECTIVE_BODIES.get(self.dag, key)
        if hit is None:
            hit = (tuple(s.op for s in self.stages), self._expand_inlined())     # the ops: their ids are the key
            _EFFECTIVE_BODIES.put(self.dag, key, hit)
        return dict(hit[1])

    def _expand_inlined(self) -> dict[str, te.Expr]:
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
            if st.op.body is None:                   # a placeholder
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
        st = check_stage(self, sid, "split")
        return SplitStep(sid, iter_id, check_iter(st, iter_id, "split").extent, tuple(lengths),
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
    def replay(dag: ComputeDAG, steps: Iterable[Step], start: "State | None" = None) -> "State":
        """The state `steps` make from the DAG. `start`: a state the first len(start.steps) of them
        already made (a mutation replayed them to decide what to change); replay is deterministic, so
        the rest applied to it give the state a replay from the DAG would."""
        state = start if start is not None else State(dag)
        done = len(state.steps)
        for i, step in enumerate(itertools.islice(steps, done, None), done):
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
        return State.replay(dag, State.parse_steps(steps))

    @staticmethod
    def parse_steps(steps: str | list) -> tuple[Step, ...]:
        """The steps of a record, parsed but not applied (IllegalStep when malformed): a caller that knows
        they replay (flows.stored_features) leaves the replay until something needs the loops."""
        if isinstance(steps, str):
            try:
                steps = json.loads(steps)
            except json.JSONDecodeError as err:
                raise IllegalStep(f"malformed step JSON: {err}; expected a list like "
                                  f"[[\"SP\",2,0,512,[16],1], ...]") from None
        if not isinstance(steps, list) or not all(isinstance(s, list) and s for s in steps):
            raise IllegalStep("malformed step JSON: expected a list of steps, each a non-empty list")
        return tuple(step_from_json(s) for s in steps)

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

