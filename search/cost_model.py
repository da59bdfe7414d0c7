"""Cost models that rank candidate programs: XGBoost over one row a program, and a random one.

A program's score is the booster's prediction for its row: its main stage's features beside the sum of
its other stages', and the schedule's own numbers (search.program_row, search.knobs; Ansor summed a
prediction a stage instead, which cannot score a stage by what the others do). Objective "regression"
(Ansor's) learns throughput normalised to [0, 1] within each task, with squared error weighted by that
throughput (good programs matter more); "rank" learns only the order, with RankNet's pairwise logistic
loss on pairs of one task's programs; "blend", the default, trains one of each and adds their
standardised scores (Blend), which ordered held-out programs better than either alone. It is retrained
each time from each task's best and newest programs, at most TASK_PROGRAMS of a task, so a retrain's cost
grows with the tasks, not with the nights (training_rows). Every training reports held-out pairwise
accuracy and recall@k, so a user can see whether it learns anything.
"""
from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from tensortune.schedule.program import Program
from tensortune.search.feature_pool import Featurizer
from tensortune.search.helper_pool import HelperPool
from tensortune.search.knobs import knob_vector
from tensortune.search.program_row import program_rows
from tensortune.search.training_set import OTHER_TASK_PROGRAMS, TASK_PROGRAMS, training_rows
from tensortune.tasks.search_task import SearchTask

log = logging.getLogger("tensortune.search")

# "regression": Ansor's squared error on normalised throughput, weighted by it; "rank": pairwise (RankNet)
# logistic loss on the scores of programs of one task, which only asks for the order the search uses;
# "blend": a booster of each, their scores standardised and added (Blend)
OBJECTIVES = ("regression", "rank", "blend")
BLENDED = ("regression", "rank")
DEFAULT_OBJECTIVE = "blend"
# the learned models by the name a user gives (tune-op --model, the benchmarks), and their objectives
MODEL_OBJECTIVES = {"xgb-blend": "blend", "xgb": "regression", "xgb-rank": "rank"}
DEFAULT_MODEL = "xgb-blend"
# boosting rounds at most. The pairwise loss on the training set never stops falling, so early stopping
# never ends a ranker's training: 100 rounds ranked the fixed matmul data as well as 200 or 400, in a
# quarter of the time.
DEFAULT_ROUNDS = {"regression": 400, "rank": 100}
# the ranker's trees, over XGB_PARAMS: at TVM's depth of 10 its trees held four times the regression's
# leaves (214 against 56 a tree on 3000 network programs) and a blend's fit took 4.8 s against the
# regression's 1.1; at 6 it took 2.2 s, and the blend ordered the twelve stored 512-trial histories as
# well (matmul 0.8444 -> 0.8465, conv 0.8206 -> 0.8215; a network task left out 0.638 -> 0.635)
RANK_PARAMS = {"max_depth": 6}

# TVM's parameters, and 64 histogram bins a feature instead of XGBoost's 256: a network store's fit
# (ResNet-50's 6000 programs, 22 000 feature rows) took half the time, 1.0 against 2.1 s, with the same
# held-out accuracy (35 of its tasks cross-validated: 0.6717 against 0.6714, no task 0.01 apart; the
# tests' matmul data 0.679 / 0.751 against 0.674 / 0.752); the flow retrains every round
XGB_PARAMS = {"max_depth": 10, "gamma": 0.001, "min_child_weight": 0, "eta": 0.2, "verbosity": 0,
              "disable_default_eval_metric": 1, "nthread": 2, "max_bin": 64}


# what the model reads of a program: its feature matrix (a row per stage) and its knob vector (search.knobs)
ProgramInput = tuple[np.ndarray, np.ndarray]


