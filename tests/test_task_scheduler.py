"""The task scheduler follows Ansor's gradient formula, handles dead tasks and its objectives."""
from __future__ import annotations

import math

import pytest

from tensortune.codegen.target import make_task
from tensortune.search.task_scheduler import TaskScheduler, geomean_speedup, latency_requirements, similarity_tag
from tensortune.tasks.workload_registry import make_dag


@pytest.fixture
def tasks():
    out = [make_task(make_dag("matmul", 64, 64, 64), weight=2), make_task(make_dag("matmul", 128, 64, 64)),
           make_task(make_dag("softmax", 8, 64), weight=1)]
    return out


def _feed(s: TaskScheduler, i: int, costs: list[float]) -> None:
    for c in costs:
        s.record(i, [c])


def test_gradient_follows_the_formula(tasks):
    # Ansor §6 / TVM: dg = chain * (alpha * backward + (1 - alpha) * (min(g1, g2) - cost)), with
    # backward = (h[r-1] - h[r-1-w]) / w, g1 = cost - cost / r, g2 = beta * flops / (best GFLOP/s of the
    # similar tasks). Worked by hand for this history (microseconds; alpha 0.2, beta 2, window 3):
    s = TaskScheduler(tasks, strategy="gradient", eps_greedy=0.0)
    _feed(s, 0, [10e-6, 8e-6, 6e-6, 5e-6])   # 524288 FLOP at 5 us: 1.048576e11 FLOP/s, the group's best
    _feed(s, 1, [40e-6] * 4)                 # 1048576 FLOP, similar to task 0, stalled
    _feed(s, 2, [3e-6] * 4)                  # softmax: no similar task, stalled
    # task 0: backward (5-10)/3, g1 = 5 - 5/4 = 3.75, g2 = 2*524288/1.048576e11 = 10 -> 3.75; weight 2
    assert s.gradient(0) == pytest.approx(2 * (0.2 * (-5 / 3) + 0.8 * (3.75 - 5)) * 1e-6, rel=1e-3)
    # task 1: backward 0, g1 = 40 - 10 = 30, g2 = 2*1048576/1.048576e11 = 20 -> 20; weight 1
    assert s.gradient(1) == pytest.approx(0.8 * (20 - 40) * 1e-6, rel=1e-3)
    # task 2: backward 0, g1 = 3 - 0.75 = 2.25, no g2
    assert s.gradient(2) == pytest.approx(0.8 * (2.25 - 3) * 1e-6, rel=1e-3)
    assert s.next_task() == 1 and s.decisions[-1][1].startswith("gradient")
    assert similarity_tag(tasks[0]) == similarity_tag(tasks[1]) != similarity_tag(tasks[2])


def test_eps_greedy_picks_live_tasks_at_random(tasks):
    s = TaskScheduler(tasks, eps_greedy=1.0, seed=3)
    for i in range(3):
        _feed(s, i, [1e-5])
    s.record(1, [], exhausted=True)
    picks = [s.next_task() for _ in range(200)]
    assert set(picks) == {0, 2}
    assert all(why == "eps-greedy" for _, why in s.decisions[-200:])
    assert 60 < picks.count(0) < 140


def test_a_user_objective_drives_the_choice(tasks):
    # Only task 2's latency counts: the chain factor of the others is zero, so task 2 gets the round
    # even though task 1 would gain far more under the weighted sum.
    s = TaskScheduler(tasks, objective=lambda costs: costs[2], eps_greedy=0.0)
    _feed(s, 0, [10e-6, 8e-6, 6e-6, 5e-6])
    _feed(s, 1, [40e-6] * 4)
    _feed(s, 2, [3e-6] * 4)
    assert s.gradient(0) == pytest.approx(0.0, abs=1e-15) and s.gradient(1) == pytest.approx(0.0, abs=1e-15)
    assert s.next_task() == 2


def test_a_task_far_slower_than_its_group_leaves_it(tasks):
    # (task 2 never ran, so it costs INF_COST: the gradients of the others must not drown in it)
    s = TaskScheduler(tasks, eps_greedy=0.0)
    _feed(s, 0, [5e-6] * 2)                   # 1.05e11 FLOP/s
    _feed(s, 1, [40e-6] * 8)                  # 2.6e10: below best / beta, and 8 > 5 + 2 rounds
    assert s.tags[1] != s.tags[0] and s.groups[s.tags[0]] == [0]
    # without the group its forward estimate is g1 alone: (40 - 40/8) - 40 = -5; backward is 0
    assert s.gradient(1) == pytest.approx(0.8 * -5 * 1e-6, rel=1e-3)


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


def test_choose_runs_the_warm_up_in_order_then_the_strategy(tasks):
    s = TaskScheduler(tasks, strategy="round-robin")
    chosen = []
    for cost in (1e-5, math.inf, 1e-5, 1e-5, 1e-5):
        i = s.choose()
        chosen.append(i)
        s.record(i, [cost])
    assert chosen == [0, 1, 2, 0, 2] and s.dead == {1}     # task 1 found nothing in its warm-up round
    assert [why for _, why in s.decisions] == ["round-robin"] * 2


