"""A program's structure for its features, whole and in independent parts, read from its steps alone.

A feature template (`feature.FeatureTemplate`) turns the open numbers of one structure (tile sizes,
unroll depths) into features; building one is symbolic work of 5-20 ms. Programs of one structure share
it, and for a conv or a matmul a round's thousands of programs fall into a few hundred structures. A
Winograd conv has five stages (data_pad, data_pack, bgemm and its cache, inverse, the output), each
with its own compute location, fused parallel loops and vectorised axis, and whole-program structures
multiply: 2048 sampled F(4) programs fell into 1729 structures, and on the Xeon VM a search round of
such a task took 15-40 s, nearly all of it building templates.

A store's features depend only on its own loop nest, on the loops it is computed inside (its
compute_at target's, and theirs) and, where a stage is computed inside another one, on the region its
readers need there. So the stages fall into *parts*: a stage computed at another is in the part of its
target and of each stage that reads it; every other stage stands alone. A part's features follow from
the steps on its stages, the splits those follow (`FSP`, `FFSP`), and the steps that shape the stage
list and the bodies (cache_read, cache_write, rfactor, compute_inline: the *layout* steps, in every
part). A part's key is that subsequence of steps, numbers left open as in the whole-program key, with
the part's stage positions: the same 2048 Winograd programs have 122 part structures. A stage that a
cache write, cache read or rfactor makes inherits the steps done so far to the stage it is made from;
the stages whose loops an rfactor's split fixes (its lengths are part of the structure) are one part.

Nothing here replays a program (evolution keys thousands of them a round, most never replayed). Which
stage a step acts on follows from the layout steps alone (they are the only ones that insert stages);
which stages read which follows from the layout steps too (data flow changes only with caches,
rfactors and inlining), so it is learnt once per layout from one replayed program (`Readers`).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Callable, Sequence

from tensortune.schedule.program import Program
from tensortune.schedule.state import State
from tensortune.schedule.steps import (
    CacheReadStep,
    CacheWriteStep,
    ComputeAtStep,
    ComputeInlineStep,
    ComputeRootStep,
    FollowFusedSplitStep,
    FollowSplitStep,
    PragmaStep,
    RfactorStep,
    SplitStep,
    Step,
)
from tensortune.tasks import te

# steps that shape the stage list or the bodies: in every part (a split feeding an rfactor is not one:
# it is on the stage rfactored, whose history the new stage inherits; `_walk`)
_LAYOUT_STEPS = (CacheReadStep, CacheWriteStep, RfactorStep, ComputeInlineStep)


def structural_split(steps: Sequence[Step], i: int) -> bool:
    """A split whose lengths shape an operator (the one feeding an rfactor) is part of the structure."""
    return i + 1 < len(steps) and isinstance(steps[i + 1], RfactorStep)


def _open_unroll(step: Step) -> bool:
    return isinstance(step, PragmaStep) and step.pragma.startswith("auto_unroll_max_step")


def _open_step(steps: Sequence[Step], i: int) -> Step | tuple:
    """Step i with its open numbers left out: a split's lengths and an unroll depth."""
    st = steps[i]
    if isinstance(st, SplitStep) and not structural_split(steps, i):
        return ("SP", st.stage_id, st.iter_id, st.extent, len(st.lengths), int(st.inner_to_outer))
    if _open_unroll(st):
        return ("PR", st.stage_id, st.iter_id)       # type: ignore[attr-defined]
    return st


def _step_key(steps: Sequence[Step], i: int) -> list:
    """Step i as a part's JSON key holds it (`_open_step` as JSON)."""
    st = _open_step(steps, i)
    return list(st) if isinstance(st, tuple) else st.to_json()


def structure_key(program: Program) -> tuple:
    """Equal for programs that differ only in tile sizes and unroll depths: the steps, with those numbers
    left out. A tuple of the steps themselves (frozen values), not their JSON: evolution keys thousands of
    programs a round by it, and a tuple is made and hashed in a tenth of the time `program_parts` takes."""
    steps = program.steps
    return tuple(_open_step(steps, i) for i in range(len(steps)))


