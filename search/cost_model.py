"""Cost models that rank candidate programs: XGBoost with Ansor's pack-sum objective, and a random one.

A program's score is the sum of the predictions for its statements (one feature row per stage). The
model learns throughput normalised to [0, 1] within each task, with squared error weighted by that
throughput (good programs matter more), and is retrained from all data each time. Every training
reports held-out pairwise accuracy and recall@k, so a user can see whether it learns anything.
"""
from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tensortune.schedule.program import Program
from tensortune.search.feature_layout import N_FEATURES
from tensortune.search.feature_pool import Featurizer
from tensortune.tasks.search_task import SearchTask

log = logging.getLogger("tensortune.search")

XGB_PARAMS = {"max_depth": 10, "gamma": 0.001, "min_child_weight": 0, "eta": 0.2, "verbosity": 0,
              "disable_default_eval_metric": 1, "nthread": 2}


class CostModel:
    """Higher score = predicted faster. `version` names the model the scores come from (records carry
    it; "" for one that never trained), `metrics` how well its last training ranked held-out programs."""

    version: str = ""
    metrics: TrainingMetrics | None = None

    def predict(self, task: SearchTask, programs: Sequence[Program]) -> np.ndarray:
        raise NotImplementedError

    def update(self, task: SearchTask, programs: Sequence[Program], costs: Sequence[float]) -> None:
        """Learn from measurements (`costs` in seconds; inf for failures)."""

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
    pairwise_accuracy: float       # held-out, fraction of correctly ordered pairs within a task
    recall_at_k: float             # held-out, |true top-k ∩ predicted top-k| / k
    k: int
    train_rmse: float
    rounds: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def pack_sum(preds: np.ndarray, pack_ids: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(pack_ids, weights=preds, minlength=n)


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


class XGBModel(CostModel):
    """The learned model. Data is kept per task; `fit` retrains from everything it has seen."""

    def __init__(self, num_warmup_sample: int = 100, seed: int = 0, holdout: float = 0.2, k: int = 10,
                 max_rounds: int = 400, early_stopping: int = 50, features: Featurizer | None = None):
        self.num_warmup_sample, self.seed, self.holdout, self.k = num_warmup_sample, seed, holdout, k
        self.max_rounds, self.early_stopping = max_rounds, early_stopping
        self.booster: Any = None             # an xgboost.Booster once trained
        self.features = features or Featurizer()    # pass one in to share templates across versions
        self.data: dict[str, list[tuple[np.ndarray, float]]] = {}   # workload key -> [(features, throughput)]
        self.unseen: dict[str, int] = {}    # workload key -> rows added since the booster was trained
        self.trainings = 0                  # fits so far; `version` is its text
        self._fallback = RandomModel(seed)

    # ------------------------------------------------------------------ data

    def add(self, task: SearchTask, states: Sequence[Program], costs: Sequence[float]) -> None:
        feats = self.features(task, states)
        rows = self.data.setdefault(task.workload_key, [])
        for f, c in zip(feats, costs):
            thr = task.flops / c if c and math.isfinite(c) and c > 0 else 0.0
            rows.append((f.astype(np.float32), thr))
        self.unseen[task.workload_key] = self.unseen.get(task.workload_key, 0) + len(feats)

    def update(self, task, states, costs) -> None:
        self.add(task, states, costs)
        self.fit()

    @property
    def n_programs(self) -> int:
        return sum(len(v) for v in self.data.values())

    # ------------------------------------------------------------------ training

    def _matrix(self, programs: list[tuple[np.ndarray, float]]):
        feats = [f for f, _ in programs]
        pack_ids = np.concatenate([np.full(len(f), i) for i, f in enumerate(feats)]).astype(np.int64)
        x = np.concatenate(feats) if feats else np.zeros((0, N_FEATURES), np.float32)
        return x, pack_ids

    def _normalised(self) -> dict[str, list[tuple[np.ndarray, float]]]:
        out = {}
        for key, rows in self.data.items():
            best = max((t for _, t in rows), default=0.0)
            out[key] = [(f, t / best if best > 0 else 0.0) for f, t in rows]
        return out

    def _train(self, programs: list[tuple[np.ndarray, float]]):
        import xgboost as xgb
        x, pack_ids = self._matrix(programs)
        y = np.array([t for _, t in programs], dtype=np.float64)
        n = len(programs)
        row_y = y[pack_ids]
        dtrain = xgb.DMatrix(x, label=row_y, weight=np.maximum(row_y, 1e-3))

        def objective(preds, dmat):
            summed = pack_sum(preds, pack_ids, n)[pack_ids]
            grad = (summed - row_y) * dmat.get_weight()
            return grad, dmat.get_weight().astype(np.float64)

        def rmse(preds, dmat):
            summed = pack_sum(preds, pack_ids, n)
            return "p-rmse", float(np.sqrt(np.mean((summed - y) ** 2)))

        params = dict(XGB_PARAMS, seed=self.seed, base_score=0.0)
        booster = xgb.train(params, dtrain, num_boost_round=self.max_rounds, obj=objective,
                            custom_metric=rmse, evals=[(dtrain, "tr")],
                            early_stopping_rounds=self.early_stopping, verbose_eval=False)
        return booster

    def _predict_rows(self, booster, feats: list[np.ndarray]) -> np.ndarray:
        import xgboost as xgb
        x, pack_ids = self._matrix([(f, 0.0) for f in feats])
        preds = booster.predict(xgb.DMatrix(x), iteration_range=(0, booster.best_iteration + 1))
        return pack_sum(preds, pack_ids, len(feats))

    def fit(self) -> TrainingMetrics | None:
        """Retrain from all data, after measuring how well the current booster ranks the programs
        measured since it was trained: data it has never seen, and the ones the search chose by it
        (TVM reports no such figure). Before there is a booster, a model fitted on 80% ranks the rest."""
        if self.n_programs < 8:
            return None
        data = self._normalised()
        acc: list[float] = []
        rec: list[float] = []
        fresh = {key: rows[len(rows) - self.unseen.get(key, 0):] for key, rows in data.items()}
        if self.booster is not None and any(len(rows) >= 2 for rows in fresh.values()):
            self._rank(self.booster, fresh, acc, rec)
        else:
            rng = random.Random(self.seed + self.trainings)
            train, held = [], {}
            for key, rows in data.items():
                idx = list(range(len(rows)))
                rng.shuffle(idx)
                n_held = int(len(rows) * self.holdout) if len(rows) >= 10 else 0
                held[key] = [rows[i] for i in idx[:n_held]]
                train += [rows[i] for i in idx[n_held:]]
            if any(held.values()):
                self._rank(self._train(train), held, acc, rec)
        all_rows = [r for rows in data.values() for r in rows]
        self.booster = self._train(all_rows)
        self.unseen = {}
        pred = self._predict_rows(self.booster, [f for f, _ in all_rows])
        true = np.array([t for _, t in all_rows])
        self.trainings += 1
        self.version = str(self.trainings)
        self.metrics = TrainingMetrics(
            len(all_rows), len(data), float(np.nanmean(acc)) if acc else float("nan"),
            float(np.nanmean(rec)) if rec else float("nan"), self.k,
            float(np.sqrt(np.mean((pred - true) ** 2))), int(self.booster.best_iteration + 1))
        log.info("cost model v%d trained on %d programs of %d task(s): held-out pairwise accuracy %.3f, "
                 "recall@%d %.3f", self.trainings, self.metrics.n_programs, self.metrics.n_tasks,
                 self.metrics.pairwise_accuracy, self.k, self.metrics.recall_at_k)
        return self.metrics

    def _rank(self, booster, held: dict[str, list[tuple[np.ndarray, float]]], acc: list, rec: list) -> None:
        """Pairwise accuracy and recall@k of the booster on each task's held-out programs."""
        for rows in held.values():
            if len(rows) < 2:
                continue
            pred = self._predict_rows(booster, [f for f, _ in rows])
            true = np.array([t for _, t in rows])
            acc.append(pairwise_accuracy(pred, true))
            rec.append(recall_at_k(pred, true, self.k))

    # ------------------------------------------------------------------ prediction

    def predict(self, task, states):
        if self.booster is None or self.n_programs < self.num_warmup_sample:
            return self._fallback.predict(task, states)
        return self.predict_features(self.features(task, states))

    def predict_features(self, feats: list[np.ndarray]) -> np.ndarray:
        return self._predict_rows(self.booster, feats)

    @property
    def is_random(self) -> bool:
        return self.booster is None or self.n_programs < self.num_warmup_sample

    # ------------------------------------------------------------------ persistence

    def save_bytes(self) -> bytes:
        """The trained booster plus its metrics (the training data stays in the record store)."""
        if self.booster is None:
            raise ValueError("the model has not been trained yet")
        raw = bytes(self.booster.save_raw("ubj"))
        meta = json.dumps({"version": self.trainings, "n_programs": self.n_programs,
                           "metrics": self.metrics.as_dict() if self.metrics else None,
                           "best_iteration": int(self.booster.best_iteration)}).encode()
        return len(meta).to_bytes(4, "little") + meta + raw

    @staticmethod
    def load_bytes(blob: bytes, **kw) -> "XGBModel":
        import xgboost as xgb
        n = int.from_bytes(blob[:4], "little")
        meta = json.loads(blob[4:4 + n])
        booster = xgb.Booster()
        booster.load_model(bytearray(blob[4 + n:]))
        booster.set_attr(best_iteration=str(meta["best_iteration"]))
        model = XGBModel(**kw)
        model.booster, model.trainings = booster, int(meta["version"])
        model.version = str(model.trainings)
        model.num_warmup_sample = 0
        if meta.get("metrics"):
            model.metrics = TrainingMetrics(**meta["metrics"])
        return model
