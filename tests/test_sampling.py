"""A round's initial population drawn on helper processes (`search/sampling.py`) is exactly the one
drawn in this process alone, and a helper that dies costs no program."""
from __future__ import annotations

import os
import pickle
import signal
import time

import pytest

from tensortune.codegen.target import make_task
from tensortune.schedule.state import State
from tensortune.search.cost_model import XGBModel
from tensortune.search.feature_pool import Featurizer
from tensortune.search.sampling import MIN_SHARED
from tensortune.search.sketch_policy import SketchPolicy
from tensortune.tasks.workload_registry import make_dag

TARGETS = {"llvm": "llvm -mcpu=x86-64 -num-threads=2", "cuda": "cuda -arch=sm_90"}


def _task(target: str):
    return make_task(make_dag("conv2d_relu", 1, 14, 14, 16, 16, 3, 3, 1, 1), TARGETS[target])


def _steps(cands) -> list[str]:
    return [c.steps_json for c in cands]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_helpers_draw_the_programs_this_process_draws(target):
    task = _task(target)
    featurizer = Featurizer(processes=1)
    try:
        shared = SketchPolicy(task, XGBModel(features=featurizer), seed=5)
        alone = SketchPolicy(task, seed=5)               # a random model: no helpers
        assert alone.model.helpers is None
        for n in (MIN_SHARED * 2, 64, MIN_SHARED * 2):   # a small draw stays here, the others are dealt out
            drawn = shared.sample(n)
            assert _steps(drawn) == _steps(alone.sample(n))
            # most random CUDA programs break a thread limit: fewer than asked is how that space is
            assert len(drawn) == n if target == "llvm" else 0 < len(drawn) <= n
        assert featurizer.helpers.pids(), "no share went to the helper"
        from_helper = [c for c in drawn if c._state is None]
        assert from_helper, "every program was drawn here"
        # what came back replays to the program it names (a CUDA one within the target's limits)
        for c in from_helper[:20]:
            assert isinstance(c.state, State) and c.state.steps == c.steps
    finally:
        featurizer.close()


def test_a_killed_helper_costs_no_program():
    task = _task("llvm")
    featurizer = Featurizer(processes=1)
    try:
        shared = SketchPolicy(task, XGBModel(features=featurizer), seed=8)
        alone = SketchPolicy(task, seed=8)
        assert _steps(shared.sample(MIN_SHARED * 2)) == _steps(alone.sample(MIN_SHARED * 2))
        (pid,) = featurizer.helpers.pids()
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        assert _steps(shared.sample(MIN_SHARED * 2)) == _steps(alone.sample(MIN_SHARED * 2))   # drawn here
        assert _steps(shared.sample(MIN_SHARED * 2)) == _steps(alone.sample(MIN_SHARED * 2))   # a new helper
        assert featurizer.helpers.pids() and pid not in featurizer.helpers.pids()
    finally:
        featurizer.close()


def test_steps_pickle_as_their_fields():
    """Steps cross to the helpers and back pickled by Step.__reduce__: every kind of step a sampled
    program holds comes back equal, and as the same class."""
    task = _task("llvm")
    programs = SketchPolicy(task, seed=2).sample(64)
    steps = [st for c in programs for st in c.steps]
    assert len({type(st) for st in steps}) >= 5
    back = pickle.loads(pickle.dumps(steps))
    assert back == steps and [type(b) for b in back] == [type(s) for s in steps]
