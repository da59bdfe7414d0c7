"""The cost-model features of a store's programs, as a resumed run and the retrain step read them: from
the store's feature cache (storage.feature_cache) where it holds them, computed and saved where not.

A cached matrix says more than its numbers. It was computed from the program replayed under the code
that names the cache's folder (the search/, schedule/ and tasks/ sources: search.feature_pool.
feature_code_digest), and a replay is deterministic, so a program the cache holds replays under today's
rules. A resume need not replay it to know that, only parse its steps: 0.45 s against 2.9 s for the 6000
programs of a ResNet-50 store on the Xeon VM, where the replay was most of the flow's load-history step.
Its loops are replayed later, if something needs them (search.candidate.Candidate.state).

One object per store and reader: it loads the cache once, when made; `done()` saves what was computed
and lets go of the matrices (the model that took them holds them), so a reader that comes back for the
store's newer records (the retrain step, every round) computes and saves only those.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from tensortune.schedule.state import State
from tensortune.search.candidate import Candidate
from tensortune.search.cost_model import XGBModel
from tensortune.search.feature_pool import feature_code_digest
from tensortune.storage.feature_cache import FeatureCache, Key, digest
from tensortune.storage.records import RecordStore
from tensortune.tasks.search_task import SearchTask

log = logging.getLogger("tensortune.flows")


class StoredFeatures:
    """`StoredFeatures(records)`: the features `records` keeps for its programs, and those computed here.
    enabled=False (or an install without the sources that name the cache, feature_code_digest "") keeps
    nothing and computes everything."""

    def __init__(self, records: RecordStore, enabled: bool = True):
        code = feature_code_digest() if enabled else ""
        self.url = records.location.url
        self.cache = FeatureCache(self.url, code, filesystem=records.location.fs) if code else None
        self.known: dict[Key, np.ndarray] = self.cache.load() if self.cache is not None else {}
        self.computed: dict[Key, np.ndarray] = {}

    @staticmethod
    def task_digest(task: SearchTask) -> str:
        """The first half of a program's key; writing a task's description out takes ~3 ms, so a caller
        makes it once per task, and only for a task with a program to look up."""
        return digest(task.to_json())

    @staticmethod
    def key(task_digest: str, steps: str) -> Key:
        return task_digest, digest(steps)

    def holds(self, key: Key) -> bool:
        """The program's features are known: so it replays under today's rules (see the module)."""
        return key in self.known or key in self.computed

    def program(self, task: SearchTask, key: Key, steps: str) -> Candidate:
        """The stored program `steps`: parsed where the features are held, replayed where not (raises
        IllegalStep when today's rules refuse it)."""
        if self.holds(key):
            return Candidate(task.dag, State.parse_steps(steps))
        return Candidate.of(State.from_json(task.dag, steps))

    def matrices(self, model: XGBModel, task: SearchTask, keys: Sequence[Key],
                 programs: Sequence[Candidate]) -> list[np.ndarray]:
        """The features of each program (keys[i] names programs[i]): held ones as they are, the others
        computed by `model`'s featurizer, once a key."""
        todo = {k: programs[i] for i, k in enumerate(keys) if not self.holds(k)}
        if todo:
            self.computed.update(zip(todo, model.features(task, list(todo.values()))))
        return [self.known[k] if k in self.known else self.computed[k] for k in keys]

    def done(self) -> None:
        """Save what was computed (a store this process may read but not write trains all the same) and
        let go of every matrix."""
        if self.cache is not None and self.computed:
            try:
                self.cache.save(self.computed)
            except OSError as err:
                log.warning("features not cached in %s: %s", self.url, err)
        self.known, self.computed = {}, {}
