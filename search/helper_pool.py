"""HelperPool: one process beside this one per other core, for the search's CPU-bound Python work.

A search round is Python on one core unless it hands work to other processes: feature extraction
(`feature_pool.Featurizer`) and the initial population's sampling (`sampling.SketchDraws`) both
deal their work out by a stable rule, so each helper keeps its own per-task state warm (templates,
replayed sketches) from call to call, and the caller takes one share itself. Helper `n` is one
single-process executor, so a job always lands on the process whose state it warmed.

A helper that dies costs nothing but time: `result` returns None, the caller computes that share
itself, and the helper is started afresh at the next `submit`. Helpers that die before finishing any
job twice (a spawned helper imports the caller's `__main__`: a script that tunes at module level, or
exits when not run as the main module, kills each one as it starts) are given up for the pool's life,
with one warning that says why: restarting them cost a process start and a warning every call.
Inside a daemonic process (a Dask worker) no child may start, so there are no helpers and the caller
does everything.

A pool outlives cost-model versions (the flow loads a new model at every retrain), so its processes
and their warm state are made once per tuning run.

A job submitted is not yet sent: the executor's own threads move it to the call queue, pickle it and
write it to the helper's pipe, and each step needs the GIL, which the caller holds while it computes its
own share. At Python's default switch interval (5 ms) each step waited that long, so a helper began its
share tens of ms late and 64 kernel identities took 0.09-0.14 s on two processes where one took 0.13
(2-vCPU Xeon VM); callers therefore compute their share inside `callers_share()`, which shortens the
interval (0.07 s then; sampling, which shares the same way, 6.6-6.8 s against 7.0-7.6 s of the 19
proposals of `bench search` at 224²). `run_shares` holds that pattern (send the helpers' shares, compute
this process's, collect theirs or compute them here) for every caller.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from concurrent.futures import BrokenExecutor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence, TypeVar

log = logging.getLogger("tensortune.search")

S = TypeVar("S")
R = TypeVar("R")

MAX_PROCESSES = 7
# the GIL switch interval while a caller computes its share (the executor's threads send the helpers'
# jobs meanwhile); Python's default is 5 ms
SHARING_SWITCH_INTERVAL = 1e-4

_sharing_lock = threading.Lock()
_sharing = [0, 0.0]         # callers inside `callers_share`, and the interval to restore when none is


@contextmanager
def callers_share(shared: bool = True) -> Iterator[None]:
    """Compute the caller's share of jobs just submitted: with the GIL handed over within 0.1 ms, so the
    executor's threads send those jobs while this thread works (and the helpers work beside it).
    `shared` False (nothing was submitted): the interval stays."""
    if not shared:
        yield
        return
    with _sharing_lock:
        if _sharing[0] == 0:
            _sharing[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(_sharing[1], SHARING_SWITCH_INTERVAL))
        _sharing[0] += 1
    try:
        yield
    finally:
        with _sharing_lock:
            _sharing[0] -= 1
            if _sharing[0] == 0:
                sys.setswitchinterval(_sharing[1])


def run_shares(pool: HelperPool | None, shares: Sequence[S], helper_of: Callable[[int], int | None],
               job: Callable[[S], tuple[Callable[..., Any], tuple]], here: Callable[[S], R]) -> list[R]:
    """Each share's result, in order. Share i goes to helper `helper_of(i)` as `fn(*args)` for `(fn, args)
    = job(share)` (None: this process's); this process computes its own shares meanwhile, inside
    `callers_share`, then each helper's share that did not come back (a dead helper, no helpers) with
    `here(share)`: the same result either way, which is what lets every caller deal its work out by
    whatever rule keeps each helper's state warm (features: a hash of the structure; sampling: the
    seed's index; kernel identities: contiguous runs)."""
    pending: dict[int, tuple[int, Future | None]] = {}
    if pool is not None:
        for i, share in enumerate(shares):
            n = helper_of(i)
            if n is not None and n < pool.processes:
                fn, args = job(share)
                pending[i] = (n, pool.submit(n, fn, *args))
    out: dict[int, R] = {}
    with callers_share(bool(pending)):
        for i, share in enumerate(shares):
            if i not in pending:
                out[i] = here(share)
    for i, (n, future) in pending.items():
        got = pool.result(n, future) if pool is not None else None
        out[i] = got if got is not None else here(shares[i])
    return [out[i] for i in range(len(shares))]


def default_processes() -> int:
    """Helper processes beside the caller: one per other core (none inside a daemonic process,
    such as a Dask worker, which may not start children)."""
    if multiprocessing.current_process().daemon:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(MAX_PROCESSES, cores - 1))


class HelperPool:
    """`processes` helpers, started on first use; `submit(n, fn, ...)` runs fn in helper n."""

    def __init__(self, processes: int | None = None):
        self.processes = default_processes() if processes is None else processes
        self._executors: list[ProcessPoolExecutor | None] = [None] * self.processes
        self._served = [False] * self.processes        # helper n has finished a job since it started
        self._died_unserved = 0
        self._finalizer = weakref.finalize(self, _shutdown, self._executors)

    def submit(self, n: int, fn: Callable[..., Any], *args: Any) -> Future | None:
        """fn(*args) in helper n (a module-level function: it is pickled by name); None where no
        helper can run it, so the caller does that share itself."""
        for _ in range(2):
            try:
                executor = self._executors[n]
                if executor is None:
                    executor = self._executors[n] = ProcessPoolExecutor(
                        1, mp_context=multiprocessing.get_context("spawn"), initializer=_start_helper,
                        initargs=(os.getpid(),))
                return executor.submit(fn, *args)
            except BrokenExecutor:                 # its process died since the last call: start afresh
                self._drop(n)
            except (OSError, RuntimeError) as exc:  # cannot start processes here: do without them
                log.warning("helper processes cannot start here (%s); the search runs in this process only",
                            str(exc).strip().splitlines()[0])
                self.close()
                self.processes = 0
                return None
        return None

    def result(self, n: int, future: Future | None) -> Any | None:
        """The job's result, or None if it could not run (the caller then computes it itself)."""
        if future is None or not self.processes:
            return None
        try:
            out = future.result()
        except Exception as exc:  # noqa: BLE001 - a dead helper (BrokenProcessPool) or a bug in it
            served = self._served[n]
            self._drop(n)
            if not served:
                self._died_unserved += 1
                if self._died_unserved >= 2:
                    log.warning("helper processes die as they start (%s); the search runs in this process "
                                "only. Helpers are spawned and import the caller's __main__: start tuning "
                                "from a script under `if __name__ == \"__main__\":`", type(exc).__name__)
                    self.close()
                    self.processes = 0
                    return None
            log.warning("helper %d failed (%s: %s); doing its share here", n, type(exc).__name__, exc)
            return None
        self._served[n], self._died_unserved = True, 0
        return out

    def pids(self) -> list[int]:
        """The helpers' process ids (started ones only)."""
        return [pid for ex in self._executors if ex is not None for pid in ex._processes]

    def _drop(self, n: int) -> None:
        executor, self._executors[n] = self._executors[n], None
        self._served[n] = False
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the helpers (they also stop when this object is collected or at exit)."""
        self._finalizer()


def _shutdown(executors: list) -> None:
    """Stop the helpers and wait for them (a helper exits at its first exit handler, so the wait is
    short). Not waiting left each executor's manager thread closing its wake-up pipe while the
    interpreter's exit handler wrote to it (concurrent.futures, CPython 3.11): an OSError traceback after
    a Ctrl-C'd `tune-op` had printed its one line."""
    for n, executor in enumerate(executors):
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
            executors[n] = None


def _start_helper(parent: int) -> None:
    """In a helper, first: leave Ctrl-C to the parent, exit at once when the pool shuts it down, and
    when the parent is gone.

    A terminal's Ctrl-C goes to the whole process group: a helper waiting for its next job printed a
    KeyboardInterrupt traceback under the parent's one-line message. The parent stops on it and shuts
    the pool down, so a helper ignores SIGINT.

    At shutdown the interpreter would free the helper's heap object by object and run the cyclic GC
    over it: with a night's templates (2 GB) that took two helpers minutes of CPU after the search had
    ended, while the benchmark timed its networks (ONNX Runtime ran 2.5x slower, our ResNet-18 3x).
    Nothing in a helper needs finalising (its results went back before the shutdown message came),
    so the first exit handler ends the process. A killed parent cannot tell us it is gone: we would
    wait forever, so a thread watches."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    atexit.register(os._exit, 0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
