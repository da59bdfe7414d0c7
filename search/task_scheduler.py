"""TaskScheduler: which task gets the next round of measurements (Ansor §6).

A network's latency is a weighted sum of its tasks' latencies, and some tasks improve faster than
others. The gradient strategy estimates, for each task, how much the objective would drop if it got
one more round — from its own recent progress (backward), an optimistic projection and the speed its
similar tasks already reach (forward) — and tunes the task with the steepest descent; round-robin is
there for comparison. The scheduler only decides: whoever runs it measures and reports back.
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

from tensortune.tasks.search_task import SearchTask

INF_COST = 1e10   # the cost of a task without any valid program yet (TVM's convention)


def similarity_tag(task: SearchTask) -> str:
    """Tasks with the same computation up to shapes are 'similar' (they reach similar GFLOP/s)."""
    return re.sub(r"\d+", "#", task.dag.canonical_text)


# ------------------------------------------------------------------------------------ objectives

Objective = Callable[[Sequence[float]], float]      # the network cost to minimise, from each task's best

def weighted_sum(weights: Sequence[float]) -> Objective:
    """f1: the weighted sum of task latencies (one network, or several summed)."""
    return lambda costs: float(sum(w * c for w, c in zip(weights, costs)))


def latency_requirements(networks: dict[str, dict[int, float]], requirements: dict[str, float]):
    """f2: sum over networks of max(latency, requirement): a network below its target needs no more time.
    `networks` maps network -> {task index: weight in that network}."""
    def f(costs):
        return float(sum(max(sum(w * costs[i] for i, w in tasks.items()), requirements.get(n, 0.0))
                         for n, tasks in networks.items()))
    return f


def geomean_speedup(networks: dict[str, dict[int, float]], references: dict[str, float]):
    """f3: minus the geometric mean speedup of the networks over reference latencies."""
    def f(costs):
        logs = [math.log(references[n] / max(sum(w * costs[i] for i, w in tasks.items()), 1e-30))
                for n, tasks in networks.items()]
        return -math.exp(sum(logs) / len(logs))
    return f


OBJECTIVES = ("f1", "f2", "f3")


def effective_costs(costs: Sequence[float], form_sets: Sequence[Sequence[int]]) -> list[float]:
    """Costs as the network pays them: of each set of alternative forms of one group (its direct task
    first; e.g. a conv and its Winograd forms) the network runs the fastest, so that one's cost stands
    at the set's first task and the others count 0. Alternatives have the same weight (one per group
    occurrence), so any weighted objective of these costs is the network's."""
    out = list(costs)
    for forms in form_sets:
        best = min(costs[j] for j in forms)
        for j in forms:
            out[j] = 0.0
        out[forms[0]] = best
    return out


def min_over_forms(objective: Objective, form_sets: Sequence[Sequence[int]]) -> Objective:
    """The objective of the network that runs the fastest form of each group."""
    sets = [tuple(f) for f in form_sets]
    return lambda costs: objective(effective_costs(costs, sets))


def network_objective(name: str, network: str, weights: Sequence[float], *, latency_target_s: float | None = None,
                      reference_s: float | None = None) -> Objective:
    """Ansor's objectives for one network's tasks, by name: f1 (weighted sum of latencies), f2 (f1 but
    no gain below `latency_target_s`), f3 (geometric-mean speedup over `reference_s`, e.g. the latency
    of the runtime the tuned network must beat)."""
    tasks = {network: {i: float(w) for i, w in enumerate(weights)}}
    if name == "f1":
        return weighted_sum(weights)
    if name == "f2":
        if latency_target_s is None or latency_target_s <= 0:
            raise ValueError("objective f2 needs a positive latency target (--latency-target-ms)")
        return latency_requirements(tasks, {network: latency_target_s})
    if name == "f3":
        if reference_s is None or reference_s <= 0:
            raise ValueError("objective f3 needs a positive reference latency (--reference-ms)")
        return geomean_speedup(tasks, {network: reference_s})
    raise ValueError(f"unknown objective {name!r}: use one of {', '.join(OBJECTIVES)}")


