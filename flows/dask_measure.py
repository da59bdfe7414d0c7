"""DaskMeasurer: ProgramMeasurer's `measure(task, steps_list)` with one Dask future per build and per timing.

Builds run on any worker (CUDA builds on workers advertising `nvcc`), in parallel; timings run only on
workers advertising the task's resource
(`measure-cpu` or `GPU`, one unit each, so one timing at a time per node), after every build of the
batch is done (a build must not share a node with a timing). Inside a worker, the build and the timing
run in that worker's own isolated process pools (codegen.worker_pool), so a crashing or hanging kernel
costs its own record and never the Dask worker. A Dask worker that dies mid-round costs retries: the
scheduler reruns its futures elsewhere (after the nanny restarts it); results are fetched as each timing
finishes, and a timing whose result died with its worker is submitted again, so no finished measurement
is recorded as an error; a candidate whose futures finally fail still comes back as an error result.
Only plain data crosses the wire: task JSON, step JSON, TimingConfig, and BuildResult/MeasureResult
holding artifact bytes and floats.

This module never imports Prefect: Dask workers must not become Prefect clients (docs/architecture.md §7).
"""
from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent.futures import CancelledError
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from distributed import Client, Future, wait

from tensortune.codegen.measure import BuildResult, LocalBuilder, LocalRunner, MeasureResult
from tensortune.codegen.timing import ErrorCode, TimingConfig
from tensortune.flows.dask_cluster import build_resource, measure_resource, require_resource
from tensortune.tasks.search_task import SearchTask

# ------------------------------------------------------------------ worker side
# Per-process caches, one set per Dask worker process, created lazily on first use and living as long
# as the worker: idle single-process builders (one per worker thread that is building at once) and one
# runner per run timeout (the resource makes timings one at a time; the lock keeps it so regardless).
_IDLE_BUILDERS: "queue.SimpleQueue[LocalBuilder]" = queue.SimpleQueue()
_RUNNERS: dict[float, LocalRunner] = {}
_RUNNER_LOCK = threading.Lock()


@lru_cache(maxsize=64)
def _task(task_json: str) -> SearchTask:
    return SearchTask.from_json(task_json)


def build_candidate(task_json: str, steps_json: str, timeout: float, keep_source: bool = False) -> BuildResult:
    """Runs on a Dask worker: build one program in this worker's builder processes."""
    try:
        builder = _IDLE_BUILDERS.get_nowait()
    except queue.Empty:
        builder = LocalBuilder(n_parallel=1, timeout=timeout)
    try:
        builder.pool.timeout = timeout
        (result,) = builder.build(_task(task_json), [steps_json], keep_source)
    finally:
        _IDLE_BUILDERS.put(builder)
    return result


def run_candidate(task_json: str, build: BuildResult, config: TimingConfig, timeout: float) -> MeasureResult:
    """Runs on a Dask worker holding the measure resource: time one built program in the runner process."""
    if build.artifact is None:
        return MeasureResult([], build.error_code, build.error_msg, build.seconds)
    with _RUNNER_LOCK:
        runner = _RUNNERS.get(timeout)
        if runner is None:
            runner = _RUNNERS[timeout] = LocalRunner(timeout=timeout, config=config)
        runner.config = config
        (result,) = runner.run(_task(task_json), [build])
    return result


# ------------------------------------------------------------------ flow side

# times one candidate's timing is submitted again after its worker died holding the result
MAX_RESUBMITS = 3
# a finished result's transfer from its worker; longer means the data is gone with the worker
FETCH_SECONDS = 30.0

@dataclass
class DaskStats:
    """What the last measure() cost on the cluster (for the flow's logs and the benchmark)."""
    build_s: float = 0.0        # submit to last build done
    run_s: float = 0.0          # first timing submitted to last timing done
    lost: int = 0               # candidates whose futures failed for good (recorded as errors)
    resubmitted: int = 0        # timings submitted again because their result was lost with a worker


