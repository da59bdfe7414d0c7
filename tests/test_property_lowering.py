"""Property test: random legal step sequences on matmul and conv2d lower to correct kernels."""
from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tensortune.schedule.stage import IllegalStep
from tensortune.schedule.state import State
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import check_state, examples

KINDS = ["split", "split", "reorder", "fuse", "annotate", "pragma", "cache_write", "compute_at", "inline",
         "rfactor"]


def _random_step(data, s: State) -> State:
    stages = [i for i, x in enumerate(s.stages) if not x.is_placeholder and x.compute_at != "inline"]
    sid = data.draw(st.sampled_from(stages))
    stage = s.stages[sid]
    n = len(stage.iters)
    kind = data.draw(st.sampled_from(KINDS))
    if kind == "split":
        i = data.draw(st.integers(0, n - 1))
        ext = stage.iters[i].extent
        k = data.draw(st.integers(1, 2))
        lengths = [data.draw(st.integers(1, max(1, min(ext, 8)))) for _ in range(k)]
        return s.split(sid, i, lengths)
    if kind == "reorder":
        return s.reorder(sid, data.draw(st.permutations(range(n))))
    if kind == "fuse":
        i = data.draw(st.integers(0, n - 1))
        j = data.draw(st.integers(i, min(n - 1, i + 2)))
        return s.fuse(sid, list(range(i, j + 1)))
    if kind == "annotate":
        i = data.draw(st.integers(0, n - 1))
        ann = data.draw(st.sampled_from(["parallel", "vectorize", "unroll"]))
        if ann == "unroll" and stage.iters[i].extent > 16:
            raise IllegalStep("keep unrolled loops small in tests")
        return s.annotate(sid, i, ann)
    if kind == "pragma":
        return s.pragma(sid, data.draw(st.integers(0, n - 1)),
                        f"auto_unroll_max_step${data.draw(st.sampled_from([0, 16, 64]))}")
    if kind == "cache_write":
        if len(s.steps) > 0:
            raise IllegalStep("cache_write first")
        return s.cache_write(sid, "local")
    if kind == "compute_at":
        consumers = s.consumers(sid)
        if not consumers:
            raise IllegalStep("no consumer")
        c = data.draw(st.sampled_from(consumers))
        return s.compute_at(sid, c.name, data.draw(st.integers(0, len(c.iters) - 1)))
    if kind == "inline":
        return s.compute_inline(sid)
    red = [i for i, it in enumerate(stage.iters) if it.kind == "reduce"]
    if not red:
        raise IllegalStep("no reduction")
    return s.rfactor(sid, data.draw(st.sampled_from(red)), data.draw(st.integers(0, len(stage.op.axes))))


def _random_state(data, dag) -> State:
    s = State(dag)
    for _ in range(data.draw(st.integers(0, 8))):
        try:
            s = _random_step(data, s)
        except IllegalStep:
            pass
    return s


SETTINGS = settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.data(), st.integers(1, 24), st.integers(1, 40), st.integers(1, 20))
def test_random_matmul_schedules_are_correct(data, n, m, k):
    state = _random_state(data, make_dag("matmul", n, m, k))
    assume(state.steps)                    # the naive loop nest is tested elsewhere
    check_state(state)


@SETTINGS
@given(st.data(), st.integers(4, 9), st.integers(1, 4), st.integers(1, 6), st.sampled_from([1, 3]),
       st.sampled_from([1, 2]))
def test_random_conv2d_schedules_are_correct(data, hw, ci, co, kernel, stride):
    dag = make_dag("conv2d_relu", 1, hw, hw, ci, co, kernel, kernel, stride, kernel // 2, True)
    state = _random_state(data, dag)
    assume(state.steps)
    check_state(state)
