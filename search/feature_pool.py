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
        # prefetches not yet asked for: (helper, workload key, program keys per structure, future)
        self._prefetches: list[tuple[int, str, list[list], Future]] = []
        self._inflight: dict[str, set] = {}      # workload key -> keys of its programs being prefetched
        self._finalizer = weakref.finalize(self, _shutdown, self._executors)

    def extractor(self, task: SearchTask) -> FeatureExtractor:
        ex = self.extractors.get(task.workload_key)
        if ex is None:
            ex = self.extractors[task.workload_key] = FeatureExtractor(task)
        return ex

    def __call__(self, task: SearchTask, states: Sequence[Program]) -> list[np.ndarray]:
        """One [n_stores, 164] matrix per state; those of programs handed to `prefetch` come from the
        helpers that computed them meanwhile."""
        inflight = self._inflight.pop(task.workload_key, set())
        prefetched = [p for p in self._prefetches if p[1] == task.workload_key]
        self._prefetches = [p for p in self._prefetches if p[1] != task.workload_key]
        todo = [i for i, s in enumerate(states) if _program_key(s) not in inflight] if inflight else \
            list(range(len(states)))
        out: list[np.ndarray | None] = [None] * len(states)
        for i, f in zip(todo, self._compute(task, [states[i] for i in todo])):
            out[i] = f
        if len(todo) < len(states):
            ready: dict = {}
            for n, _, keys, future in prefetched:
                feats = self._result(n, future)
                for program_keys, block in zip(keys, feats or ()):
                    ready.update(zip(program_keys, block))
            missing: list[int] = []
            for i, s in enumerate(states):
                if out[i] is None:
                    got = ready.get(_program_key(s))
                    if got is None:
                        missing.append(i)
                    else:
                        out[i] = got
            # a helper died with its prefetch: those programs are computed here
            for i, f in zip(missing, self._compute(task, [states[i] for i in missing], helpers=False)):
                out[i] = f
        # prefetches of programs not asked for are left to finish unread
        return out  # type: ignore[return-value]

    def prefetch(self, task: SearchTask, programs: Sequence[Program]) -> None:
        """Start the helpers on their share of `programs` (programs with a `key`, as Candidates) now, so
        that the next call asking for them finds them computed while this process went on (sampling or
        mutating the population the call will score). The share is the one a call would give them (the
        same stable hash), so each structure's template stays in one process; the rest is left to that
        call. Without helpers nothing happens."""
        if not self.processes:
            return
        for other in [p for p in self._prefetches if p[1] != task.workload_key]:   # another task's: unread
            self._prefetches.remove(other)
            self._inflight.pop(other[1], None)
        inflight = self._inflight.setdefault(task.workload_key, set())
        fresh: dict = {}
        for s in programs:
            key = _program_key(s)
            if key is not None and key not in inflight:
                fresh.setdefault(key, s)
        if not fresh:
            return
        ex = self.extractor(task)
        states = list(fresh.values())
        shares = self._shares(ex, states, self.processes + 1)
        for worker in range(1, len(shares)):
            if not shares[worker]:
                continue
            jobs = [(key, _steps_json(states[idx[0]]), ex.numbers(states, idx)) for key, idx in shares[worker]]
            future = self._submit(worker - 1, task, jobs)
            if future is None:
                return
            keys = [[_program_key(states[i]) for i in idx] for _, idx in shares[worker]]
            self._prefetches.append((worker - 1, task.workload_key, keys, future))
            inflight.update(k for ks in keys for k in ks)

    def _compute(self, task: SearchTask, states: Sequence[Program], helpers: bool = True) -> list[np.ndarray]:
        """Features of `states`: the helpers' shares sent off, this process's share computed meanwhile."""
        if not states:
            return []
        ex = self.extractor(task)
        ways = self.processes + 1 if helpers and self.processes and len(states) >= self.min_batch else 1
        shares = self._shares(ex, states, ways)
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
    def _shares(ex: FeatureExtractor, states: Sequence[Program], ways: int) -> list[list[tuple[str, list[int]]]]:
        """Each structure's programs, dealt to `ways` processes by a stable hash of its key (0: this one)."""
        shares: list[list[tuple[str, list[int]]]] = [[] for _ in range(ways)]
        for key, idx in ex.groups(states).items():
            shares[zlib.crc32(key.encode()) % ways].append((key, idx))
        return shares

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
                        1, mp_context=multiprocessing.get_context("spawn"), initializer=_watch_parent,
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


def _program_key(program):
    """A program's identity (a Candidate's step key), or None for one without (a State)."""
    return getattr(program, "key", None)


def _steps_json(program) -> str:
    return json.dumps([s.to_json() for s in program.steps], separators=(",", ":"))


def _watch_parent(parent: int) -> None:
    """In a helper: exit when the parent is gone (killed, it cannot tell us; we would wait forever)."""
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
