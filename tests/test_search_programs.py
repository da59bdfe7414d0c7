"""Property test: what the search produces — sampled, mutated, crossed over — is a correct program."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensortune.codegen.lower import lower
from tensortune.codegen.target import make_task
from tensortune.schedule.state import State
from tensortune.schedule.steps import FuseStep, SplitStep
from tensortune.search.candidate import Candidate
from tensortune.search.mutation import (
    crossover,
    mutate_auto_unroll,
    mutate_compute_location,
    mutate_parallel,
    mutate_tile_size,
)
from tensortune.search.sketch_policy import SearchParams, SketchPolicy
from tensortune.tasks import network_ops, te
from tensortune.tasks.compute_dag import ComputeDAG
from tests.conftest import SMALL_WORKLOADS, check_state, examples, small_dag

_POLICIES: dict[str, SketchPolicy] = {}


def _policy(key: str) -> SketchPolicy:
    if key not in _POLICIES:
        _POLICIES[key] = SketchPolicy(make_task(small_dag(key)), params=SearchParams(), seed=0)
    return _POLICIES[key]


@pytest.mark.parametrize("key", sorted(SMALL_WORKLOADS))
@settings(max_examples=examples(3), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 30))
def test_sampled_mutated_and_crossed_programs_are_correct(key, seed):
    pol = _policy(key)
    pol.rng = random.Random(seed)
    rng = random.Random(seed)
    progs = pol.sample(4)
    assert progs, f"no program could be sampled for {key}"
    kinds = {"tile size": lambda c: mutate_tile_size(c, rng, 64), "auto-unroll": lambda c: mutate_auto_unroll(c, rng),
             "compute location": lambda c: mutate_compute_location(c, rng),
             "parallel": lambda c: mutate_parallel(c, rng)}
    children = {}                                # one child of every kind the program allows
    for c in progs:
        for kind, mutate in kinds.items():
            if kind not in children and (child := mutate(c)) is not None:
                children[kind] = child
    pairs = [(a, b) for i, a in enumerate(progs) for b in progs[i + 1:] if a.sketch == b.sketch]
    for a, b in pairs * 4:
        if (child := crossover(a, b, len(pol.sketches[a.sketch].state.steps), rng)) is not None:
            children["crossover"] = child
            break
    if any(isinstance(st, SplitStep) and st.extent > 1 for c in progs for st in c.steps):
        assert "tile size" in children, f"{key}: no tile-size mutation of a tiled program"
    for c in progs + list(children.values()):
        check_state(c.state, seed=seed % 1000)


@pytest.mark.parametrize("key", ["conv2d_relu", "matmul_bias_relu"])
@pytest.mark.parametrize("mutate", [mutate_compute_location, mutate_parallel])
def test_a_child_replayed_from_its_parents_prefix_is_the_program_its_steps_make(key, mutate):
    """Compute-location and parallel mutations apply the changed steps and those after them to the
    parent's state before the change, not a replay from the DAG: the child's state must be the one its
    steps replay to (the same lowered loop nest), whatever the parent."""
    pol = _policy(key)
    pol.rng = random.Random(3)
    rng = random.Random(3)
    pairs = [(c, child) for c in pol.sample(40) if (child := mutate(c, rng)) is not None]
    assert len(pairs) >= 3, f"{key}: too few mutations to compare"
    assert any(child.steps != parent.steps for parent, child in pairs), f"{key}: no child changed"
    for _, child in pairs:
        assert lower(child.state).text() == lower(State.replay(child.dag, child.steps)).text()


def _steps_by_stage(c) -> dict[int, list]:
    """A program's steps grouped by the stage they transform, each group in program order."""
    out: dict[int, list] = {}
    for step in c.steps:
        out.setdefault(step.stage_id, []).append(step)
    return out


@pytest.mark.parametrize("key", ["matmul_bias_relu", "conv2d_relu", "softmax"])
def test_crossover_child_takes_each_stage_whole_from_one_parent(key):
    """Node-based crossover (Ansor 5.1): each stage of the child is one parent's stage, all of it (its
    tile sizes, compute location, fusion, parallel, vectorize and unroll steps, in that parent's
    order), and the child mixes the parents: stages where they differ come from both."""
    pol = _policy(key)
    pol.rng = random.Random(1)
    rng = random.Random(1)
    progs = pol.sample(40)
    n_sketch = {i: len(sk.state.steps) for i, sk in enumerate(pol.sketches)}
    made = []
    for a in progs:
        for b in progs:
            if a is not b and a.sketch == b.sketch and a.key != b.key and len(made) < 3:
                child = crossover(a, b, n_sketch[a.sketch], rng)
                if child is not None and child.key not in (a.key, b.key):
                    made.append((a, b, child))
    assert made, f"{key}: crossover never produced a new program"
    for a, b, child in made:
        sa, sb, sc = _steps_by_stage(a), _steps_by_stage(b), _steps_by_stage(child)
        assert set(sc) == set(sa) | set(sb)
        for stage, steps in sc.items():
            assert steps in (sa.get(stage), sb.get(stage)), \
                f"{key}: stage {stage} of the child is neither parent's:\n{steps}\n{sa.get(stage)}\n{sb.get(stage)}"
        differ = [s for s in sc if sa.get(s) != sb.get(s)]
        assert any(sc[s] == sa.get(s) for s in differ) and any(sc[s] == sb.get(s) for s in differ)
        check_state(child.state)


