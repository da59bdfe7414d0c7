"""Property test: what the search produces — sampled, mutated, crossed over — is a correct program."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codegen.target import make_task
from search.mutation import crossover, mutate_auto_unroll, mutate_compute_location, mutate_parallel, mutate_tile_size
from search.sketch_policy import SearchParams, SketchPolicy
from search.state import SplitStep
from tests.conftest import SMALL_WORKLOADS, check_state, small_dag

_POLICIES: dict[str, SketchPolicy] = {}


def _policy(key: str) -> SketchPolicy:
    if key not in _POLICIES:
        _POLICIES[key] = SketchPolicy(make_task(small_dag(key)), params=SearchParams(), seed=0)
    return _POLICIES[key]


@pytest.mark.parametrize("key", sorted(SMALL_WORKLOADS))
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow,
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


@pytest.mark.parametrize("key", ["matmul_bias_relu", "conv2d_relu", "softmax"])
def test_crossover_takes_each_stage_from_one_parent(key):
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
        splits = lambda c: {(st.stage_id, st.iter_id): st.lengths for st in c.steps  # noqa: E731
                            if isinstance(st, SplitStep)}
        ca, cb, cc = splits(a), splits(b), splits(child)
        assert all(cc[k] in (ca.get(k), cb.get(k)) for k in cc)   # every tile from one of the parents
        check_state(child.state)
