"""Retraining the cost model from the stored history, as a step of its own (not inside every round).

The record store is the single source of truth: a retrain reads the records of the network's tasks (with
transfer, of every task of the target: see Trainer), trains the XGBoost model, stores it as a new
version with its metrics (storage.models), and swaps it into `NewestModel`, the model every search round
predicts with. `update()` of NewestModel does nothing on purpose: new measurements reach the model
through the store at the next retrain. The trainer keeps the features of records it has already read, so
each retrain featurises only the records added since the last one.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from tensortune.flows.stored_features import StoredFeatures
from tensortune.schedule.program import Program
from tensortune.schedule.stage import IllegalStep
from tensortune.search.candidate import Candidate
from tensortune.search.cost_model import (
    DEFAULT_OBJECTIVE,
    MIN_FIT_PROGRAMS,
    WARMUP_PROGRAMS,
    CostModel,
    RandomModel,
    XGBModel,
)
from tensortune.search.feature_pool import Featurizer
from tensortune.search.helper_pool import HelperPool
from tensortune.search.training_set import TASK_PROGRAMS, training_bounds
from tensortune.storage.feature_cache import Key
from tensortune.storage.models import ModelStore
from tensortune.storage.records import RecordStore
from tensortune.storage.tasks import TaskStore
from tensortune.tasks.search_task import SearchTask

log = logging.getLogger("tensortune.flows")

# what the stored boosters read: one row a program with its knobs (search.program_row); a booster of
# another kind reads other columns, so it is not loaded: the per-stage rows of "xgb-packsum" (before
# 2026-11-29), the program rows without knobs of "xgb-program" and those without tiles of "xgb-program-knobs"
# (both 2026-11-29)
MODEL_KIND = "xgb-program-knobs-tiles"


class NewestModel(CostModel):
    """The model the search rounds use; `version` names the stored version ("" while random)."""

    def __init__(self, seed: int = 0):
        self.model: CostModel = RandomModel(seed)
        self.version = ""
        self.features = Featurizer()   # every version's features: templates outlive the models

    def use(self, model: CostModel, version: str) -> None:
        self.model, self.version = model, version

    @property
    def helpers(self) -> HelperPool:
        return self.features.helpers

    def predict(self, task: SearchTask, programs: Sequence[Program]) -> np.ndarray:
        return self.model.predict(task, programs)

    def update(self, task: SearchTask, programs: Sequence[Program], costs: Sequence[float]) -> None:
        """Nothing: measurements go to the record store and reach the model at the next retrain."""

    @property
    def is_random(self) -> bool:
        return self.model.is_random


@dataclass
class RetrainReport:
    """What one retrain step did (also the table row of the flow's log)."""
    trained: bool
    version: str                     # the version rounds use after this step ("" = random)
    record_count: int                # programs in the training history (every task's, with transfer)
    new_records: int                 # read since the last retrain
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


class Trainer:
    """Collects the training data of a target from the record store.

    transfer=False: the records of `tasks` only (the network being tuned). transfer=True (the flow's
    default): every stored record of the target, of any network and any night, so a task never tuned
    before is ranked by a model that has seen the others (Ansor's one model for all tasks; its
    features describe a program's buffer accesses, not which task it belongs to, and the throughputs are
    normalised per task); it trains on at most `train_programs` programs of each of `tasks` and a quarter
    as many of any other (search.training_set; 0: every program), so a
    retrain's cost stops growing with the nights. A record of a task outside `tasks` is rebuilt from the
    task stored beside the records (storage.tasks); one whose task was never stored (a store written
    before the task files) is skipped and counted in `unknown`."""

    def __init__(self, tasks: Sequence[SearchTask], target: str, warmup: int = WARMUP_PROGRAMS, seed: int = 0,
                 features: Featurizer | None = None, transfer: bool = False, objective: str = DEFAULT_OBJECTIVE,
                 cache_features: bool = True, train_programs: int = TASK_PROGRAMS):
        self.tasks = {t.workload_key: t for t in tasks}
        self.target, self.warmup, self.transfer = target, warmup, transfer
        # the model trains on the network's tasks' programs, and on a few of every other task's (XGBModel.focus)
        mine, others = training_bounds(train_programs)
        self.xgb = XGBModel(num_warmup_sample=warmup, seed=seed, features=features, objective=objective,
                            focus=list(self.tasks), task_programs=mine, other_task_programs=others)
        self.seen: set[tuple[str, str]] = set()
        self.unknown: set[str] = set()             # workload keys with records but no stored task
        # each store's features (flows.stored_features), its cache read at the store's first read_new
        self.cache_features = cache_features
        self.stored: dict[str, StoredFeatures] = {}

    def _task(self, key: str, records: RecordStore) -> SearchTask | None:
        if key in self.tasks:
            return self.tasks[key]
        if not self.transfer or key in self.unknown:
            return None
        stored = TaskStore(records.location.url).descriptions()
        like = next(iter(self.tasks.values()), None)
        for k, text in stored.items():
            if k not in self.tasks:
                task = SearchTask.from_json(text)
                # measured on this target: rebuilt for it (its hardware limits shape the features)
                self.tasks[k] = replace(task, target=self.target, hardware=like.hardware) if like else task
        if key not in self.tasks:
            self.unknown.add(key)
            return None
        return self.tasks[key]

    def read_new(self, records: RecordStore) -> int:
        """Add the records not read before; returns how many programs were added. A program's features
        come from the store's feature cache where it has them (flows.stored_features, loaded at the
        store's first read); those computed here are saved to it."""
        keys = None if self.transfer else list(self.tasks)
        frame = records.training_frame(target=self.target, workload_keys=keys)
        features = self._features(records)
        added = 0
        for key, rows in frame.groupby("workload_key", sort=False):
            task = self._task(str(key), records)
            if task is None:
                continue
            # made at the task's first new row: every retrain reads every task, and writing a task's
            # description out takes ~3 ms (0.1 s a retrain for ResNet-50's 36 with no new row)
            task_digest = ""
            order: list[Key] = []                      # the programs added, in record order
            programs: list[Candidate] = []             # ... parsed, replayed only where their features are not held
            costs: list[float] = []
            for steps, latency, code in zip(rows["steps"], rows["mean_latency"], rows["error_code"]):
                if (key, steps) in self.seen:
                    continue
                self.seen.add((key, steps))
                task_digest = task_digest or features.task_digest(task)
                at = features.key(task_digest, steps)
                try:
                    program = features.program(task, at, steps)      # the model reads its knobs
                except IllegalStep:
                    continue             # written by an older rule set: kept in the store, skipped here
                order.append(at)
                programs.append(program)
                costs.append(float(latency) if code == 0 else math.inf)
            if order:
                self.xgb.add_features(task, features.matrices(self.xgb, task, order, programs), costs, programs)
                added += len(order)
        features.done()
        return added

    def _features(self, records: RecordStore) -> StoredFeatures:
        """The store's features: its cache, loaded at the store's first read (nothing later: the programs
        read after it are the ones measured since, and the matrices are not held twice)."""
        url = records.location.url
        if url not in self.stored:
            self.stored[url] = StoredFeatures(records, enabled=self.cache_features)
        return self.stored[url]


@dataclass
class HistoryModel:
    """A cost model trained on stored records before a search starts (transfer)."""
    model: XGBModel
    programs: int                    # read from the stores, not all trained on (0: the model is still random)
    tasks: int                       # ... of this many tasks
    unknown: list[str]               # workload keys with records but no stored task (skipped)


def history_model(stores: Sequence[RecordStore], tasks: Sequence[SearchTask], seed: int = 0,
                  exclude: Sequence[str] = (), objective: str = DEFAULT_OBJECTIVE) -> HistoryModel:
    """An XGBModel trained on the records of the tasks' target in `stores` (every network, every night; at
    most OTHER_TASK_PROGRAMS of a task other than `tasks`, as the flow's Trainer trains), leaving out the
    workload keys in `exclude`: a search that resumes its own task's history feeds those records to the
    model itself (flows.tuning.resume_policy), and a benchmark that asks what other tasks'
    history is worth must not learn from the task. Too few programs leave it untrained (random)."""
    trainer = Trainer(tasks, str(tasks[0].target), seed=seed, transfer=True, objective=objective)
    for store in stores:
        trainer.read_new(store)
    for key in exclude:
        trainer.xgb.data.pop(key, None)
    if trainer.xgb.n_programs:
        trainer.xgb.fit()
    return HistoryModel(trainer.xgb, trainer.xgb.n_programs, len(trainer.xgb.data), sorted(trainer.unknown))


def load_newest(models: ModelStore, target: str, holder: NewestModel) -> str:
    """Put the newest stored model for `target` into `holder` (if any); returns its version."""
    found = models.load_newest(target)
    if found is None:
        return ""
    blob, meta = found
    if meta.get("kind") != MODEL_KIND:
        log.info("the newest stored model for %s (%s) is of kind %r, not %r: not loaded; the next retrain "
                 "trains one from the records", target, meta["version"], meta.get("kind"), MODEL_KIND)
        return ""
    holder.use(XGBModel.load_bytes(blob, features=holder.features), meta["version"])
    return meta["version"]


def retrain(trainer: Trainer, records: RecordStore, models: ModelStore, holder: NewestModel) -> RetrainReport:
    """Read new records, train when there is enough data and something new, store, and swap in."""
    import time
    t0 = time.perf_counter()
    new = trainer.read_new(records)
    n = trainer.xgb.n_programs
    if n < max(MIN_FIT_PROGRAMS, trainer.warmup):
        return RetrainReport(False, holder.version, n, new, f"{n} programs in the history; training starts at "
                             f"{max(MIN_FIT_PROGRAMS, trainer.warmup)}", seconds=time.perf_counter() - t0)
    if new == 0 and holder.version:
        return RetrainReport(False, holder.version, n, 0, "no new records since the last training",
                             seconds=time.perf_counter() - t0)
    metrics = trainer.xgb.fit()
    if metrics is None:
        return RetrainReport(False, holder.version, n, new, "too few programs to train",
                             seconds=time.perf_counter() - t0)
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.as_dict().items()}
    blob = trainer.xgb.save_bytes()
    version = models.save(trainer.target, blob, clean, record_count=n, kind=MODEL_KIND)
    holder.use(XGBModel.load_bytes(blob, features=holder.features), version)      # exactly the stored bytes
    return RetrainReport(True, version, n, new, "trained", clean, time.perf_counter() - t0)