def test_crossover_drops_a_child_that_computes_a_stage_inside_only_one_of_its_readers():
    """softmax: parent A computes the max and the exp-sum inside the normalisation's row loop, parent B
    keeps both at root. The child taking the max from A and the exp-sum from B reads the max outside
    the loop that computes it: it cannot be lowered, so crossover must not propose it."""
    from tensortune.codegen.lower import lower
    from tensortune.schedule.state import State
    from tensortune.search import utils
    from tensortune.search.candidate import Candidate
    dag = small_dag("softmax")
    a = State.from_json(dag, '[["CA",3,4,0],["CI",2],["CA",1,4,0],["AN",4,0,3],["PR",1,0,"auto_unroll_max_step$64"],'
                             '["PR",3,0,"auto_unroll_max_step$0"]]')
    b = State.from_json(dag, '[["CR",4],["CR",3],["CI",2],["AN",1,0,3],["AN",3,0,3],["FU",4,[0,1]],["AN",4,0,3],'
                             '["PR",1,0,"auto_unroll_max_step$512"],["PR",3,0,"auto_unroll_max_step$64"]]')
    bad = State.from_json(dag, '[["CI",2],["CA",1,4,0],["CR",3],["AN",4,0,3],["AN",3,0,3],'
                               '["PR",1,0,"auto_unroll_max_step$64"],["PR",3,0,"auto_unroll_max_step$64"]]')
    assert utils.stage_read_outside_its_loop(bad) == "T_softmax_maxelem"
    assert utils.stage_read_outside_its_loop(a) is None and utils.stage_read_outside_its_loop(b) is None
    children = [crossover(Candidate.of(a, 0), Candidate.of(b, 0), 0, random.Random(seed)) for seed in range(40)]
    children = [c for c in children if c is not None]
    assert children, "crossover of these parents never produced a child"
    for c in children:
        assert c.key != Candidate.of(bad, 0).key
        lower(c.state, target_kind="cpu")        # raises LoweringError for a misplaced stage


@pytest.mark.parametrize("key", ["matmul", "conv2d_relu", "softmax"])
def test_sampling_mutation_and_features_leave_no_reference_cycles(key):
    """A population's states must die by reference counting. The collector is paused during a round
    (search/memory.py), so a cycle through a state (a recursive closure holding it, say) kept the
    whole round's states alive until the collector traced them all: 0.7 s a round on depthwise conv."""
    import gc

    from tensortune.schedule.stage import Iterator, Stage
    from tensortune.schedule.state import State
    from tensortune.search.feature_pool import Featurizer
    from tensortune.tasks.te import Tensor
    pol = SketchPolicy(make_task(small_dag(key)), params=SearchParams(), seed=0)
    featurize = Featurizer(processes=0)
    rng = random.Random(0)
    gc.collect()
    gc.disable()
    try:
        progs = pol.sample(32)
        mutations = (lambda c: mutate_tile_size(c, rng, 64), lambda c: mutate_compute_location(c, rng),
                     lambda c: mutate_parallel(c, rng))
        children = [mutate(c) for c in progs for mutate in mutations]
        children += [crossover(a, b, len(pol.sketches[a.sketch].state.steps), rng)
                     for a, b in zip(progs, progs[1:]) if a.sketch == b.sketch]
        states = [c.state for c in progs + children if c is not None]
        assert len(featurize(pol.task, states)) == len(states)
        del progs, children, states
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        leaked = [type(o).__name__ for o in gc.garbage if isinstance(o, (State, Stage, Iterator, Tensor))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not leaked, f"{len(leaked)} search objects were only freed by the cyclic collector: {leaked[:5]}"


def test_a_task_without_flops_keeps_its_fastest_program_as_its_best():
    """A transpose has no FLOPs: its programs rank by time, so resuming from stored records (or
    measuring) gives it a best, and the network runs that program instead of the default schedule."""
    from tensortune.flows.tuning import network_tasks
    _, tasks = network_tasks("resnet-18", image_size=32)
    task = next(t for t in tasks if t.flops == 0)
    policy = SketchPolicy(task, seed=0)
    slow, fast = policy.sample(2)
    policy.preload([slow], [float("inf")])              # a failed measurement is never a best
    assert policy.best is None
    policy.preload([slow, fast], [2e-5, 1e-5])
    assert policy.best is not None and policy.best[1] is fast and policy.best_cost == 1e-5


def test_a_parallel_mutation_never_fuses_a_loop_a_later_step_annotates():
    """TVM's MutateParallel checks the annotations of the state before the fuse, where the vectorize that
    follows it is not applied yet: a transpose's parallel loop, fused over its vectorised innermost loop,
    became one vectorised loop over the whole tensor (150 528 lanes at 224², a build that timed out).
    Every child keeps its vectorised loop apart from the parallel one, and computes the transpose."""
    data = te.placeholder((1, 3, 8, 8), name="data")
    dag = ComputeDAG([data, network_ops.transpose(data, (0, 2, 3, 1))])
    parent = Candidate.of(State(dag).fuse(1, [0, 1]).parallel(1, 0).vectorize(1, 2))
    children = []
    for seed in range(40):
        child = mutate_parallel(parent, random.Random(seed))
        if child is not None:
            children.append(child)
    fused = {len(next(s for s in c.steps if isinstance(s, FuseStep)).fused_ids) for c in children}
    assert fused == {1, 3}, f"the children fused {sorted(fused)} loops"        # 2 is the parent; 4 takes ax3
    for child in children:
        loops = child.state.stages[1].iters
        assert loops[0].annotation == "parallel" and loops[-1].annotation == "vectorize" and loops[-1].extent == 3
        check_state(child.state)