@dataclass
class TaskScheduler:
    tasks: list[SearchTask]
    weights: list[float] | None = None
    objective: Objective | None = None
    strategy: str = "gradient"                # or "round-robin"
    alpha: float = 0.2
    beta: float = 2.0
    backward_window: int = 3
    eps_greedy: float = 0.05
    early_stopping_task: int | None = None    # trials without improvement before a task is dead
    seed: int = 0
    # sets of task indices that are alternative forms of one group (NetworkTasks.form_sets): one latency
    # term, the minimum over the set
    form_sets: Sequence[Sequence[int]] = ()
    best_costs: list[float] = field(init=False)
    task_rounds: list[int] = field(init=False)        # rounds given to each task
    best_rounds: list[int] = field(init=False)        # the round each task last improved
    history: list[list[float]] = field(init=False)    # best cost after each of its rounds
    trials: list[int] = field(init=False)
    dead: set[int] = field(init=False)
    decisions: list[tuple[int, str]] = field(init=False)   # (task, why) for every choice after warm-up

    def __post_init__(self):
        if not self.tasks:
            raise ValueError("TaskScheduler needs at least one task")
        if self.strategy not in ("gradient", "round-robin"):
            raise ValueError(f"unknown strategy {self.strategy!r}; use 'gradient' or 'round-robin'")
        n = len(self.tasks)
        self.weights = list(self.weights) if self.weights is not None else [float(t.weight) for t in self.tasks]
        self.objective = self.objective or weighted_sum(self.weights)
        self.form_sets = [tuple(f) for f in self.form_sets]
        if self.form_sets:
            self.objective = min_over_forms(self.objective, self.form_sets)
        self._form_of = {j: f for f in self.form_sets for j in f}
        self.best_costs = [INF_COST] * n
        self.task_rounds, self.best_rounds, self.trials = [0] * n, [0] * n, [0] * n
        self.history = [[] for _ in range(n)]
        self.dead = set()
        self.decisions = []
        self._rng = random.Random(self.seed)
        self._rr = -1
        self._warmed_up = False
        self.tags = [similarity_tag(t) for t in self.tasks]
        self.groups: dict[str, list[int]] = {}
        for i, tag in enumerate(self.tags):
            self.groups.setdefault(tag, []).append(i)

    # ------------------------------------------------------------------ reporting

    def score(self, costs: Sequence[float] | None = None) -> float:
        assert self.objective is not None         # __post_init__ sets the default
        return self.objective(list(self.best_costs if costs is None else costs))

    def record(self, i: int, costs: Sequence[float], exhausted: bool = False) -> None:
        """A round of task i measured `costs` (seconds; inf for failures)."""
        self.task_rounds[i] += 1
        self.trials[i] += len(costs)
        best = min([c for c in costs if math.isfinite(c)], default=INF_COST)
        if best < self.best_costs[i]:
            self.best_costs[i] = best
            self.best_rounds[i] = self.task_rounds[i]
        self.history[i].append(self.best_costs[i])
        stale = (self.task_rounds[i] - self.best_rounds[i]) * (len(costs) or 1)
        if exhausted or not costs or (self.early_stopping_task is not None and stale > self.early_stopping_task):
            self.dead.add(i)
        self._adjust_group(i)

    def restore(self, i: int, rounds: int, best_cost: float) -> None:
        """Resume: task i was tuned for `rounds` rounds before and reached best_cost."""
        self.task_rounds[i] = rounds
        self.best_rounds[i] = rounds
        self.best_costs[i] = best_cost
        self.history[i] = [best_cost] * max(rounds, 1)

    # ------------------------------------------------------------------ choosing

    def warmup_order(self) -> list[int]:
        """Every task not tuned yet gets one round first (TVM's warm-up)."""
        return [i for i in range(len(self.tasks)) if self.task_rounds[i] == 0]

    def after_warmup(self) -> None:
        """Tasks that found no valid program during warm-up are dead."""
        for i, c in enumerate(self.best_costs):
            if c >= INF_COST:
                self.dead.add(i)

    def choose(self) -> int | None:
        """The task for the next round: each task not tuned yet first, in order (the warm-up), then the
        strategy's choice; None when every task is dead."""
        pending = [i for i in self.warmup_order() if i not in self.dead]
        if pending:
            return pending[0]
        if not self._warmed_up:
            self.after_warmup()
            self._warmed_up = True
        return self.next_task()

    def choose_ahead(self, busy: int) -> int | None:
        """The task for the round after the one task `busy` is being measured in (overlapped rounds):
        the strategy's choice from what is known so far, or None when the choice must wait for that
        round's results: the warm-up has no other task left to give its first round."""
        order = self.warmup_order()
        pending = [i for i in order if i not in self.dead and i != busy]
        if pending:
            return pending[0]
        return None if busy in order else self.choose()

    def gradient(self, i: int) -> float:
        costs = list(self.best_costs)
        delta = 1e-4 * max(costs[i], 1e-12)
        # d objective / d cost_i, numerically. Tasks without a valid program cost INF_COST (1e10); next to
        # that a microsecond change is below float precision and every chain became 0 (a random choice),
        # so they count as 0 here: they are dead and the others' relative worth is what matters.
        finite = [c if c < INF_COST or j == i else 0.0 for j, c in enumerate(costs)]
        for forms in self.form_sets:
            # a form without a valid program must not win its set's minimum at 0: it stands at the
            # slowest valid form's cost instead
            valid = [costs[j] for j in forms if costs[j] < INF_COST]
            for j in forms:
                if j != i and valid and costs[j] >= INF_COST:
                    finite[j] = max(valid)
        bumped = list(finite)
        bumped[i] -= delta
        chain = (self.score(finite) - self.score(bumped)) / delta
        r, w = self.task_rounds[i], self.backward_window
        hist = self.history[i]
        backward = (hist[r - 1] - hist[r - 1 - w]) / w if r - 1 < len(hist) and r - 1 - w >= 0 else 0.0
        g_next1 = costs[i] - costs[i] / max(r, 1)
        g_next2 = self.beta * 1e30
        group = self.groups.get(self.tags[i], [])
        if len(group) > 1:
            best_flops = max(self.tasks[j].flops / costs[j] for j in group)
            if best_flops > 0:       # FLOP-less tasks (BERT's transposes) have no throughput to compare
                g_next2 = self.beta * self.tasks[i].flops / best_flops
        forms = self._form_of.get(i, ())
        form_throughputs = [self.tasks[j].flops / costs[j] for j in forms
                            if j != i and costs[j] < INF_COST and self.tasks[j].flops > 0]
        if form_throughputs and self.tasks[i].flops > 0:
            # the other forms of the group are "similar" too: the same output from fewer (Winograd) or more
            # FLOPs, so the same bound (beta x the cost at the best throughput they reach)
            g_next2 = min(g_next2, self.beta * self.tasks[i].flops / max(form_throughputs))
        forward = min(g_next1, g_next2) - costs[i]
        step = self.alpha * backward + (1 - self.alpha) * forward
        if i in self._form_of:
            # one of several forms of a group: the objective is flat in a form slower than the fastest
            # (chain 0), so take the change the projected step would make, e.g. a Winograd form that may
            # overtake the direct conv, or the fastest form getting faster
            projected = list(finite)
            projected[i] = max(costs[i] + step, 0.0)
            return self.score(projected) - self.score(finite)
        return chain * step

    def next_task(self) -> int | None:
        """The task to tune next, or None when every task is dead."""
        alive = [i for i in range(len(self.tasks)) if i not in self.dead]
        if not alive:
            return None
        if self.strategy == "round-robin":
            self._rr = (self._rr + 1) % len(self.tasks)
            while self._rr in self.dead:
                self._rr = (self._rr + 1) % len(self.tasks)
            self.decisions.append((self._rr, "round-robin"))
            return self._rr
        if self._rng.random() < self.eps_greedy:
            i = self._rng.choice(alive)
            self.decisions.append((i, "eps-greedy"))
            return i
        grads = {i: self.gradient(i) for i in alive}
        lo = min(grads.values())
        if lo == max(grads.values()):
            i = self._rng.choice(alive)
            self.decisions.append((i, "tie"))
            return i
        i = min(grads, key=lambda k: grads[k])
        self.decisions.append((i, f"gradient {lo:.3g}"))
        return i

    def _adjust_group(self, i: int) -> None:
        """A task far slower than its group after many rounds is not really similar: drop it."""
        group = self.groups.get(self.tags[i], [])
        if len(group) <= 1 or self.best_costs[i] >= INF_COST:
            return
        best = max(self.tasks[j].flops / self.best_costs[j] for j in group)
        cur = self.tasks[i].flops / self.best_costs[i]
        if cur < best / self.beta and self.task_rounds[i] > 5 + max(self.task_rounds[j] for j in group if j != i):
            group.remove(i)
            self.tags[i] = f"{self.tags[i]}#{i}"