class CostModel:
    """Higher score = predicted faster. `version` names the model the scores come from (records carry
    it; "" for one that never trained), `metrics` how well its last training ranked held-out programs."""

    version: str = ""
    metrics: TrainingMetrics | None = None

    def predict(self, task: SearchTask, programs: Sequence[Program]) -> np.ndarray:
        raise NotImplementedError

    @property
    def helpers(self) -> HelperPool | None:
        """The processes the model computes features on; the search draws its samples there too (None:
        everything runs in this process)."""
        return None

    def update(self, task: SearchTask, programs: Sequence[Program], costs: Sequence[float]) -> None:
        """Learn from measurements (`costs` in seconds; inf for failures)."""

    def add(self, task: SearchTask, programs: Sequence[Program], costs: Sequence[float]) -> None:
        """Keep measurements to learn from at the next `refit` (a resumed run adds every task's history,
        then refits once); nothing by default."""

    def refit(self) -> None:
        """Learn from what was added; nothing by default."""

    @property
    def is_random(self) -> bool:
        return False


class RandomModel(CostModel):
    """For ablation: ranks programs at random."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def predict(self, task, states):
        return self.rng.uniform(size=len(states))

    @property
    def is_random(self) -> bool:
        return True


@dataclass
class TrainingMetrics:
    n_programs: int
    n_tasks: int
    pairwise_accuracy: float       # held-out, fraction of correctly ordered pairs within a task (tasks' mean)
    recall_at_k: float             # held-out, |true top-k ∩ predicted top-k| / k (tasks' mean)
    k: int
    train_rmse: float
    rounds: int
    # workload key -> [pairwise accuracy, recall@k, programs held out], each task whose held-out programs
    # have an order to get right (the means above are over these)
    per_task: dict[str, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Blend:
    """The "blend" objective's model: a regression booster and a ranker (BLENDED), a program's score the
    sum of their scores, each standardised by the mean and deviation of its scores on the programs it was
    trained on. The two miss on different histories: held out, the regression ordered one 512-trial
    matmul history at 0.69 where the ranker ordered it at 0.83, and the ranker other ones below the
    regression. Added, they ordered eleven of twelve stored 512-trial histories better than the
    regression alone and one as well (matmul 0.841 -> 0.847, conv 0.807 -> 0.822 on average), and a
    network's task never seen better (MobileNet-V2 0.614 -> 0.635, ResNet-18 0.621 -> 0.637; Zen 4,
    docs/performance.md, "Two objectives, blended"). Fixed constants, not a batch's own statistics, so a
    program scores the same in any batch (the search keeps scores across calls)."""
    boosters: list[Any]
    centre: list[float]
    scale: list[float]

    @property
    def best_iteration(self) -> int:
        """The regression booster's (what a single model reports as its rounds)."""
        return int(self.boosters[0].best_iteration)

    def scores(self, x: np.ndarray) -> np.ndarray:
        return sum(((_scores(b, x) - c) / s for b, c, s in zip(self.boosters, self.centre, self.scale)),
                   np.zeros(len(x)))


def scaled_to_best(rows: Sequence[tuple[ProgramInput, float]]) -> list[tuple[ProgramInput, float]]:
    """One task's (program, throughput) rows with throughputs divided by the task's best (0 if none ran)."""
    best = max((t for _, t in rows), default=0.0)
    return [(f, t / best if best > 0 else 0.0) for f, t in rows]