def slots_of(steps: Sequence[Step], indices: Sequence[int]) -> list[tuple[int, int]]:
    """(step index, position) of every number steps[indices] leave open; position -1 = an unroll depth."""
    out = []
    for i in indices:
        st = steps[i]
        if isinstance(st, SplitStep) and not structural_split(steps, i):
            out += [(i, k) for k in range(len(st.lengths))]
        elif _open_unroll(st):
            out.append((i, -1))
    return out


def slots(state: Program) -> list[tuple[int, int]]:
    """The open numbers of a whole program."""
    return slots_of(state.steps, range(len(state.steps)))


def slot_number(st: Step, k: int) -> int:
    """The number at one slot (see `slots_of`): a split's k-th length, or (k = -1) a pragma's value."""
    if k < 0 and isinstance(st, PragmaStep):
        return st.parsed()[1]
    if k >= 0 and isinstance(st, SplitStep):
        length = st.lengths[k]
        if length is None:
            raise ValueError("a split with an open length has no features")
        return length
    raise TypeError(f"slot {k} of a {type(st).__name__} holds no number")


def state_numbers(state: Program, at: Sequence[tuple[int, int]]) -> list[int]:
    return [slot_number(state.steps[i], k) for i, k in at]


@dataclass(frozen=True)
class Part:
    """Stages of a program whose features depend on each other, and what a template of them needs."""
    key: str                          # equal for parts with the same structure (numbers open)
    stages: tuple[int, ...]           # the stages' positions in the program's final stage list
    slots: tuple[tuple[int, int], ...]  # the program's open numbers the part's features depend on, in key order
    rows: tuple[int, ...]             # where the part's feature rows go among the program's (stores in stage order)


@dataclass(frozen=True)
class ProgramParts:
    parts: tuple[Part, ...]
    n_rows: int                       # the program's stores: compute stages neither inlined nor placeholders


@dataclass(frozen=True)
class Readers:
    """For one layout: which stages are stores, and the stores whose bodies (inlined stages put in) read
    each stage. Learnt from one replayed program (`of`)."""
    stores: tuple[int, ...]
    readers: dict[int, tuple[int, ...]]

    @staticmethod
    def of(state: State) -> "Readers":
        stages = state.stages
        position = {s.name: i for i, s in enumerate(stages)}
        stores = tuple(i for i, s in enumerate(stages) if not s.is_placeholder and s.compute_at != "inline")
        readers: dict[int, list[int]] = {}
        bodies = state.effective_bodies()
        for j in stores:
            for node in te.walk_distinct(bodies[stages[j].name]):
                if isinstance(node, te.Load) and node.tensor.name in position:
                    readers.setdefault(position[node.tensor.name], []).append(j)
        return Readers(stores, {i: tuple(sorted(set(r))) for i, r in readers.items()})


@dataclass
class _Walk:
    """What one pass over a step list finds: the steps on each stage (by its position in the final
    stage list), the final compute location of each stage, and the layout steps."""
    steps_on: dict[int, list[int]]    # stage -> indices of the (non-layout) steps on it
    attach: dict[int, int]            # stage -> the stage it is computed at
    layout: list[int]                 # indices of the layout steps
    n_stages: int


def _walk(steps: Sequence[Step], n_initial: int) -> _Walk:
    token = list(range(n_initial))            # stage id -> a token naming the stage for good
    new_token = itertools.count(n_initial)
    steps_on: dict[int, list[int]] = {}
    attach: dict[int, int | None] = {}
    layout = []
    for i, st in enumerate(steps):
        sid = getattr(st, "stage_id", None)
        t = token[sid] if sid is not None else -1
        if not isinstance(st, _LAYOUT_STEPS):
            steps_on.setdefault(t, []).append(i)
            if isinstance(st, ComputeAtStep):
                attach[t] = token[st.target_stage_id]
            elif isinstance(st, ComputeRootStep):
                attach[t] = None
            continue
        layout.append(i)
        if isinstance(st, ComputeInlineStep):
            attach[t] = None
        elif isinstance(st, (CacheReadStep, CacheWriteStep, RfactorStep)):
            # the new stage goes in after the stage read (cache_read) or before the one written; it is
            # made from that stage, so whatever was done to it so far is the new stage's history too
            new = next(new_token)
            token.insert(st.stage_id + 1 if isinstance(st, CacheReadStep) else st.stage_id, new)
            steps_on[new] = list(steps_on.get(t, ()))
    final = {t: k for k, t in enumerate(token)}
    return _Walk({final[t]: idx for t, idx in steps_on.items() if t in final},
                 {final[t]: final[target] for t, target in attach.items() if target is not None},
                 layout, len(token))


