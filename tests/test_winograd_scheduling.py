"""Alternative forms of one group (a conv and its Winograd forms) are one latency term to the task
scheduler and the tuning loops: the minimum over the forms. The gradient strategy spends rounds on a
slower form while it is projected to overtake the faster one, and the estimate is the faster form's."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tensortune.codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
from tensortune.codegen.network_runtime import build_network
from tensortune.codegen.target import make_task
from tensortune.codegen.timing import TimingConfig
from tensortune.flows.tuning import NetworkTuneResult, network_tasks, tune_network
from tensortune.search.sketch_policy import SearchParams
from tensortune.search.task_scheduler import INF_COST, TaskScheduler, effective_costs
from tensortune.storage.records import RecordStore
from tensortune.tasks.graph import GraphBuilder
from tensortune.tasks.workload_registry import make_dag


@pytest.fixture(scope="module")
def tasks():
    """0: a direct conv, 1: its Winograd form (both weight 2), 2: an unrelated matmul."""
    return [make_task(make_dag("conv2d_relu", 1, 14, 14, 16, 16, 3, 3, 1, 1), weight=2),
            make_task(make_dag("conv2d_winograd", 1, 14, 14, 16, 16, 1, 4, True), weight=2),
            make_task(make_dag("matmul", 64, 64, 64))]


def test_effective_costs_keep_the_fastest_form_once():
    assert effective_costs([3.0, 2.0, 5.0], [(0, 1)]) == [2.0, 0.0, 5.0]
    assert effective_costs([1.0, 2.0, 5.0], [(0, 1)]) == [1.0, 0.0, 5.0]
    assert effective_costs([INF_COST, 2.0, 5.0], [(0, 1)]) == [2.0, 0.0, 5.0]
    assert effective_costs([1.0, 2.0], []) == [1.0, 2.0]


def test_score_counts_a_group_once_at_its_fastest_form(tasks):
    s = TaskScheduler(tasks, form_sets=[(0, 1)], eps_greedy=0.0)
    s.record(0, [40e-6])
    s.record(1, [30e-6])
    s.record(2, [10e-6])
    assert s.score() == pytest.approx(2 * 30e-6 + 10e-6)
    plain = TaskScheduler(tasks, eps_greedy=0.0)
    for i, c in enumerate((40e-6, 30e-6, 10e-6)):
        plain.record(i, [c])
    assert plain.score() == pytest.approx(2 * 40e-6 + 2 * 30e-6 + 10e-6)   # without sets: double counted


def test_gradient_of_a_form_is_the_objective_change_its_projected_step_makes(tasks):
    s = TaskScheduler(tasks, form_sets=[(0, 1)], eps_greedy=0.0)
    for c in (50e-6, 45e-6, 44e-6, 44e-6):       # direct: stalled at 44 us
        s.record(0, [c])
    for c in (90e-6, 70e-6, 60e-6, 50e-6):       # Winograd: slower, still improving fast
        s.record(1, [c])
    for _ in range(4):
        s.record(2, [10e-6])
    # Winograd: backward (50 - 90) / 3, g1 = 50 - 50/4 = 37.5 (no similar task: no g2);
    # step = 0.2 * (-13.33) + 0.8 * (37.5 - 50) = -12.67 -> projected 37.33 us, below the direct's 44:
    # the group's term drops by weight 2 * (44 - 37.33) us
    step = 0.2 * (50 - 90) / 3 + 0.8 * (37.5 - 50)
    assert s.gradient(1) == pytest.approx(-2 * (44 - (50 + step)) * 1e-6, rel=1e-6)
    # the direct form is the group's term: its projected step counts in full (weight 2)
    step0 = 0.2 * (44 - 50) / 3 + 0.8 * (33 - 44)
    assert s.gradient(0) == pytest.approx(2 * step0 * 1e-6, rel=1e-6)
    # a slower form projected to stay slower gains nothing
    t = TaskScheduler(tasks, form_sets=[(0, 1)], eps_greedy=0.0)
    for c in (20e-6,) * 4:
        t.record(0, [c])
    for c in (90e-6,) * 4:
        t.record(1, [c])
    t.record(2, [10e-6])
    assert t.gradient(1) == 0.0 and t.gradient(0) < 0.0


def test_gradient_strategy_spends_rounds_on_both_forms(tasks):
    """Simulated tuning: each round a task closes 30% of the gap to its floor (direct from 80 to 40 us,
    Winograd from 100 to 20 us: slower at first, faster in the end). The gradient scheduler must tune
    both, and the Winograd form most once it is the group's faster form. (A form that starts far
    slower, 160 us, is judged hopeless after two rounds and left to eps-greedy: Ansor's optimistic
    projection c - c/r is all the scheduler knows of a task's future.)"""
    s = TaskScheduler(tasks, form_sets=[(0, 1)], eps_greedy=0.0, seed=1)
    cur = {0: 80e-6, 1: 100e-6, 2: 20e-6}
    floor = {0: 40e-6, 1: 20e-6, 2: 10e-6}
    for _ in range(40):
        i = s.choose()
        assert i is not None
        cur[i] = floor[i] + (cur[i] - floor[i]) * 0.7
        s.record(i, [cur[i]])
    rounds = s.task_rounds
    assert rounds[0] >= 2 and rounds[1] >= 2, rounds
    assert rounds[1] > rounds[0], rounds
    assert s.score() == pytest.approx(2 * min(s.best_costs[0], s.best_costs[1]) + s.best_costs[2])