def test_early_stopping_per_task(tasks):
    s = TaskScheduler(tasks, early_stopping_task=10)
    s.record(0, [1e-5] * 8)
    assert 0 not in s.dead
    s.record(0, [2e-5] * 8)                        # 8 trials without improvement: not yet (TVM counts
    assert 0 not in s.dead                         # rounds since the best x the batch size)
    s.record(0, [2e-5] * 8)                        # 16 > 10
    assert 0 in s.dead and 1 not in s.dead


def test_objectives(tasks):
    nets = {"a": {0: 2.0, 2: 1.0}, "b": {1: 1.0}}
    f2 = latency_requirements(nets, {"a": 1.0, "b": 0.0})
    assert f2([0.1, 0.5, 0.1]) == pytest.approx(1.0 + 0.5)           # a meets its 1 s requirement
    f3 = geomean_speedup(nets, {"a": 0.6, "b": 1.0})
    assert f3([0.1, 0.5, 0.1]) == pytest.approx(-math.sqrt(2.0 * 2.0))
    s = TaskScheduler(tasks, objective=f2, eps_greedy=0.0)
    for i, cost in enumerate([0.1, 0.5, 0.1]):
        s.record(i, [cost])
    assert s.score() == pytest.approx(1.5)                            # the scheduler scores with f2
    default = TaskScheduler(tasks)
    assert default.eps_greedy == 0.05                                 # the paper's defaults
    for i, cost in enumerate([0.1, 0.5, 0.1]):
        default.record(i, [cost])
    assert default.score() == pytest.approx(sum(t.weight * c for t, c in zip(tasks, [0.1, 0.5, 0.1])))


def test_bad_strategy_is_named(tasks):
    with pytest.raises(ValueError, match="unknown strategy 'greedy'"):
        TaskScheduler(tasks, strategy="greedy")


def test_a_task_without_a_valid_program_does_not_blind_the_gradient(tasks):
    s = TaskScheduler(tasks, eps_greedy=0.0)
    _feed(s, 0, [10e-6, 8e-6, 6e-6, 5e-6])
    _feed(s, 1, [40e-6] * 4)
    s.record(2, [math.inf])                      # no valid program: INF_COST, dead after warm-up
    s.after_warmup()
    assert s.dead == {2}
    assert s.gradient(0) == pytest.approx(2 * (0.2 * (-5 / 3) + 0.8 * (3.75 - 5)) * 1e-6, rel=1e-3)
    assert s.gradient(1) == pytest.approx(0.8 * (20 - 40) * 1e-6, rel=1e-3)
    assert s.next_task() == 1 and s.decisions[-1][1].startswith("gradient")


def test_similar_tasks_without_flops_leave_out_the_throughput_bound():
    """BERT's head transposes count no FLOPs and are similar to each other: the bound from the group's
    best FLOP/s (g2) must not divide by that zero; g1 alone is the forward estimate."""
    from tensortune.flows.tuning import network_tasks
    _, bert = network_tasks("bert-base", "llvm", num_layers=1, seq_len=16)
    moves = [t for t in bert if t.name == "transpose"][:2]
    assert len(moves) == 2 and moves[0].flops == moves[1].flops == 0
    assert similarity_tag(moves[0]) == similarity_tag(moves[1])
    s = TaskScheduler(moves, eps_greedy=0.0)
    _feed(s, 0, [4e-6] * 4)
    _feed(s, 1, [2e-6] * 4)
    assert s.gradient(0) == pytest.approx(moves[0].weight * 0.8 * (3 - 4) * 1e-6, rel=1e-3)   # g1 = 4 - 4/4
    assert s.next_task() == 0


def test_objectives_by_name_for_the_flow_and_the_cli():
    """f1, f2 and f3 are selectable by name (the flow's and the CLI's --objective); a missing parameter is
    a clear error before anything runs."""
    from tensortune.search.task_scheduler import network_objective
    weights, costs = [2.0, 1.0], [0.5, 1.0]                      # network latency 2.0
    assert network_objective("f1", "n", weights)(costs) == 2.0
    assert network_objective("f2", "n", weights, latency_target_s=3.0)(costs) == 3.0
    assert network_objective("f2", "n", weights, latency_target_s=1.0)(costs) == 2.0
    assert network_objective("f3", "n", weights, reference_s=4.0)(costs) == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="f2 needs a positive latency target"):
        network_objective("f2", "n", weights)
    with pytest.raises(ValueError, match="f3 needs a positive reference latency"):
        network_objective("f3", "n", weights)
    with pytest.raises(ValueError, match="unknown objective 'f4'"):
        network_objective("f4", "n", weights)


def test_tune_rejects_a_bad_objective_before_starting_anything(tmp_path):
    from typer.testing import CliRunner

    from tensortune.flows import flow_cli
    out = CliRunner().invoke(flow_cli.app, ["tune", "resnet-18", "--objective", "f3", "--records", str(tmp_path / "r")])
    assert out.exit_code == 2 and "f3 needs a positive reference latency" in out.output
    assert "Prefect API" not in out.output and not (tmp_path / "r").exists()
    bad = CliRunner().invoke(flow_cli.app, ["tune", "resnet-18", "--target", "llvm -num-threads=0"])
    assert bad.exit_code == 2 and "-num-threads must be a positive integer" in bad.output
