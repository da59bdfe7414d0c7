"""`has_nested_parallel` (sampling and every structural mutation ask it) finds the stages computed at
each loop once per state; it answers as the definition does: a root stage whose loops, and the loops of
the stages computed inside them, hold two or more parallel annotations."""
from __future__ import annotations

import random

from tensortune.codegen.target import make_task
from tensortune.schedule.stage import IllegalStep
from tensortune.schedule.state import State
from tensortune.search import utils
from tensortune.search.mutation import mutate_compute_location, mutate_parallel
from tensortune.search.sketch_policy import SketchPolicy
from tensortune.tasks.workload_registry import make_dag


def _by_definition(state: State) -> bool:
    def parallel(sid: int) -> int:
        st = state.stages[sid]
        if st.compute_at == "inline":
            return 0
        return sum((it.annotation == "parallel") + sum(parallel(a) for a in utils.attached_stages(state, sid, i))
                   for i, it in enumerate(st.iters))
    return any(parallel(i) >= 2 for i, s in enumerate(state.stages) if s.compute_at == "root" and not s.is_placeholder)


def test_nested_parallel_as_defined_on_sampled_and_mutated_programs():
    rng = random.Random(0)
    seen = {True: 0, False: 0}
    for name, args in (("conv2d_relu", (1, 14, 14, 16, 16, 3, 3, 1, 1)), ("softmax", (8, 64)),
                       ("matmul_bias_relu", (64, 64, 64))):
        task = make_task(make_dag(name, *args), "llvm -num-threads=4")
        for c in SketchPolicy(task, seed=2).sample(40):
            states = [c.state]
            for _ in range(3):
                # mutate without the check, and parallelise a stage computed inside a parallel loop
                child = mutate_parallel(c, rng) or mutate_compute_location(c, rng)
                if child is not None:
                    states.append(child.state)
            for st in states:
                for sid, stage in enumerate(st.stages):
                    if stage.compute_at == "iter" and stage.iters and stage.iters[0].annotation == "none" \
                            and stage.iters[0].kind == "spatial":
                        try:
                            states.append(st.parallel(sid, 0))
                        except IllegalStep:        # not a legal annotation there: nothing to compare
                            pass
            for st in states:
                want = _by_definition(st)
                assert utils.has_nested_parallel(st) == want
                seen[want] += 1
    assert seen[True] >= 100 and seen[False] >= 100, seen