def pairwise_pairs(y: np.ndarray, groups: np.ndarray, partners: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(better, worse) program indices: for each program, `partners` others of its own task drawn at random
    (fixed by `seed`), ordered by their throughput `y`; ties are left out. A sample keeps a training round
    linear in the number of programs (all pairs of a 2000-program task would be 4 million)."""
    rng = np.random.default_rng(seed)
    first: list[np.ndarray] = []
    second: list[np.ndarray] = []
    for g in np.unique(groups):
        members = np.flatnonzero(groups == g)
        if len(members) < 2:
            continue
        i = np.repeat(members, partners)
        j = members[rng.integers(0, len(members), size=len(i))]
        keep = y[i] != y[j]
        i, j = i[keep], j[keep]
        better = np.where(y[i] > y[j], i, j)
        first.append(better)
        second.append(np.where(better == i, j, i))
    if not first:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(first), np.concatenate(second)


def pairwise_accuracy(pred: np.ndarray, true: np.ndarray) -> float:
    i, j = np.triu_indices(len(true), 1)
    keep = true[i] != true[j]
    if not keep.any():
        return float("nan")
    return float(np.mean(np.sign(pred[i] - pred[j])[keep] == np.sign(true[i] - true[j])[keep]))


def recall_at_k(pred: np.ndarray, true: np.ndarray, k: int) -> float:
    k = min(k, len(true))
    if k == 0:
        return float("nan")
    return len(set(np.argsort(-true)[:k]) & set(np.argsort(-pred)[:k])) / k


# the fewest programs `fit` trains on
MIN_FIT_PROGRAMS = 8
# Programs the model must have seen before its scores are used (at least MIN_FIT_PROGRAMS). TVM waits for 100,
# so with rounds of 64 a task's first two rounds are drawn at random and a 128-trial search has no
# model at all. Trusting it from its first fit found faster programs by 128 trials in six of six runs
# in rounds of 32 against TVM's 100 in rounds of 64 (Zen 5, 2026-11-25; matmul 1024^3 / ResNet-18
# conv, seeds 0-2: 381 -> 449 and 300 -> 350 GFLOP/s on average), and in two of four in rounds of 64
# (one slower, one even; docs/performance.md, "Fewer trials"): a model fitted on a few dozen programs already ranks
# better than chance, and eps-greedy keeps drawing random programs beside it.
WARMUP_PROGRAMS = 0


class XGBModel(CostModel):
    """The learned model. Data is kept per task, every program; `fit` retrains from each task's best and
    newest (training_rows)."""

    def __init__(self, num_warmup_sample: int = WARMUP_PROGRAMS, seed: int = 0, holdout: float = 0.2, k: int = 10,
                 max_rounds: int | None = None, early_stopping: int = 50, features: Featurizer | None = None,
                 objective: str = DEFAULT_OBJECTIVE, partners: int = 16, task_programs: int | None = TASK_PROGRAMS,
                 focus: Sequence[str] | None = None, other_task_programs: int | None = OTHER_TASK_PROGRAMS):
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown cost-model objective {objective!r}; use one of {', '.join(OBJECTIVES)}")
        self.objective, self.partners = objective, partners
        self.num_warmup_sample, self.seed, self.holdout, self.k = num_warmup_sample, seed, holdout, k
        self.max_rounds = max_rounds        # None: each objective's DEFAULT_ROUNDS (a blend's two their own)
        self.early_stopping = early_stopping
        # what `fit` trains on, a task at most (training_rows; None: every program): `task_programs` of a task
        # in `focus` (None: every task), `other_task_programs` of any other; `data` keeps every program
        self.task_programs, self.focus = task_programs, None if focus is None else set(focus)
        self.other_task_programs = other_task_programs
        self.booster: Any = None             # an xgboost.Booster once trained (a Blend of two: "blend")
        self.features = features or Featurizer()    # pass one in to share templates across versions
        self.data: dict[str, list[tuple[ProgramInput, float]]] = {}  # workload key -> [(program, throughput)]
        self.unseen: dict[str, int] = {}    # workload key -> rows added since the booster was trained
        self.trainings = 0                  # fits so far; `version` is its text
        self._fallback = RandomModel(seed)

    @property
    def helpers(self) -> HelperPool:
        return self.features.helpers

    # ------------------------------------------------------------------ data

    def add(self, task: SearchTask, states: Sequence[Program], costs: Sequence[float]) -> None:
        self.add_features(task, self.features(task, states), costs, states)

    def add_features(self, task: SearchTask, feats: Sequence[np.ndarray], costs: Sequence[float],
                     programs: Sequence[Program]) -> None:
        """`add` for programs whose features are known already (stored: storage.feature_cache); the
        programs give their knobs (parsed steps are enough: nothing is replayed)."""
        rows = self.data.setdefault(task.workload_key, [])
        for f, c, p in zip(feats, costs, programs, strict=True):
            thr = task.flops / c if c and math.isfinite(c) and c > 0 else 0.0
            rows.append(((f.astype(np.float32), knob_vector(p.steps)), thr))
        self.unseen[task.workload_key] = self.unseen.get(task.workload_key, 0) + len(feats)

    def update(self, task, states, costs) -> None:
        self.add(task, states, costs)
        self.fit()

    def refit(self) -> None:
        self.fit()

    @property
    def n_programs(self) -> int:
        return sum(len(v) for v in self.data.values())

    # ------------------------------------------------------------------ training

    def _limit(self, key: str) -> int | None:
        """The most programs of task `key` that `fit` trains on (None: every one)."""
        return self.task_programs if self.focus is None or key in self.focus else self.other_task_programs

    def _train(self, programs: list[tuple[ProgramInput, float]], groups: np.ndarray, x: np.ndarray | None = None):
        """A booster on `programs` (program, normalised throughput); `groups[i]` is program i's task; `x`
        their program rows where the caller has them already (fit scores the same rows afterwards). The
        blend's is a `Blend` of a regression booster and a ranker."""
        y = np.array([t for _, t in programs], dtype=np.float64)
        if x is None:
            x = _rows([p for p, _ in programs])
        if self.objective != "blend":
            return self._train_one(self.objective, x, y, groups)
        boosters = [self._train_one(objective, x, y, groups) for objective in BLENDED]
        scores = [_scores(b, x) for b in boosters]
        return Blend(boosters, [float(s.mean()) for s in scores], [float(s.std()) or 1.0 for s in scores])

    def _train_one(self, objective: str, x: np.ndarray, y: np.ndarray, groups: np.ndarray):
        """One xgboost.Booster trained with `objective` ("regression" or "rank") on rows `x`, labels `y`."""
        import xgboost as xgb
        n = len(y)
        dtrain = xgb.DMatrix(x, label=y, weight=np.maximum(y, 1e-3))

        def regression(preds, dmat):
            """Ansor's: the squared error of the score, weighted by the throughput."""
            grad = (preds - y) * dmat.get_weight()
            return grad, dmat.get_weight().astype(np.float64)

        better, worse = pairwise_pairs(y, groups, self.partners, self.seed + self.trainings)
        gap = y[better] - y[worse]

        def rank(preds, dmat):
            """RankNet's logistic loss on pairs of one task's programs, log(1 + exp(-(s_better - s_worse))),
            each pair weighted by its throughput gap."""
            p = 1.0 / (1.0 + np.exp(np.clip(preds[better] - preds[worse], -30, 30)))   # sigmoid(-(s_b - s_w))
            grad = np.bincount(worse, p * gap, n) - np.bincount(better, p * gap, n)
            h = np.maximum(p * (1 - p), 1e-6) * gap
            hess = np.bincount(better, h, n) + np.bincount(worse, h, n)
            return grad, np.maximum(hess, 1e-6)

        def rmse(preds, dmat):
            if objective == "rank":       # the pairs' mean loss: a ranker's scores have no scale
                return "p-rank", float(np.mean(np.log1p(np.exp(-(preds[better] - preds[worse]))))) \
                    if len(better) else 0.0
            return "p-rmse", float(np.sqrt(np.mean((preds - y) ** 2)))

        params = dict(XGB_PARAMS, seed=self.seed, base_score=0.0, **(RANK_PARAMS if objective == "rank" else {}))
        return xgb.train(params, dtrain, num_boost_round=self.max_rounds or DEFAULT_ROUNDS[objective],
                         obj=rank if objective == "rank" else regression, custom_metric=rmse, evals=[(dtrain, "tr")],
                         early_stopping_rounds=self.early_stopping, verbose_eval=False)

    def _predict_rows(self, booster, programs: list[ProgramInput]) -> np.ndarray:
        """Scores of programs from their features and knobs, one batch. The rows go to the booster as
        they are (inplace_predict, the same numbers as through a DMatrix): building a DMatrix of a search
        generation's ~6000 rows cost more than predicting them."""
        if not programs:
            return np.zeros(0)
        return _scores(booster, _rows(programs))

    def fit(self) -> TrainingMetrics | None:
        """Retrain from each task's best and newest programs (at most `_limit` of a task: training_rows),
        after measuring how well the current booster ranks the programs measured since it was trained:
        data it has never seen, and the ones the search chose by it (TVM reports no such figure). Before
        there is a booster, a model fitted on 80% ranks the rest."""
        if self.n_programs < MIN_FIT_PROGRAMS:
            return None
        per_task: dict[str, list[float]] = {}
        # ranked as measured: no figure of _rank depends on a task's scale
        fresh = {key: rows[len(rows) - self.unseen.get(key, 0):] for key, rows in self.data.items()}
        # each task's throughputs divided by its best, so tasks of any size train one model: chosen by the
        # measured throughputs, then scaled (the task's best is among them; scaled first, two throughputs a
        # rounding apart could tie and bring back a program left out)
        data = {key: scaled_to_best(training_rows(rows, self._limit(key))) for key, rows in self.data.items()}
        if self.booster is not None and any(len(rows) >= 2 for rows in fresh.values()):
            per_task = self._rank(self.booster, fresh)
        else:
            rng = random.Random(self.seed + self.trainings)
            train, train_groups, held = [], [], {}
            for g, (key, rows) in enumerate(data.items()):
                idx = list(range(len(rows)))
                rng.shuffle(idx)
                n_held = int(len(rows) * self.holdout) if len(rows) >= 10 else 0
                held[key] = [rows[i] for i in idx[:n_held]]
                train += [rows[i] for i in idx[n_held:]]
                train_groups += [g] * (len(rows) - n_held)
            if any(held.values()):
                per_task = self._rank(self._train(train, np.array(train_groups)), held)
        all_rows = [r for rows in data.values() for r in rows]
        groups = np.concatenate([np.full(len(rows), g) for g, rows in enumerate(data.values())])
        x = _rows([p for p, _ in all_rows])
        self.booster = self._train(all_rows, groups, x)
        self.unseen = {}
        # the fit of the throughputs themselves: the regression's (a ranker's scores have no scale)
        pred = _scores(self.booster.boosters[0] if isinstance(self.booster, Blend) else self.booster, x)
        true = np.array([t for _, t in all_rows])
        self.trainings += 1
        self.version = str(self.trainings)
        self.metrics = TrainingMetrics(
            len(all_rows), len(data), _mean_of_finite([a for a, _, _ in per_task.values()]),
            _mean_of_finite([r for _, r, _ in per_task.values()]), self.k,
            float(np.sqrt(np.mean((pred - true) ** 2))), int(self.booster.best_iteration + 1), per_task)
        log.info("cost model v%d trained on %d programs of %d task(s): held-out pairwise accuracy %.3f, "
                 "recall@%d %.3f", self.trainings, self.metrics.n_programs, self.metrics.n_tasks,
                 self.metrics.pairwise_accuracy, self.k, self.metrics.recall_at_k)
        return self.metrics

    def cross_validate(self, rows: Sequence[tuple[ProgramInput, float]], folds: int = 4,
                       shuffles: int = 3) -> tuple[float, float]:
        """(pairwise accuracy, recall@k) of this model's objective on one task's programs held out:
        `folds`-fold cross-validation over `shuffles` shuffles (seeded by `self.seed`), each fold's
        booster trained on the others' rows (program, throughput) as `fit` trains, every pair of held-out
        programs scored. Unlike `fit`'s figure (the last booster on the programs the search then chose by
        it, which all look good to it), this asks how well the model orders a task's whole history, the
        same split for every objective: what the objectives and features are compared on (issue 19).
        Programs that failed (throughput 0) are left out: telling a crash from a kernel is not ordering
        kernels, and would flatter the figure. Leaves the model's own booster and data alone."""
        rows = [(f, t) for f, t in rows if t > 0]
        acc: list[float] = []
        rec: list[float] = []
        for shuffle in range(shuffles):
            idx = list(range(len(rows)))
            random.Random(self.seed + shuffle).shuffle(idx)
            for fold in range(folds):
                held = set(idx[fold::folds])
                train = [rows[i] for i in idx if i not in held]
                booster = self._train(scaled_to_best(train), np.zeros(len(train), np.int64))
                for a, r, _ in self._rank(booster, {"held": [rows[i] for i in sorted(held)]}).values():
                    acc.append(a)
                    rec.append(r)
        return _mean_of_finite(acc), _mean_of_finite(rec)

    def _rank(self, booster, held: dict[str, list[tuple[ProgramInput, float]]]) -> dict[str, list[float]]:
        """[pairwise accuracy, recall@k, programs] of the booster on each task's held-out programs, for
        each task whose held-out programs have an order to get right (two or more, not all tied)."""
        out: dict[str, list[float]] = {}
        for key, rows in held.items():
            if len(rows) < 2:
                continue
            pred = self._predict_rows(booster, [p for p, _ in rows])
            true = np.array([t for _, t in rows])
            acc = pairwise_accuracy(pred, true)
            if math.isfinite(acc):
                out[key] = [acc, recall_at_k(pred, true, self.k), len(rows)]
        return out

    # ------------------------------------------------------------------ prediction

    def predict(self, task, states):
        if self.booster is None or self.n_programs < self.num_warmup_sample:
            return self._fallback.predict(task, states)
        return self._predict_rows(self.booster, list(zip(self.features(task, states),
                                                         [knob_vector(p.steps) for p in states])))

    @property
    def is_random(self) -> bool:
        return self.booster is None or self.n_programs < self.num_warmup_sample

    # ------------------------------------------------------------------ persistence

    def save_bytes(self) -> bytes:
        """The trained booster(s) plus the metrics (the training data stays in the record store): a JSON
        header naming each booster's size, then the boosters' bytes one after the other."""
        if self.booster is None:
            raise ValueError("the model has not been trained yet")
        blend = self.booster if isinstance(self.booster, Blend) else None
        boosters = blend.boosters if blend else [self.booster]
        raws = [bytes(b.save_raw("ubj")) for b in boosters]
        meta: dict[str, Any] = {
            "version": self.trainings, "n_programs": self.n_programs, "objective": self.objective,
            "metrics": self.metrics.as_dict() if self.metrics else None,
            "parts": [{"size": len(r), "best_iteration": int(b.best_iteration)} for r, b in zip(raws, boosters)]}
        if blend:
            meta["centre"], meta["scale"] = blend.centre, blend.scale
        head = json.dumps(meta).encode()
        return len(head).to_bytes(4, "little") + head + b"".join(raws)

    @staticmethod
    def load_bytes(blob: bytes, **kw) -> "XGBModel":
        import xgboost as xgb
        n = int.from_bytes(blob[:4], "little")
        meta = json.loads(blob[4:4 + n])
        # a model saved before the blend: one booster, the rest of the bytes
        parts = meta.get("parts") or [{"size": len(blob) - 4 - n, "best_iteration": meta["best_iteration"]}]
        boosters, at = [], 4 + n
        for part in parts:
            booster = xgb.Booster()
            booster.load_model(bytearray(blob[at:at + part["size"]]))
            booster.set_attr(best_iteration=str(part["best_iteration"]))
            boosters.append(booster)
            at += part["size"]
        model = XGBModel(**{"objective": meta.get("objective", "regression"), **kw})
        model.booster = Blend(boosters, meta["centre"], meta["scale"]) if "centre" in meta else boosters[0]
        model.trainings = int(meta["version"])
        model.version = str(model.trainings)
        model.num_warmup_sample = 0
        if meta.get("metrics"):
            # the fields this version knows (a model stored by a newer one may carry more)
            known = TrainingMetrics.__dataclass_fields__
            model.metrics = TrainingMetrics(**{k: v for k, v in meta["metrics"].items() if k in known})
        return model


def _rows(programs: Sequence[ProgramInput]) -> np.ndarray:
    """The booster's input: one row a program (search.program_row)."""
    return program_rows([f for f, _ in programs], np.stack([k for _, k in programs]))


def _scores(booster, x: np.ndarray) -> np.ndarray:
    """The booster's scores of program rows `x`, by the trees up to its best iteration (a Blend's: its sum)."""
    if isinstance(booster, Blend):
        return booster.scores(x)
    return booster.inplace_predict(x, iteration_range=(0, booster.best_iteration + 1)).astype(np.float64)


def _mean_of_finite(values: list[float]) -> float:
    """The mean of the figures that exist (cross_validate's folds: NaN where the held-out rows all tie);
    NaN when none does, without numpy's empty-slice warning."""
    finite = [v for v in values if not math.isnan(v)]
    return float(np.mean(finite)) if finite else float("nan")
