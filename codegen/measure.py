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
from enum import IntEnum
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np

from codegen.artifact import Artifact
from codegen.worker_pool import JobResult, WorkerPool
from tasks.search_task import SearchTask


class ErrorCode(IntEnum):
    """TVM's MeasureErrorNo."""
    NO_ERROR = 0
    INSTANTIATION_ERROR = 1
    COMPILE_HOST = 2
    COMPILE_DEVICE = 3
    RUNTIME_DEVICE = 4
    WRONG_ANSWER = 5
    BUILD_TIMEOUT = 6
    RUN_TIMEOUT = 7
    UNKNOWN_ERROR = 8


@dataclass(frozen=True)
class TimingConfig:
    """number runs per repeat (raised until a repeat lasts min_repeat_ms), repeat repeats, optional flush."""
    number: int = 3
    repeat: int = 1
    min_repeat_ms: float = 100.0
    flush_cache: bool = False
    check_correctness: bool = True
    warmup: int = 1
    reference: str | None = None      # the task's reference file (set by the runner; see reference_file)
    slow_factor: float = 20.0         # one run this many times slower than the best seen: stop timing (0: off)


@dataclass
class BuildResult:
    artifact: Artifact | None
    error_code: int
    error_msg: str
    seconds: float


@dataclass
class MeasureResult:
    costs: list[float]            # seconds per run, one entry per repeat
    error_code: int
    error_msg: str = ""
    build_seconds: float = 0.0
    run_seconds: float = 0.0
    timestamp: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)

    @property
    def mean(self) -> float:
        return float(np.mean(self.costs)) if self.costs and self.error_code == 0 else math.inf

    @property
    def ok(self) -> bool:
        return self.error_code == ErrorCode.NO_ERROR


def time_runs(run_n: Callable[[int], None], cfg: TimingConfig, flush: Callable[[], None] | None = None,
              warm: bool = False, cutoff_s: float | None = None) -> list[float]:
    """TVM's time_evaluator: warm up, pick `number` so one repeat lasts >= min_repeat_ms, time `repeat`
    repeats. A kernel whose single run already lasts min_repeat_ms runs once per repeat (the run that
    found it so counts as the first), and one slower than `cutoff_s` is not timed further (slow
    candidates should not cost the tuner seconds each).

    With `flush_cache`, the cache is flushed before every timed run and a repeat is the mean of `number`
    cold runs (min_repeat_ms does not apply). TVM flushes once per repeat, so only the first of its
    `number` runs is cold unless number=1, which its docs recommend; here every run is cold."""
    if not warm:
        for _ in range(cfg.warmup):
            run_n(1)
    if cfg.flush_cache and flush is not None:
        number = max(1, cfg.number)
        costs = []
        for _ in range(max(cfg.repeat, 1) * number):
            flush()
            t0 = time.perf_counter()
            run_n(1)
            costs.append(time.perf_counter() - t0)
        return [float(np.mean(costs[i:i + number])) for i in range(0, len(costs), number)]
    t0 = time.perf_counter()
    run_n(1)
    once = max(time.perf_counter() - t0, 1e-9)
    if cutoff_s is not None and once > cutoff_s:
        return [once]
    costs = []
    if once * 1e3 >= cfg.min_repeat_ms:
        number = 1
        costs.append(once)          # a warm run that already fills a repeat: it is the first repeat
    else:
        number = int(min(max(cfg.number, math.ceil(cfg.min_repeat_ms / 1e3 / once)), 1_000_000))
    for _ in range(max(cfg.repeat, 1) - len(costs)):
        t0 = time.perf_counter()
        run_n(number)
        costs.append((time.perf_counter() - t0) / number)
    return costs


_FLUSH_BYTES = 64 << 20