class DaskMeasurer:
    """Measures candidates on a Dask cluster; same interface as codegen.measure.ProgramMeasurer.

    retries: reruns of a future whose function raised (a worker that dies is rerun by the scheduler
    anyway, up to distributed.scheduler.allowed-failures times). round_timeout: seconds after which a
    batch's unfinished candidates become UNKNOWN_ERROR records (default: generous, from the per-candidate
    timeouts). resource_wait: seconds to wait for a worker with the measure resource (a restarting
    worker) before failing with ClusterError. workers: the only workers that may time (the measure nodes
    of the task's target, flows.measure_targets); empty: any worker with the resource.
    """

    def __init__(self, client: Client, *, timing: TimingConfig = TimingConfig(), build_timeout: float = 15.0,
                 run_timeout: float = 10.0, retries: int = 2, round_timeout: float | None = None,
                 resource_wait: float = 30.0, keep_source: bool = False, workers: Sequence[str] = ()):
        self.client, self.timing = client, timing
        self.build_timeout, self.run_timeout, self.retries = build_timeout, run_timeout, retries
        self.round_timeout, self.resource_wait, self.keep_source = round_timeout, resource_wait, keep_source
        self.workers = tuple(workers)              # timings only on these (the target's measure nodes); () = any
        self.stats = DaskStats()

    def measure(self, task: SearchTask, steps_list: Sequence[str]) -> list[MeasureResult]:
        """One MeasureResult per program, in order; never fewer."""
        if not steps_list:
            return []
        resource = self._resource(task)
        builder = build_resource(task.target_kind)
        if builder is not None:
            require_resource(self.client, builder, wait=self.resource_wait)
        tj, tag = task.to_json(), uuid.uuid4().hex[:10]
        deadline = time.monotonic() + self._round_timeout(len(steps_list))
        t0 = time.perf_counter()
        builds = [self.client.submit(build_candidate, tj, s, self.build_timeout, self.keep_source, pure=False,
                                     retries=self.retries, key=f"build-{task.name}-{tag}-{i}",
                                     resources={builder: 1} if builder else None)
                  for i, s in enumerate(steps_list)]
        self._wait(builds, deadline)                 # no build may share a node with a timing
        t1 = time.perf_counter()
        results, resubmitted = self._collect(self._run_submitter(task, tj, tag, resource, builds),
                                             len(builds), deadline)
        lost = sum(r.error_code == ErrorCode.UNKNOWN_ERROR and r.error_msg.startswith("dask:") for r in results)
        self.stats = DaskStats(t1 - t0, time.perf_counter() - t1, lost, resubmitted)
        return results

    def run_builds(self, task: SearchTask, builds: Sequence[BuildResult]) -> list[MeasureResult]:
        """Time already-built programs (e.g. hand-made artifacts) on the measure workers."""
        resource = self._resource(task)
        submit = self._run_submitter(task, task.to_json(), uuid.uuid4().hex[:10], resource, builds)
        return self._collect(submit, len(builds), time.monotonic() + self._round_timeout(len(builds)))[0]

    def _resource(self, task: SearchTask) -> str:
        resource = measure_resource(task.target_kind)
        require_resource(self.client, resource, wait=self.resource_wait)
        return resource

    def _run_submitter(self, task: SearchTask, tj: str, tag: str, resource: str,
                       builds: Sequence) -> Callable[[int, int], Future]:
        """submit(i, attempt): the timing future of candidate i (a fresh key for each attempt)."""
        def submit(i: int, attempt: int) -> Future:
            return self.client.submit(run_candidate, tj, builds[i], self.timing, self.run_timeout, pure=False,
                                      retries=self.retries, resources={resource: 1},
                                      workers=list(self.workers) or None, allow_other_workers=False,
                                      key=f"run-{task.name}-{tag}-{i}" + (f"-again{attempt}" if attempt else ""))
        return submit

    def _round_timeout(self, n: int) -> float:
        if self.round_timeout is not None:
            return self.round_timeout
        return 600.0 + n * (self.build_timeout + self.run_timeout)

    def _wait(self, futures: list[Future], deadline: float, return_when: str = "ALL_COMPLETED") -> None:
        try:
            with self.client.as_current():           # the flow's client is not the process default
                wait(futures, timeout=max(1.0, deadline - time.monotonic()), return_when=return_when)
        except TimeoutError:
            pass                                     # _collect turns the unfinished ones into records

    def _collect(self, submit: Callable[[int, int], Future], n: int,
                 deadline: float) -> tuple[list[MeasureResult], int]:
        """Every candidate's result and how many timings were submitted again.

        A result is fetched to this process as soon as its future finishes, so a worker that dies
        afterwards cannot take it along. A future that lost its result with its worker (status `lost`,
        a fetch that fails because the data is gone, or `cancelled` when the scheduler forgot the key)
        is submitted again, up to MAX_RESUBMITS times, until the round's deadline. Only a candidate that
        no worker finished in time, or whose function raised after its retries, becomes an error record,
        saying which of the two it was."""
        futures = {i: submit(i, 0) for i in range(n)}
        attempts = dict.fromkeys(range(n), 0)
        out: dict[int, MeasureResult] = {}
        while futures and time.monotonic() < deadline:
            self._wait(list(futures.values()), deadline, return_when="FIRST_COMPLETED")
            for i, f in list(futures.items()):
                if f.status == "finished":
                    try:
                        out[i] = f.result(timeout=FETCH_SECONDS)
                        del futures[i]
                        continue
                    except (CancelledError, TimeoutError, OSError):   # Dask's FutureCancelledError too
                        pass                         # the data went with its worker: time it again
                elif f.status == "error":
                    err = f.exception()
                    out[i] = MeasureResult([], int(ErrorCode.UNKNOWN_ERROR),
                                           f"dask: the candidate's timing raised after {self.retries} retries "
                                           f"({type(err).__name__}: {err})")
                    del futures[i]
                    continue
                elif f.status not in ("lost", "cancelled"):
                    continue                         # pending: still queued or running
                if attempts[i] >= MAX_RESUBMITS:
                    out[i] = MeasureResult([], int(ErrorCode.UNKNOWN_ERROR),
                                           f"dask: the candidate's result was lost with its worker "
                                           f"{attempts[i] + 1} times")
                    del futures[i]
                    continue
                f.release()
                attempts[i] += 1
                futures[i] = submit(i, attempts[i])
        for i, f in futures.items():
            f.cancel()
            out[i] = MeasureResult([], int(ErrorCode.UNKNOWN_ERROR),
                                   f"dask: no worker finished this candidate before the round timeout "
                                   f"({self._round_timeout(n):.0f} s; submitted {attempts[i] + 1} times)")
        return [out[i] for i in range(n)], sum(attempts.values())

    def close(self) -> None:
        """The client belongs to the caller; workers keep their pools for the next batch."""

    def __enter__(self) -> "DaskMeasurer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
