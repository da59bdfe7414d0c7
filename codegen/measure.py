"""Measuring candidates: build in parallel, time in isolated long-lived runners (TVM's protocol).

Everything that crosses a process boundary is plain data: the task JSON, the step JSON and the
artifact bytes. A kernel that crashes or hangs costs its own record; the pools replace the worker.
"""
from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from tensortune.codegen.artifact import Artifact
from tensortune.codegen.recent_builds import RecentBuilds
from tensortune.codegen.timing import LATER_PASSES_WITHIN, OPERATOR_TIMING, ErrorCode, TimingConfig, reference_file
from tensortune.codegen.worker_pool import JobResult, WorkerPool
from tensortune.tasks.search_task import SearchTask


@dataclass
class BuildResult:
    artifact: Artifact | None
    error_code: int
    error_msg: str
    seconds: float


@dataclass
class MeasureResult:
    costs: list[float]            # seconds per run, one entry per repeat (of every pass)
    error_code: int
    error_msg: str = ""
    build_seconds: float = 0.0
    run_seconds: float = 0.0
    timestamp: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)
    fastest: bool = False         # the figure is the fastest cost (interleaved passes), not their mean

    @property
    def latency(self) -> float:
        """The program's figure, which records store and the search ranks by: the mean of its repeats
        (TVM's), or the fastest of them when they are interleaved passes (TimingConfig.passes)."""
        if not self.costs or self.error_code != 0:
            return math.inf
        return float(min(self.costs)) if self.fastest else float(np.mean(self.costs))

    @property
    def ok(self) -> bool:
        return self.error_code == ErrorCode.NO_ERROR

    @property
    def lost(self) -> bool:
        """The measuring lost the program, which says nothing about it: UNKNOWN_ERROR, which only the
        cluster's measurer gives (a worker or the scheduler gone, a round's deadline passed). A build
        error, a crash, a wrong answer or a timeout is the program's own."""
        return self.error_code == ErrorCode.UNKNOWN_ERROR


# ------------------------------------------------------------------------------- jobs (in workers)

@lru_cache(maxsize=32)
def _task(task_json: str) -> SearchTask:
    return SearchTask.from_json(task_json)


def build_job(payload: tuple) -> Artifact:
    """(task_json, steps_json, keep_source) -> Artifact; runs in a builder process."""
    task_json, steps_json, keep_source = payload
    from tensortune.schedule.state import State
    task = _task(task_json)
    state = State.from_json(task.dag, steps_json)
    if task.target_kind == "cuda":
        from tensortune.codegen.cuda_backend import build as build_cuda
        return build_cuda(state, task.target, keep_source, hardware=task.hardware)
    from tensortune.codegen.llvm_backend import build
    return build(state, task.target, keep_source, rewrite=task.layout_rewrite)


def run_job(payload: tuple) -> tuple[list[float], int, str]:
    """(task_json, artifact, TimingConfig) -> (costs, error_code, message); runs in a runner process."""
    task_json, artifact, cfg = payload
    if artifact.kind == "cuda":
        from tensortune.codegen.cuda_backend import run_artifact as run_cuda
        return run_cuda(_task(task_json), artifact, cfg)
    from tensortune.codegen.llvm_backend import run_artifact as run_llvm
    return run_llvm(_task(task_json), artifact, cfg)


# ------------------------------------------------------------------------------- builder & runner

def _error_of(r: JobResult, compile_code: ErrorCode, timeout_code: ErrorCode) -> tuple[int, str]:
    if r.kind == "timeout":
        return int(timeout_code), r.error
    if r.kind == "crash":
        return int(compile_code), r.error
    first = r.error.splitlines()[0] if r.error else ""
    if first.startswith(("IllegalStep", "LoweringError", "KeyError")):
        return int(ErrorCode.INSTANTIATION_ERROR), r.error
    return int(compile_code), r.error


class LocalBuilder:
    """Builds candidates in parallel processes (one per core by default)."""

    def __init__(self, n_parallel: int | None = None, timeout: float = 15.0):
        self.pool = WorkerPool("tensortune.codegen.measure:build_job", n_parallel or (os.cpu_count() or 1), timeout)

    def build(self, task: SearchTask, steps_list: Sequence[str], keep_source: bool = False) -> list[BuildResult]:
        tj = task.to_json()
        return self.build_many([(tj, s) for s in steps_list], keep_source)

    def build_many(self, programs: Sequence[tuple[str, str]], keep_source: bool = False) -> list[BuildResult]:
        """Build (task JSON, steps) pairs of any tasks, all in one go across the processes."""
        out = []
        for r in self.pool.map([(tj, s, keep_source) for tj, s in programs]):
            if r.ok:
                out.append(BuildResult(r.value, 0, "", r.seconds))
            else:
                code, msg = _error_of(r, ErrorCode.COMPILE_HOST, ErrorCode.BUILD_TIMEOUT)
                out.append(BuildResult(None, code, msg, r.seconds))
        return out

    def close(self) -> None:
        self.pool.close()


