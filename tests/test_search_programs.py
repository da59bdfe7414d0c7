"""Property test: what the search produces — sampled, mutated, crossed over — is a correct program."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codegen.target import make_task
from search.mutation import crossover, mutate_auto_unroll, mutate_compute_location, mutate_parallel, mutate_tile_size
from search.sketch_policy import SearchParams, SketchPolicy
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
    progs = pol.sample(3)
    assert progs, f"no program could be sampled for {key}"
    children = []
    for c in progs:
        for mutate in (lambda c: mutate_tile_size(c, rng, 64), lambda c: mutate_auto_unroll(c, rng),
                       lambda c: mutate_compute_location(c, rng), lambda c: mutate_parallel(c, rng)):
            child = mutate(c)
            if child is not None:
                children.append(child)
    same = [c for c in progs if c.sketch == progs[0].sketch]
    if len(same) >= 2:
        for _ in range(4):
            child = crossover(same[0], same[1], len(pol.sketches[same[0].sketch].state.steps), rng)
            if child is not None:
                children.append(child)
                break
    for c in progs + rng.sample(children, min(3, len(children))):
        check_state(c.state, seed=seed % 1000)