def layout_key(steps: Sequence[Step]) -> str:
    """Equal for programs whose stage lists and bodies are the same (`Readers` depend on nothing else)."""
    return json.dumps([_step_key(steps, i) for i, st in enumerate(steps) if isinstance(st, _LAYOUT_STEPS)],
                      separators=(",", ":"))


def program_parts(program: Program, n_initial: int, readers: Callable[[str, Program], Readers]) -> ProgramParts:
    """The parts of `program` (a State or a Candidate) whose DAG has `n_initial` stages; `readers(key,
    program)` gives the Readers of its layout (`layout_key`), replaying the program if they are new."""
    steps = program.steps
    walk = _walk(steps, n_initial)
    known = readers(layout_key(steps), program)
    if max(known.stores, default=-1) >= walk.n_stages:
        raise ValueError("the layout's readers do not fit this program's stage list")
    # 1. stages in parts: a stage computed at another joins its target and each of its readers
    stores = set(known.stores)
    group = {s: s for s in stores}

    def find(s: int) -> int:
        while group[s] != s:
            group[s] = s = group[group[s]]
        return s

    for s, target in walk.attach.items():
        if s in stores and target in stores:
            group[find(s)] = find(target)
            for r in known.readers.get(s, ()):
                group[find(s)] = find(r)
    # stages whose lengths an rfactor's split fixes have parts of their own for nearly every program
    # (those lengths are part of the structure): one part for all of them makes one template, not several
    fixed_splits = {i for i in range(len(steps)) if structural_split(steps, i)}
    fixed = [s for s in stores if not fixed_splits.isdisjoint(walk.steps_on.get(s, ()))]
    for s in fixed[1:]:
        group[find(s)] = find(fixed[0])
    members: dict[int, list[int]] = {}
    for s in sorted(stores):
        members.setdefault(find(s), []).append(s)
    # 2. each part's steps: the layout's, its stages', and the splits those follow, in program order;
    # the key of each step and its open numbers are made once, whatever parts it is in
    row = {s: r for r, s in enumerate(sorted(stores))}
    items: dict[int, list] = {}
    numbers: dict[int, list[tuple[int, int]]] = {}
    parts = []
    for stages in members.values():
        chosen = set(walk.layout)
        todo = [i for s in stages for i in walk.steps_on.get(s, ())]
        while todo:
            i = todo.pop()
            if i in chosen:
                continue
            chosen.add(i)
            st = steps[i]
            if isinstance(st, FollowSplitStep):
                todo.append(st.src_step_id)
            elif isinstance(st, FollowFusedSplitStep):
                todo.extend(st.src_step_ids)
        order = sorted(chosen)
        at = {i: k for k, i in enumerate(order)}
        key: list = [stages]
        part_slots: list[tuple[int, int]] = []
        for i in order:
            st = steps[i]
            if isinstance(st, (FollowSplitStep, FollowFusedSplitStep)):
                item = st.to_json()                      # the followed splits, by their places in the part
                item[3] = at[st.src_step_id] if isinstance(st, FollowSplitStep) else [at[j] for j in st.src_step_ids]
                key.append(item)
                continue
            if i not in items:
                items[i], numbers[i] = _step_key(steps, i), slots_of(steps, (i,))
            key.append(items[i])
            part_slots += numbers[i]
        parts.append(Part(json.dumps(key, separators=(",", ":")), tuple(stages), tuple(part_slots),
                          tuple(row[s] for s in stages)))
    return ProgramParts(tuple(parts), len(stores))
