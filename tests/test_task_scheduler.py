"""The task scheduler follows Ansor's gradient formula, handles dead tasks and its objectives."""
from __future__ import annotations

import math

import pytest

from codegen.target import make_task
from search.task_scheduler import (INF_COST, TaskScheduler, geomean_speedup, latency_requirements,
                                   similarity_tag)
from tasks.workload_registry import make_dag


@pytest.fixture
def tasks():
    out = [make_task(make_dag("matmul", 64, 64, 64), weight=2), make_task(make_dag("matmul", 128, 64, 64)),
           make_task(make_dag("softmax", 8, 64), weight=1)]
    return out


def _feed(s: TaskScheduler, i: int, costs: list[float]) -> None:
    for c in costs:
        s.record(i, [c])


def test_gradient_follows_the_formula(tasks):
    s = TaskScheduler(tasks, strategy="gradient", eps_greedy=0.0)
    _feed(s, 0, [10e-6, 8e-6, 6e-6, 5e-6])          # still improving
    _feed(s, 1, [40e-6, 40e-6, 40e-6, 40e-6])       # stalled, but similar to task 0 and slower per FLOP
    _feed(s, 2, [3e-6, 3e-6, 3e-6, 3e-6])           # stalled, cheap
    for i in range(3):
        costs = s.best_costs
        r = s.task_rounds[i]
        chain = s.weights[i]                        # d(weighted sum)/d g_i
        backward = (s.history[i][r - 1] - s.history[i][r - 1 - 3]) / 3
        g1 = costs[i] - costs[i] / r
        group = [j for j in range(3) if similarity_tag(tasks[j]) == similarity_tag(tasks[i])]
        g2 = 2 * tasks[i].flops / max(tasks[j].flops / costs[j] for j in group) if len(group) > 1 else 2e30
        expect = chain * (0.2 * backward + 0.8 * (min(g1, g2) - costs[i]))
        assert s.gradient(i) == pytest.approx(expect, rel=1e-3)
    grads = [s.gradient(i) for i in range(3)]
    assert s.next_task() == min(range(3), key=grads.__getitem__)
    assert similarity_tag(tasks[0]) == similarity_tag(tasks[1]) != similarity_tag(tasks[2])


def test_round_robin_and_dead_tasks(tasks):
    s = TaskScheduler(tasks, strategy="round-robin")
    assert s.warmup_order() == [0, 1, 2]
    s.record(0, [1e-5])
    s.record(1, [math.inf])                       # nothing valid during warm-up
    s.record(2, [1e-5])
    s.after_warmup()
    assert s.dead == {1}
    assert [s.next_task() for _ in range(4)] == [0, 2, 0, 2]
    s.record(0, [], exhausted=True)
    assert s.next_task() == 2 and s.dead == {0, 1}


def test_early_stopping_per_task(tasks):
    s = TaskScheduler(tasks, early_stopping_task=10)
    s.record(0, [1e-5] * 8)
    for _ in range(2):
        s.record(0, [2e-5] * 8)                    # no improvement for 16 trials
    assert 0 in s.dead


def test_objectives(tasks):
    nets = {"a": {0: 2.0, 2: 1.0}, "b": {1: 1.0}}
    f2 = latency_requirements(nets, {"a": 1.0, "b": 0.0})
    assert f2([0.1, 0.5, 0.1]) == pytest.approx(1.0 + 0.5)           # a meets its 1 s requirement
    f3 = geomean_speedup(nets, {"a": 0.6, "b": 1.0})
    assert f3([0.1, 0.5, 0.1]) == pytest.approx(-math.sqrt(2.0 * 2.0))
    s = TaskScheduler(tasks, objective=f2, eps_greedy=0.0)
    assert s.score() >= INF_COST


def test_bad_strategy_is_named(tasks):
    with pytest.raises(ValueError, match="unknown strategy 'greedy'"):
        TaskScheduler(tasks, strategy="greedy")
