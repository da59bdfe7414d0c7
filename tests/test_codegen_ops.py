"""Every op of the library builds and matches the NumPy reference: naive and non-trivially scheduled."""
from __future__ import annotations

import pytest

from tensortune.schedule.state import State
from tests.conftest import check_state
from tests.schedules import tiled_schedule


def test_naive_schedule(small_workload):
    check_state(State(small_workload))


@pytest.mark.parametrize("variant", [
    dict(),
    dict(tile=3, vec=5),                     # imperfect splits everywhere
    dict(parallel=False, vectorize=False),
    dict(cache=False, attach_pad=False, rfactor=False),
])
def test_tiled_schedule(small_workload, variant):
    state = tiled_schedule(small_workload, **variant)
    assert len(state.steps) > 0
    check_state(state, seed=1)