def test_a_form_without_a_valid_program_does_not_win_the_group():
    res = NetworkTuneResult([make_task(make_dag("matmul", 8, 8, 8), weight=3)] * 2, [INF_COST, 2e-6], [None, "x"],
                            0, form_sets=[(0, 1)])
    assert res.estimated_latency == pytest.approx(3 * 2e-6)
    res.best_costs = [INF_COST, INF_COST]
    assert res.estimated_latency == math.inf


def _conv_net():
    rng = np.random.default_rng(0)
    g = GraphBuilder("convnet")
    x = g.input("x", (1, 8, 10, 10))
    y = g.add("conv2d", [x, g.constant((rng.standard_normal((8, 8, 3, 3)) / 8).astype(np.float32)),
                         g.constant(rng.standard_normal(8).astype(np.float32))], name="conv", pads=(1, 1, 1, 1))
    return g.build([g.add("relu", [y], name="relu")])


def test_tune_network_with_winograd_forms_builds_the_faster_one(tmp_path):
    """End to end on a one-conv network: both forms are tuned, the estimate is the faster form's, and
    the network built from the records runs that form and matches the reference."""
    graph = _conv_net()
    measurer = ProgramMeasurer(LocalBuilder(), LocalRunner(config=TimingConfig(min_repeat_ms=5, repeat=2)))
    try:
        res = tune_network(graph, 12, measurer=measurer, records=RecordStore(str(tmp_path / "r")), seed=0,
                           winograd_tiles=(2,), params=SearchParams(population=32, sample_init_population=32,
                                                                    num_iters=1, num_measures_per_round=3))
    finally:
        measurer.close()
    net, tasks = network_tasks(graph, winograd_tiles=(2,))
    # tasks: the input's NHWC transpose, the conv's direct and F(2x2, 3x3) forms, the transpose back
    assert res.form_sets == [(1, 2)] and [t.workload_key for t in res.tasks] == [t.workload_key for t in tasks]
    assert max(res.best_costs) < INF_COST, "the warm-up finds a valid program of both forms"
    c = res.best_costs
    assert res.estimated_latency == pytest.approx(c[0] + min(c[1], c[2]) + c[3])
    best = {t.workload_key: s for t, s in zip(tasks, res.best_steps) if s}
    costs = {t.workload_key: c for t, c in zip(tasks, res.best_costs)}
    compiled = build_network(net, best, costs=costs)
    faster = tasks[1 + int(np.argmin(c[1:3]))].workload_key
    assert [k.workload_key for k in compiled.kernels] == [tasks[0].workload_key, faster, tasks[3].workload_key]
    assert compiled.check().passed


def test_flow_estimate_counts_the_fastest_form_once():
    from tensortune.flows.artifacts import estimate
    assert estimate([2, 2, 1], [4e-3, 3e-3, 1e-3], [(0, 1)]) == pytest.approx(2 * 3e-3 + 1e-3)
    assert estimate([2, 2, 1], [4e-3, math.inf, 1e-3], [(0, 1)]) == pytest.approx(2 * 4e-3 + 1e-3)
    assert math.isnan(estimate([2, 2, 1], [math.inf, math.nan, 1e-3], [(0, 1)]))
    assert estimate([2, 2, 1], [4e-3, 3e-3, 1e-3]) == pytest.approx(2 * 7e-3 + 1e-3)
