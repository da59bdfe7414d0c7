"""Evolution operators: TVM's four mutation rules and the Ansor paper's node-based crossover.

Each operator takes candidates and returns a new candidate or None (could not apply). Tile-size and
unroll mutations only move numbers around and keep every product equal, so they need no replay;
compute-location, parallel and crossover change structure and are validated by replaying.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import replace as dc_replace
from typing import cast

from tensortune.schedule.stage import IllegalStep
from tensortune.schedule.state import State
from tensortune.schedule.steps import (
    AnnotationStep,
    CacheReadStep,
    CacheWriteStep,
    ComputeAtStep,
    ComputeInlineStep,
    ComputeRootStep,
    FuseStep,
    PragmaStep,
    RfactorStep,
    SplitStep,
    Step,
)
from tensortune.search import utils
from tensortune.search.annotation import AUTO_UNROLL_CPU, AUTO_UNROLL_GPU
from tensortune.search.candidate import Candidate


def mutate_tile_size(c: Candidate, rng: random.Random, max_innermost: int) -> Candidate | None:
    """Move one factor between two levels of a split, keeping the product (TVM's MutateTileSize)."""
    ids: list[tuple[int, SplitStep, int, tuple[int, ...]]] = []     # (step index, step, extent, lengths)
    for i, st in enumerate(c.steps):     # evolution calls this ~6000 times a round: the cheap tests first
        if not (isinstance(st, SplitStep) and st.inner_to_outer and st.extent and st.extent > 1) \
                or None in st.lengths:
            continue
        known = cast("tuple[int, ...]", st.lengths)          # every length known: checked above
        if known[-1] <= max_innermost:
            ids.append((i, st, st.extent, known))
    if not ids:
        return None
    i, split, extent, known = rng.choice(ids)
    prod = 1
    for x in known:
        prod *= x
    if extent % prod:
        return None                      # an imperfect split: keep it as it is
    lengths = [extent // prod] + list(known)
    perm = list(range(len(lengths)))
    rng.shuffle(perm)
    for k, src in enumerate(perm):
        if lengths[src] <= 1:
            continue
        dst = perm[(k + 1) % len(perm)]
        fs = utils.factors(lengths[src])
        if dst == len(lengths) - 1:
            fits = [f for f in fs[1:] if f * lengths[dst] <= max_innermost]
            if not fits:
                continue
            f = rng.choice(fits)
        else:
            f = rng.choice(fs[1:])
        new = list(lengths)
        new[src] //= f
        new[dst] *= f
        steps = list(c.steps)
        steps[i] = SplitStep(split.stage_id, split.iter_id, split.extent, tuple(new[1:]), split.inner_to_outer)
        rfactor_next = i + 1 < len(steps) and isinstance(steps[i + 1], RfactorStep)
        return c.with_steps(tuple(steps), same_structure=not rfactor_next)
    return None


def mutate_auto_unroll(c: Candidate, rng: random.Random, gpu: bool = False) -> Candidate | None:
    ids = [(i, st) for i, st in enumerate(c.steps) if isinstance(st, PragmaStep)
           and st.pragma.startswith("auto_unroll_max_step")]
    if not ids:
        return None
    i, pragma = rng.choice(ids)
    steps = list(c.steps)
    step = rng.choice(AUTO_UNROLL_GPU if gpu else AUTO_UNROLL_CPU)
    steps[i] = dc_replace(pragma, pragma=f"auto_unroll_max_step${step}")
    return c.with_steps(tuple(steps), same_structure=True)


def _replay(c: Candidate, steps: list[Step], start: State | None = None) -> Candidate | None:
    """The mutated program, if its steps apply and it is valid (`start`: as State.replay's)."""
    try:
        state = State.replay(c.dag, steps, start)
    except IllegalStep:
        return None
    if utils.has_nested_parallel(state) or utils.stage_read_outside_its_loop(state) is not None:
        return None
    return c.with_steps(state.steps, state)


def _states_along(c: Candidate) -> list[State]:
    """The state after each prefix of c's steps ([k]: after k steps; the last is c's state), from one
    replay: a compute-location mutation needs the whole program, the state before the step it changes,
    and the child, which shares every step before that one (three replays from the DAG before)."""
    return list(itertools.accumulate(c.steps, lambda state, step: step.apply(state), initial=State(c.dag)))


def mutate_compute_location(c: Candidate, rng: random.Random) -> Candidate | None:
    if not any(isinstance(st, ComputeAtStep) for st in c.steps):
        return None                     # nothing to move: no replay (a third of a conv's sketches)
    states = _states_along(c)
    state = states[-1]
    ids: list[tuple[int, ComputeAtStep]] = []
    for i, st in enumerate(c.steps):
        if isinstance(st, ComputeAtStep):
            sid = st.stage_id
            if utils.is_tiled(state.stages[sid]) or utils.needs_multi_level_tiling(state, sid):
                continue
            ids.append((i, st))
    if not ids:
        return None
    i, at = rng.choice(ids)
    # candidates are judged on the state just before this step
    before = states[i]
    cands = utils.compute_location_candidates(before, at.stage_id)
    if not cands:
        return None
    target, it = rng.choice(cands)
    steps = list(c.steps)
    steps[i] = ComputeAtStep(at.stage_id, target, it)
    return _replay(c, steps, before)


def mutate_parallel(c: Candidate, rng: random.Random) -> Candidate | None:
    """Change how many outer loops are fused into the parallel loop (TVM's MutateParallel)."""
    ids: list[tuple[int, FuseStep]] = []       # (index of the parallel annotation, the fuse before it)
    for i, st in enumerate(c.steps):
        prev = c.steps[i - 1] if i > 0 else None
        if isinstance(st, AnnotationStep) and st.annotation == "parallel" and st.iter_id == 0 \
                and isinstance(prev, FuseStep) and prev.fused_ids[0] == 0:
            ids.append((i, prev))
    if not ids:
        return None
    i, fuse = rng.choice(ids)
    sid = fuse.stage_id
    before = State.replay(c.dag, c.steps[:i - 1])
    stage = before.stages[sid]
    # Loops a later step annotates are not fused either (as annotation's own parallel rule stops at an
    # annotated loop). TVM's MutateParallel checks annotations in the state before the fuse only, where
    # the vectorize that follows is not applied yet: a transpose's parallel loop, fused over its
    # vectorised 3-wide one, became one vectorised loop of 150 528 lanes (224²), whose build ran into
    # the 15 s timeout in the round it was drawn.
    m = len(fuse.fused_ids)
    annotated = [st.iter_id + m - 1 for st in c.steps[i + 1:]
                 if isinstance(st, (AnnotationStep, PragmaStep)) and st.stage_id == sid and st.iter_id > 0]
    limit = 0
    while limit < min([len(stage.iters), *annotated]):
        it = stage.iters[limit]
        if it.kind == "reduce" or it.annotation != "none" or utils.has_attached(before, sid, limit):
            break
        limit += 1
    if limit == 0:
        return None
    n = rng.randrange(limit) + 1
    offset = fuse.fused_ids[-1] - (n - 1)
    if offset == 0:
        return None
    steps = list(c.steps[:i - 1]) + [FuseStep(sid, tuple(range(n))), c.steps[i]]
    for st in c.steps[i + 1:]:
        if getattr(st, "stage_id", None) == sid:
            if isinstance(st, (AnnotationStep, PragmaStep)):
                st = dc_replace(st, iter_id=0 if st.iter_id == 0 else st.iter_id + offset)
            else:
                return None
        if isinstance(st, (CacheReadStep, CacheWriteStep, RfactorStep)):
            return None
        steps.append(st)
    return _replay(c, steps, before)                # the child shares the steps before the fuse


# ------------------------------------------------------------------------------------ crossover

def _phase(st: Step) -> int:
    """Which annotation rule made a step: compute location, parallel, unroll, vectorize."""
    if isinstance(st, (ComputeAtStep, ComputeInlineStep, ComputeRootStep)):
        return 0
    if isinstance(st, PragmaStep):
        return 2
    if isinstance(st, AnnotationStep):
        return 1 if st.annotation == "parallel" else 3
    return -1


def _annotation_phases(steps: tuple[Step, ...], n_sketch: int) -> list[tuple[int, Step]]:
    """(phase, step) of the annotation steps; a fuse takes the phase of the annotation it prepares."""
    out: list[tuple[int, Step]] = []
    tail = steps[n_sketch:]
    for k, st in enumerate(tail):
        if isinstance(st, FuseStep):
            nxt = tail[k + 1] if k + 1 < len(tail) else None
            out.append((_phase(nxt) if nxt is not None else 3, st))
        else:
            out.append((_phase(st), st))
    return out


def _stage_id(st: Step) -> int | None:
    """The stage a step works on; None for a step that names none."""
    return getattr(st, "stage_id", None)


def _steps_by_stage(steps: tuple[Step, ...]) -> dict[int, list[Step]]:
    """Each stage's steps, in program order (steps that name no stage are left out)."""
    out: dict[int, list[Step]] = {}
    for st in steps:
        sid = _stage_id(st)
        if sid is not None:
            out.setdefault(sid, []).append(st)
    return out


def crossover(a: Candidate, b: Candidate, n_sketch: int, rng: random.Random) -> Candidate | None:
    """Node-based crossover (Ansor §5.1): each stage takes its tile sizes and annotations from one
    parent; the merged step list is replayed and kept only if valid. Parents must share a sketch.

    Only stages whose steps differ between the parents are drawn, and each parent must give one: a
    child whose differing stages all came from one parent would be that parent with its steps in
    another order, a new key for an old program (a third of the children of some workloads)."""
    if a.sketch != b.sketch or a.sketch < 0:
        return None
    by_a, by_b = _steps_by_stage(a.steps), _steps_by_stage(b.steps)
    stages = sorted(s for s in by_a.keys() | by_b.keys() if by_a.get(s) != by_b.get(s))
    pick = {s: rng.random() < 0.5 for s in stages}          # True: from b; the others are alike
    if all(pick.values()) or not any(pick.values()):
        return None
    steps: list[Step] = []
    for sa, sb in zip(a.steps[:n_sketch], b.steps[:n_sketch]):
        steps.append(sb if isinstance(sa, SplitStep) and pick.get(sa.stage_id) else sa)
    phases = []
    for parent, from_b in ((a, False), (b, True)):
        for order, (ph, st) in enumerate(_annotation_phases(parent.steps, n_sketch)):
            sid = _stage_id(st)
            if (pick.get(sid, False) if sid is not None else False) == from_b:   # stageless steps: from a
                phases.append((ph, from_b, order, st))
    phases.sort(key=lambda x: (x[0], x[1], x[2]))
    steps += [st for _, _, _, st in phases]
    return _replay(a, steps)
