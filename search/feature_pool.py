"""Featurizer: the features of every task's programs, on all the machine's cores.

Feature extraction is most of a search round (TVM runs it in a parallel_for over states). A round's
programs' parts fall into a few hundred structures (`feature_parts`); each structure is dealt to one
helper process (`helper_pool.HelperPool`) by a stable hash of its key, so every helper keeps the
templates of its own structures warm from call to call, and the calling process takes one share itself.
Helpers get plain data (the task as JSON, and per part structure its key, one member's steps and part,
and the numbers of all its members) and send back float32 features, which is what XGBoost reads anyway;
the rows made here are float32 too, so a program's features are the same numbers whichever process made
each part. A helper that dies costs nothing but time: its share is computed here. Only the parts not met
before are evaluated at all (`part_rows.PartRows`: most of an evolved child's parts are its parent's).

A Featurizer outlives cost-model versions (the flow loads a new model at every retrain), so its
templates and helpers are made once per tuning run; the search samples on the same helpers
(`CostModel.helpers`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np

from tensortune.schedule.program import Program
from tensortune.schedule.state import State
from tensortune.search.feature import FeatureExtractor
from tensortune.search.feature_parts import Part
from tensortune.search.helper_pool import HelperPool, run_shares
from tensortune.search.memory import paused_gc
from tensortune.search.part_rows import PartRows
from tensortune.tasks.search_task import SearchTask

# the packages whose code decides a program's features: the arrows (search -> schedule -> tasks) let
# nothing else reach them, and numpy computes them
_FEATURE_PACKAGES = ("search", "schedule", "tasks")


@functools.lru_cache(maxsize=None)
def feature_code_digest() -> str:
    """A digest of the code that computes features: stored features are valid for the code of the same
    digest only (storage.feature_cache). Any edit of those files changes it, a cautious rule: a stale
    cache is recomputed, never read. "" where the sources are not there to read (an install of
    compiled files only): no cache then."""
    return source_digest(Path(__file__).resolve().parent.parent, _FEATURE_PACKAGES)


def source_digest(root: Path, packages: Sequence[str]) -> str:
    """Every Python source file of `packages` under `root` (paths and bytes), and numpy's version; ""
    when a package has none."""
    h = hashlib.blake2b(np.__version__.encode(), digest_size=16)
    for package in packages:
        sources = sorted((root / package).rglob("*.py"))
        if not sources:
            return ""
        for path in sources:
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# a part structure among a call's programs: its key, its members, their numbers, those with no rows kept
_LookedUp = tuple[str, list[tuple[int, Part]], np.ndarray, np.ndarray]


class Featurizer:
    """One FeatureExtractor per task, and the helper processes they share."""

    def __init__(self, processes: int | None = None, min_batch: int = 512, helpers: HelperPool | None = None):
        self.helpers = helpers if helpers is not None else HelperPool(processes)
        self.min_batch = min_batch            # smaller calls are not worth a round trip
        self.extractors: dict[str, FeatureExtractor] = {}
        self.part_rows = PartRows()           # every task's, keyed by workload key + part structure

    def extractor(self, task: SearchTask) -> FeatureExtractor:
        ex = self.extractors.get(task.workload_key)
        if ex is None:
            ex = self.extractors[task.workload_key] = FeatureExtractor(task)
        return ex

    def __call__(self, task: SearchTask, states: Sequence[Program]) -> list[np.ndarray]:
        """One [n_stores, 164] float32 matrix per state (the same numbers whichever process made them, and
        whether made now or kept from an earlier call: `part_rows`)."""
        ex = self.extractor(task)
        kept = self.part_rows
        kept.trim()
        processes = self.helpers.processes
        ways = processes + 1 if processes and len(states) >= self.min_batch else 1
        shares: list[list[tuple[str, list[tuple[int, Part]]]]] = [[] for _ in range(ways)]
        for key, members in ex.groups(states).items():
            shares[zlib.crc32(key.encode()) % ways].append((key, members))
        task_json = task.to_json() if ways > 1 else ""
        # each share's groups with their members' numbers and the numbers with no rows kept, looked up as
        # the share is sent (a helper's) or computed (this process's, while the helpers work)
        looked_up: dict[int, list[_LookedUp]] = {}

        def kept_as(key: str) -> str:
            """Rows are kept per task: part keys name steps, not shapes."""
            return task.workload_key + key

        def look_up(i: int) -> list[_LookedUp]:
            if i not in looked_up:
                looked_up[i] = []
                for key, members in shares[i]:
                    numbers = ex.numbers(states, members)
                    looked_up[i].append((key, members, numbers, kept.new_numbers(kept_as(key), numbers)))
            return looked_up[i]

        def to_evaluate(i: int) -> list[_LookedUp]:
            return [group for group in look_up(i) if len(group[3])]

        def job(i: int) -> tuple:
            return _extract, (task.workload_key, task_json,
                              [(key, _steps_json(states[members[0][0]]), members[0][1], new)
                               for key, members, _, new in to_evaluate(i)])

        def here(i: int) -> list[np.ndarray]:
            return [ex.evaluate(key, states[members[0][0]], members[0][1], new)
                    for key, members, _, new in to_evaluate(i)]
        blocks = run_shares(self.helpers, range(ways), lambda i: i - 1 if i and shares[i] else None, job, here)
        out, starts = ex.rows(states, np.float32)
        for i, made in enumerate(blocks):
            for (key, _, _, new), block in zip(to_evaluate(i), made):
                kept.keep(kept_as(key), new, block)
            for key, members, numbers, _ in looked_up[i]:
                ex.place(out, starts, members, kept.block(kept_as(key), numbers))
        return ex.split(out, starts)

    def close(self) -> None:
        """Stop the helper processes (they also stop when the pool is collected or at exit)."""
        self.helpers.close()


def _steps_json(program) -> str:
    return json.dumps([s.to_json() for s in program.steps], separators=(",", ":"))


_EXTRACTORS: dict[str, FeatureExtractor] = {}  # inside a helper process: its templates, per task


def _extract(workload_key: str, task_json: str, jobs: list[tuple[str, str, Part, np.ndarray]]) -> list[np.ndarray]:
    """A helper's share: features of each part structure's members."""
    ex = _EXTRACTORS.get(workload_key)
    if ex is None:
        ex = _EXTRACTORS[workload_key] = FeatureExtractor(SearchTask.from_json(task_json))
    out = []
    with paused_gc():
        for key, steps, part, numbers in jobs:
            representative = None if key in ex.templates else State.from_json(ex.task.dag, steps)
            out.append(ex.evaluate(key, representative, part, numbers).astype(np.float32))
    return out