class LocalRunner:
    """Times artifacts one at a time (measurements must not share the machine) in a long-lived process."""

    def __init__(self, timeout: float = 10.0, config: TimingConfig = OPERATOR_TIMING, n_parallel: int = 1,
                 env: dict | None = None):
        """env: extra environment for the runner processes. A kernel's thread count is its target's,
        compiled in: OMP_NUM_THREADS here cannot change it (name `-num-threads` in the target instead)."""
        self.config = config
        self.pool = WorkerPool("tensortune.codegen.measure:run_job", n_parallel, timeout, env)

    def run(self, task: SearchTask, builds: Sequence[BuildResult]) -> list[MeasureResult]:
        """Time every built program, `config.passes` times over: each pass times, in the batch's order,
        the programs that have not failed and are within LATER_PASSES_WITHIN of the batch's fastest so
        far, so a slow spell of the machine falls on one pass of a program rather than on all its
        timings, and a slow program (whose one run may fill a pass) is timed once. The first pass checks
        the outputs; a later one that fails makes the program's result that failure (its timings
        kept), as a re-timing does (codegen.confirmation): a kernel that crashes when run again is no best."""
        tj = task.to_json()
        cfg = self.config
        passes = max(1, cfg.passes)
        out = [MeasureResult([], b.error_code, b.error_msg, b.seconds, fastest=passes > 1) for b in builds]
        todo = [i for i, b in enumerate(builds) if b.artifact is not None]
        per_pass = replace(cfg, min_repeat_ms=cfg.min_repeat_ms / passes)
        checked = replace(per_pass, reference=reference_file(task)) if cfg.check_correctness and todo else per_pass
        unchecked = replace(per_pass, check_correctness=False)
        for n in range(passes):
            results = self.pool.map([(tj, builds[i].artifact, checked if n == 0 else unchecked) for i in todo])
            for i, r in zip(todo, results):
                if r.ok:
                    costs, code, msg = r.value
                else:
                    costs, (code, msg) = [], _error_of(r, ErrorCode.RUNTIME_DEVICE, ErrorCode.RUN_TIMEOUT)
                out[i] = replace(out[i], costs=out[i].costs + list(costs), error_code=code, error_msg=msg,
                                 run_seconds=out[i].run_seconds + r.seconds)
            fastest = min((out[i].latency for i in todo), default=math.inf)
            todo = [i for i in todo if out[i].ok and out[i].latency <= LATER_PASSES_WITHIN * fastest]
        return out

    def close(self) -> None:
        self.pool.close()


class Measurer(Protocol):
    """What a tuning loop needs of a measurer: ProgramMeasurer here, flows.dask_measure's DaskMeasurer on
    a cluster. `steps_list` holds each program's step JSON; one result per program, in order."""

    def measure(self, task: SearchTask, steps_list: Sequence[str]) -> list[MeasureResult]: ...

    def close(self) -> None: ...


@runtime_checkable
class BuildsAhead(Protocol):
    """A measurer that builds many tasks' programs in one go before timing any of them, keeping the
    builds for the measure() calls that time them: a resumed network's re-timing, three stored programs
    of each task, kept cores idle when each task's three were built as a batch of their own."""

    def build_ahead(self, batches: Sequence[tuple[SearchTask, Sequence[str]]]) -> None: ...


@runtime_checkable
class Prebuilder(Protocol):
    """A measurer that can build a batch while it times another (DaskMeasurer, where some builders
    share no node with a timing): the flow then searches and builds round k+1 during round k's timings."""

    def prebuild_workers(self, task: SearchTask) -> list[str]: ...

    def prebuild(self, task: SearchTask, steps_list: Sequence[str]) -> bool: ...


class ProgramMeasurer:
    """Builder + runner: `measure(task, steps_json_list)` -> one MeasureResult per program."""

    def __init__(self, builder: LocalBuilder | None = None, runner: LocalRunner | None = None):
        self.builder = builder or LocalBuilder()
        self.runner = runner or LocalRunner()
        self.recent: RecentBuilds[BuildResult] = RecentBuilds()

    def measure(self, task: SearchTask, steps_list: Sequence[str]) -> list[MeasureResult]:
        """A program listed more than once, or built by one of the last calls (timed again:
        codegen.confirmation), is built once."""
        tj = task.to_json()
        unique = list(dict.fromkeys(steps_list))
        built = {s: b for s in unique if (b := self.recent.get(tj, s)) is not None}
        new = [s for s in unique if s not in built]
        for s, b in zip(new, self.builder.build(task, new) if new else []):
            built[s] = b
            if b.artifact is not None:
                self.recent.put(tj, s, b)
        return self.runner.run(task, [built[s] for s in steps_list])

    def build_ahead(self, batches: Sequence[tuple[SearchTask, Sequence[str]]]) -> None:
        """Build the programs of every batch not built already, all at once; the ones that built are
        kept (as many as `recent` holds) for the measure() calls that time them."""
        todo = list(dict.fromkeys((task.to_json(), s) for task, steps_list in batches for s in steps_list))
        todo = [(tj, s) for tj, s in todo if self.recent.get(tj, s) is None][:self.recent.size]
        for (tj, s), b in zip(todo, self.builder.build_many(todo) if todo else []):
            if b.artifact is not None:
                self.recent.put(tj, s, b)

    def close(self) -> None:
        self.builder.close()
        self.runner.close()

    def __enter__(self) -> "ProgramMeasurer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
