"""Features by parts (search/feature_parts.py): a program's stores split into parts whose features
depend on each other, one template per part structure. The parts' rows must be the whole program's
template's rows bit for bit, for every program of sampled and mutated populations on CPU and GPU
(Winograd, rfactor, cache stages, stages computed inside others); each step must be found on the stage
it acts on without a replay; and a part template must fail, not guess, if a feature it makes depended on
a number outside its part."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tensortune.codegen.target import make_task
from tensortune.schedule.state import State
from tensortune.search.candidate import Candidate
from tensortune.search.feature import FeatureExtractor, FeatureTemplate
from tensortune.search.feature_parts import (
    Readers,
    _step_key,
    _walk,
    layout_key,
    program_parts,
    state_numbers,
    structure_key,
)
from tensortune.tasks.workload_registry import make_dag
from tests.test_feature_fast import TASKS, _population

WINOGRAD_NHWC_F4 = ("conv2d_winograd", (1, 16, 16, 16, 16, 1, 4, False, "NHWC"), "llvm -num-threads=2")
CASES = TASKS + [WINOGRAD_NHWC_F4, ("layer_norm", (8, 256), "llvm -num-threads=2")]
IDS = [f"{n}{'-nhwc' if 'NHWC' in a else ''}-{t.split()[0]}" for n, a, t in CASES]


def _whole(program, task) -> np.ndarray:
    template = FeatureTemplate(program.state, task)
    return template(np.array([state_numbers(program, template.slots)]))[0]


@pytest.mark.parametrize("name,args,target", CASES, ids=IDS)
def test_the_parts_rows_are_the_whole_programs_bit_for_bit(name, args, target):
    task = make_task(make_dag(name, *args), target)
    programs = _population(task, seed=7)
    ex = FeatureExtractor(task)
    got = ex(programs)
    by_structure: dict[tuple, list[int]] = {}
    for i, p in enumerate(programs):
        by_structure.setdefault(structure_key(p), []).append(i)
    for idx in by_structure.values():       # each program's rows against its whole structure's template
        template = FeatureTemplate(programs[idx[0]].state, task)
        want = template(np.array([state_numbers(programs[i], template.slots) for i in idx]))
        for i, rows in zip(idx, want):
            assert got[i].shape == rows.shape
            assert np.array_equal(got[i], rows), f"{name}: {programs[i].steps_json[:120]}..."
    parts = {part.key: len(part.rows) for p in programs for part in ex.parts(p).parts}
    assert len(ex.templates) == len(parts)
    # the point: a Winograd conv's five stages' choices no longer multiply. Rows of the templates
    # made (a template's cost grows with its stores), by parts against one template per program structure:
    whole = {structure_key(p): ex.parts(p).n_rows for p in programs}
    print(f"{name}: {len(parts)} part templates ({sum(parts.values())} rows), {len(whole)} structures "
          f"({sum(whole.values())} rows)")
    if name == "conv2d_winograd":
        assert sum(parts.values()) < sum(whole.values()) / 2


@pytest.mark.parametrize("name,args,target", [CASES[i] for i, n in enumerate(IDS) if n in (
    "conv2d_relu-cuda", "softmax-llvm", "conv2d_winograd-nhwc-llvm", "matmul-cuda")])
def test_each_step_is_found_on_the_stage_it_acts_on(name, args, target):
    """Cache reads and writes and rfactors insert stages and shift the ids later steps use; the walk
    over the steps alone must put each step on the stage (named as in the final state) that a replay
    of the steps before it says it acts on."""
    task = make_task(make_dag(name, *args), target)
    programs = _population(task, seed=11)[:40]
    inserts = 0
    for program in programs:
        steps = program.steps
        walk = _walk(steps, len(task.dag.tensors))
        final = program.state.stages
        assert walk.n_stages == len(final)
        inserts += sum(1 for s in steps if s.to_json()[0] in ("CHR", "CHW", "RF"))
        for i, step in enumerate(steps):
            sid = getattr(step, "stage_id", None)
            if sid is None or step.to_json()[0] in ("CHR", "CHW", "RF", "CI"):
                continue
            acting_on = State.replay(task.dag, steps[:i]).stages[sid].name
            on = [s for s, idx in walk.steps_on.items() if i in idx]
            assert acting_on in [final[s].name for s in on], (i, step.to_json(), acting_on)
        for s, target_stage in walk.attach.items():
            assert final[s].compute_at == "iter" and final[s].attach[0] == final[target_stage].name
    assert inserts > 0


def test_a_part_template_fails_on_a_number_outside_its_part():
    """Leave one of a part's numbers out of its slots: its features can no longer be made from the
    part's numbers, and evaluating says so (rather than keeping the representative's value)."""
    name, args, target = WINOGRAD_NHWC_F4
    task = make_task(make_dag(name, *args), target)
    program = _population(task, seed=3)[0]
    ex = FeatureExtractor(task)
    part = max(ex.parts(program).parts, key=lambda p: len(p.slots))
    assert len(part.slots) >= 2
    numbers = np.array([state_numbers(program, part.slots)])
    fine = FeatureTemplate(program.state, task, part=part)(numbers)
    assert np.array_equal(fine[0], _whole(program, task)[list(part.rows)])
    short = type(part)(part.key, part.stages, part.slots[1:], part.rows)
    with pytest.raises(KeyError):
        FeatureTemplate(program.state, task, part=short)(numbers[:, 1:])


def test_programs_with_one_layout_share_its_readers():
    """The readers of each stage are learnt once per layout (one replay), not once per program."""
    name, args, target = WINOGRAD_NHWC_F4
    task = make_task(make_dag(name, *args), target)
    programs = _population(task, seed=5)
    ex = FeatureExtractor(task)
    ex(programs)
    assert len(ex.layouts) == len({layout_key(p.steps) for p in programs}) < len(programs) / 10


@pytest.mark.parametrize("name,args,target", CASES, ids=IDS)
def test_programs_share_parts_only_with_programs_of_their_structure(name, args, target):
    """An extractor makes each structure's parts once (`structure_key`, a tuple of the steps with their
    open numbers left out) and hands them to every program of that structure. Each program's parts must
    be those made for it alone, and two programs share a key only where every step's JSON key (open
    numbers left out; an rfactor's split keeps its lengths) is the same."""
    task = make_task(make_dag(name, *args), target)
    programs = [Candidate(task.dag, p.steps, p.sketch) for p in _population(task, seed=13)]   # no parts kept
    ex = FeatureExtractor(task)
    n_initial = len(task.dag.tensors)
    json_keys: dict[tuple, set[str]] = {}
    for p in programs:
        alone = program_parts(p, n_initial, lambda _key, program: Readers.of(program.state))
        assert ex.parts(p) == alone, p.steps_json[:120]
        json_keys.setdefault(structure_key(p), set()).add(
            json.dumps([_step_key(p.steps, i) for i in range(len(p.steps))]))
    assert all(len(keys) == 1 for keys in json_keys.values())
    assert len(ex.structures) == len(json_keys) < len(programs)
