"""Featurizer: the features of every task's programs, on all the machine's cores.

Feature extraction is most of a search round (TVM runs it in a parallel_for over states). A round's
programs fall into a few hundred structures; each structure is dealt to one process by a stable hash
of its key, so every process keeps the templates of its own structures warm from call to call, and
the calling process takes one share itself. Workers get plain data (the task as JSON, and per
structure its key, one program's steps and the numbers of all of them) and send back float32
features, which is what XGBoost reads anyway. A worker that dies costs nothing but time: its share
is computed here and the worker is started afresh on the next call.

A Featurizer outlives cost-model versions (the flow loads a new model at every retrain), so its
templates and processes are made once per tuning run.
"""
from __future__ import annotations

import atexit
import json
import logging
import multiprocessing
import os
import threading
import time
import weakref
import zlib
from concurrent.futures import BrokenExecutor, Future, ProcessPoolExecutor
from typing import Sequence

import numpy as np

from tensortune.schedule.program import Program
from tensortune.schedule.state import State
from tensortune.search.feature import FeatureExtractor
from tensortune.search.memory import paused_gc
from tensortune.tasks.search_task import SearchTask

log = logging.getLogger("tensortune.search")

MAX_PROCESSES = 7


def default_processes() -> int:
    """Helper processes beside the caller: one per other core (none inside a daemonic process,
    such as a Dask worker, which may not start children)."""
    if multiprocessing.current_process().daemon:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(MAX_PROCESSES, cores - 1))


class Featurizer:
    """One FeatureExtractor per task, and the helper processes they share."""

    def __init__(self, processes: int | None = None, min_batch: int = 512):
        self.processes = default_processes() if processes is None else processes
        self.min_batch = min_batch            # smaller calls are not worth a round trip
        self.extractors: dict[str, FeatureExtractor] = {}
        self._executors: list[ProcessPoolExecutor | None] = [None] * self.processes
        self._finalizer = weakref.finalize(self, _shutdown, self._executors)

    def extractor(self, task: SearchTask) -> FeatureExtractor:
        ex = self.extractors.get(task.workload_key)
        if ex is None:
            ex = self.extractors[task.workload_key] = FeatureExtractor(task)
        return ex

    def __call__(self, task: SearchTask, states: Sequence[Program]) -> list[np.ndarray]:
        """One [n_stores, 164] matrix per state."""
        ex = self.extractor(task)
        groups = list(ex.groups(states).items())
        ways = self.processes + 1 if self.processes and len(states) >= self.min_batch else 1
        shares: list[list[tuple[str, list[int]]]] = [[] for _ in range(ways)]
        for key, idx in groups:
            shares[zlib.crc32(key.encode()) % ways].append((key, idx))
        pending: list[tuple[int, list, Future | None]] = []
        for worker in range(1, ways):
            if shares[worker]:
                jobs = [(key, _steps_json(states[idx[0]]), ex.numbers(states, idx)) for key, idx in shares[worker]]
                pending.append((worker, shares[worker], self._submit(worker - 1, task, jobs)))
        out: list[np.ndarray | None] = [None] * len(states)
        self._place(out, shares[0], [ex.evaluate(key, states[idx[0]], ex.numbers(states, idx))
                                     for key, idx in shares[0]])
        for worker, share, future in pending:
            feats = self._result(worker - 1, future)
            if feats is None:
                feats = [ex.evaluate(key, states[idx[0]], ex.numbers(states, idx)) for key, idx in share]
            self._place(out, share, feats)
        return out  # type: ignore[return-value]

    @staticmethod
    def _place(out: list, share: list[tuple[str, list[int]]], feats: list[np.ndarray]) -> None:
        for (_, idx), block in zip(share, feats):
            for j, i in enumerate(idx):
                out[i] = block[j]

    def _submit(self, n: int, task: SearchTask, jobs: list) -> Future | None:
        for _ in range(2):
            try:
                executor = self._executors[n]
                if executor is None:
                    executor = self._executors[n] = ProcessPoolExecutor(
                        1, mp_context=multiprocessing.get_context("spawn"), initializer=_start_helper,
                        initargs=(os.getpid(),))
                return executor.submit(_extract, task.workload_key, task.to_json(), jobs)
            except BrokenExecutor:                 # its process died since the last call: start afresh
                self._drop(n)
            except (OSError, RuntimeError) as exc:  # cannot start processes here: do without them
                log.warning("feature workers cannot start here (%s); extracting features in this "
                            "process only", str(exc).strip().splitlines()[0])
                self.close()
                self.processes = 0
                return None
        return None

    def _result(self, n: int, future: Future | None) -> list[np.ndarray] | None:
        if future is None:
            return None
        try:
            return future.result()
        except Exception as exc:  # noqa: BLE001 - a dead worker (BrokenProcessPool) or a bug in it
            log.warning("feature worker %d failed (%s: %s); computing its share here", n,
                        type(exc).__name__, exc)
            self._drop(n)
            return None

    def _drop(self, n: int) -> None:
        executor, self._executors[n] = self._executors[n], None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the helper processes (they also stop when this object is collected or at exit)."""
        self._finalizer()


def _shutdown(executors: list) -> None:
    for n, executor in enumerate(executors):
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
            executors[n] = None


def _steps_json(program) -> str:
    return json.dumps([s.to_json() for s in program.steps], separators=(",", ":"))


def _start_helper(parent: int) -> None:
    """In a helper, first: exit at once when the pool shuts it down, and when the parent is gone.

    At shutdown the interpreter would free the helper's heap object by object and run the cyclic GC
    over it: with a night's templates (2 GB) that took two helpers minutes of CPU after the search had
    ended, while the benchmark timed its networks (ONNX Runtime ran 2.5x slower, our ResNet-18 3x).
    Nothing in a helper needs finalising (its results went back before the shutdown message came),
    so the first exit handler ends the process. A killed parent cannot tell us it is gone: we would
    wait forever, so a thread watches."""
    atexit.register(os._exit, 0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


_EXTRACTORS: dict[str, FeatureExtractor] = {}  # inside a helper process: its templates, per task


def _extract(workload_key: str, task_json: str, jobs: list[tuple[str, str, np.ndarray]]) -> list[np.ndarray]:
    """A helper's share: features of each structure's programs."""
    ex = _EXTRACTORS.get(workload_key)
    if ex is None:
        ex = _EXTRACTORS[workload_key] = FeatureExtractor(SearchTask.from_json(task_json))
    out = []
    with paused_gc():
        for key, steps, numbers in jobs:
            representative = None if key in ex.templates else State.from_json(ex.task.dag, steps)
            out.append(ex.evaluate(key, representative, numbers).astype(np.float32))
    return out