@lru_cache(maxsize=1)
def _flush_buffer() -> np.ndarray:
    return np.zeros(_FLUSH_BYTES // 8)


def flush_cpu_cache() -> None:
    buf = _flush_buffer()
    buf += 1.0


# ------------------------------------------------------------------------------- jobs (in workers)

# The fastest run each runner process has timed per task: a per-process cache, so a candidate far
# slower than what this node already measured is timed once, not `repeat` times.
_BEST_SEEN: dict[str, float] = {}


@lru_cache(maxsize=32)
def _task(task_json: str) -> SearchTask:
    return SearchTask.from_json(task_json)


REFERENCE_SEED = 1234


def reference_file(task: SearchTask, cache_dir: str | None = None) -> str:
    """Inputs and reference outputs of a task, computed once (outside any kernel's timeout) and kept
    on disk so every runner process loads them instead of recomputing."""
    import tempfile
    from tasks.reference import evaluate
    folder = cache_dir or os.path.join(tempfile.gettempdir(), "tensortune-reference")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{task.workload_key}-{REFERENCE_SEED}.npz")
    if not os.path.exists(path):
        inputs = task.dag.random_inputs(seed=REFERENCE_SEED)
        refs = evaluate(task.dag, inputs)
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(tmp, *inputs, *refs)
        os.replace(tmp, path)
    return path


@lru_cache(maxsize=8)
def load_reference(path: str, n_inputs: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(inputs, reference outputs) saved by reference_file."""
    with np.load(path) as data:
        arrays = [data[f"arr_{i}"] for i in range(len(data.files))]
    return arrays[:n_inputs], arrays[n_inputs:]


def build_job(payload: tuple) -> Artifact:
    """(task_json, steps_json, keep_source) -> Artifact; runs in a builder process."""
    task_json, steps_json, keep_source = payload
    from search.state import State
    task = _task(task_json)
    state = State.from_json(task.dag, steps_json)
    if task.target_kind == "cuda":
        from codegen.cuda_backend import build as build_cuda
        return build_cuda(state, task.target, keep_source, hardware=task.hardware)
    from codegen.llvm_backend import build
    return build(state, task.target, keep_source)


def run_job(payload: tuple) -> tuple[list[float], int, str]:
    """(task_json, artifact, TimingConfig) -> (costs, error_code, message); runs in a runner process."""
    task_json, artifact, cfg = payload
    from tasks.reference import mismatch
    if artifact.kind == "cuda":
        from codegen.cuda_backend import run_artifact
        return run_artifact(_task(task_json), artifact, cfg)
    from codegen.llvm_backend import LLVMKernel, set_default_threads
    task = _task(task_json)
    threads = task.hardware.num_cores
    set_default_threads(threads)
    kernel = LLVMKernel(artifact)
    if cfg.check_correctness and cfg.reference:
        inputs, refs = load_reference(cfg.reference, len(task.dag.inputs))
        outs = [np.full(t.shape, np.nan, dtype=t.dtype) if np.issubdtype(np.dtype(t.dtype), np.floating)
                else np.zeros(t.shape, dtype=t.dtype) for t in task.dag.outputs]
        kernel(*inputs, *outs)
        for t, out, ref in zip(task.dag.outputs, outs, refs):
            bad = mismatch(out, ref)
            if bad is not None:
                return [], int(ErrorCode.WRONG_ANSWER), f"{t.name}: {bad}"
        args = list(inputs) + outs
    else:
        args = task.dag.random_inputs(seed=7) + task.dag.empty_outputs()
    packed = kernel.pack(args)
    warm = cfg.check_correctness and cfg.reference is not None        # the check already ran it
    best = _BEST_SEEN.get(task.workload_key)
    cutoff = best * cfg.slow_factor if best is not None and cfg.slow_factor > 0 else None
    costs = time_runs(lambda n: kernel.run_packed(packed, n), cfg, flush_cpu_cache, warm=warm, cutoff_s=cutoff)
    if kernel.threads_seen not in (0, threads):
        return [], int(ErrorCode.RUNTIME_DEVICE), (
            f"the kernel's parallel loops ran on {kernel.threads_seen} threads, its target asks for {threads} "
            "(OMP_THREAD_LIMIT or another limit in the runner's environment?): not timed as if it were")
    _BEST_SEEN[task.workload_key] = min(best if best is not None else math.inf, min(costs))
    return costs, int(ErrorCode.NO_ERROR), ""


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
        self.pool = WorkerPool("codegen.measure:build_job", n_parallel or (os.cpu_count() or 1), timeout)

    def build(self, task: SearchTask, steps_list: Sequence[str], keep_source: bool = False) -> list[BuildResult]:
        tj = task.to_json()
        out = []
        for r in self.pool.map([(tj, s, keep_source) for s in steps_list]):
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

    def __init__(self, timeout: float = 10.0, config: TimingConfig = TimingConfig(), n_parallel: int = 1,
                 env: dict | None = None):
        """env: extra environment for the runner processes. A kernel's thread count is its target's,
        compiled in: OMP_NUM_THREADS here cannot change it (name `-num-threads` in the target instead)."""
        self.config = config
        self.pool = WorkerPool("codegen.measure:run_job", n_parallel, timeout, env)

    def run(self, task: SearchTask, builds: Sequence[BuildResult]) -> list[MeasureResult]:
        tj = task.to_json()
        todo = [i for i, b in enumerate(builds) if b.artifact is not None]
        cfg = self.config
        if cfg.check_correctness and todo:
            cfg = replace(cfg, reference=reference_file(task))
        results = self.pool.map([(tj, builds[i].artifact, cfg) for i in todo])
        out = [MeasureResult([], b.error_code, b.error_msg, b.seconds) for b in builds]
        for i, r in zip(todo, results):
            if r.ok:
                costs, code, msg = r.value
                out[i] = MeasureResult(costs, code, msg, builds[i].seconds, r.seconds)
            else:
                code, msg = _error_of(r, ErrorCode.RUNTIME_DEVICE, ErrorCode.RUN_TIMEOUT)
                out[i] = MeasureResult([], code, msg, builds[i].seconds, r.seconds)
        return out

    def close(self) -> None:
        self.pool.close()


class ProgramMeasurer:
    """Builder + runner: `measure(task, steps_json_list)` -> one MeasureResult per program."""

    def __init__(self, builder: LocalBuilder | None = None, runner: LocalRunner | None = None):
        self.builder = builder or LocalBuilder()
        self.runner = runner or LocalRunner()

    def measure(self, task: SearchTask, steps_list: Sequence[str]) -> list[MeasureResult]:
        return self.runner.run(task, self.builder.build(task, steps_list))

    def close(self) -> None:
        self.builder.close()
        self.runner.close()

    def __enter__(self) -> "ProgramMeasurer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
