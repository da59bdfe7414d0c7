"""DaskMeasurer: ProgramMeasurer's `measure(task, steps_list)` with one Dask future per build and per timing.

Builds run on any worker (CUDA builds on workers advertising `nvcc`), in parallel; timings run only on
workers advertising the task's resource
(`measure-cpu` or `GPU`, one unit each, so one timing at a time per node), after every build of the
batch is done (a build must not share a node with a timing). A program built by one of the last calls (a
would-be best timed again, codegen.confirmation) is timed from that build's future, not built again
(codegen.recent_builds). Inside a worker, the build and the timing
run in that worker's own isolated process pools (codegen.worker_pool), so a crashing or hanging kernel
costs its own record and never the Dask worker. A Dask worker that dies mid-round costs retries: the
scheduler reruns its futures elsewhere (after the nanny restarts it); results are fetched as each timing
finishes, and a timing whose result died with its worker is submitted again, so no finished measurement
is recorded as an error; a candidate whose futures finally fail still comes back as an error result.
A scheduler that goes away mid-round takes all futures with it (workers shut down with it; whatever
supervises them starts them again): the results already fetched are kept, and once the client has
reconnected and a measure worker registered, the round starts over for the rest, builds included.
If none comes back within `resource_wait`, the rest become error records that say so, and the next
round fails at once with ClusterError (one line from the CLI) instead of waiting on a dead cluster.
Only plain data crosses the wire: task JSON, step JSON, TimingConfig, and BuildResult/MeasureResult
holding artifact bytes and floats.

This module never imports Prefect: Dask workers must not become Prefect clients (docs/architecture.md §7).
"""
from __future__ import annotations

import queue
import socket
import threading
import time
import uuid
from concurrent.futures import CancelledError
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Callable, Iterable, Mapping, Sequence

from distributed import Client, Future, wait
from distributed.client import ClosedClientError

from tensortune.codegen.measure import BuildResult, LocalBuilder, LocalRunner, MeasureResult
from tensortune.codegen.recent_builds import BUILD_ERRORS, RecentBuilds
from tensortune.codegen.timing import ErrorCode, TimingConfig
from tensortune.flows.dask_cluster import (
    ClusterError,
    build_resource,
    cluster_workers,
    measure_resource,
    require_resource,
    workers_with,
)
from tensortune.flows.measure_targets import measure_node_targets, resolve_measure_target
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
# times a round starts over (builds and timings of its unfinished candidates) after the scheduler came back
MAX_RESTARTS = 2
# the reason Dask gives the futures it cancels when the client loses its scheduler
_SCHEDULER_LOST = "scheduler-connection-lost"


class SchedulerLost(Exception):
    """The client lost its Dask scheduler mid-round: every future of the round went with it."""


@dataclass
class DaskStats:
    """What the last measure() cost on the cluster (for the flow's logs and the benchmark)."""
    build_s: float = 0.0        # submit to last build done
    run_s: float = 0.0          # first timing submitted to last timing done
    lost: int = 0               # candidates whose futures failed for good (recorded as errors)
    resubmitted: int = 0        # timings submitted again because their result was lost with a worker
    restarts: int = 0           # times the round started over because the scheduler went away

    def __add__(self, other: "DaskStats") -> "DaskStats":
        """What two measure() calls cost together (a batch and its re-timed would-be bests)."""
        return DaskStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def local_hosts() -> frozenset[str]:
    """The addresses a Dask worker on this machine can report as its host: a measure worker among them
    shares its cores with the flow's search."""
    name = socket.gethostname()
    try:
        addresses = socket.gethostbyname_ex(name)[2]
    except OSError:
        addresses = []
    return frozenset({"127.0.0.1", "localhost", "::1", name, *addresses})


class DaskMeasurer:
    """Measures candidates on a Dask cluster; same interface as codegen.measure.ProgramMeasurer.

    retries: reruns of a future whose function raised (a worker that dies is rerun by the scheduler
    anyway, up to distributed.scheduler.allowed-failures times). round_timeout: seconds after which a
    batch's unfinished candidates become UNKNOWN_ERROR records (default: generous, from the per-candidate
    timeouts). resource_wait: seconds to wait for a worker with the measure resource (a restarting
    worker, or a restarted scheduler and its workers) before failing with ClusterError. workers: the
    only workers that may time (the measure nodes of the task's target, flows.measure_targets); empty:
    any worker with the resource.

    A scheduler that goes away mid-round takes every future with it (results already fetched are
    kept). If the client reconnects and a worker with the resource registers within resource_wait, the
    round starts over for its unfinished candidates, builds included; otherwise those candidates get
    an error record saying so and the next measure() raises ClusterError, one line the CLI prints.
    """

    def __init__(self, client: Client, *, timing: TimingConfig = TimingConfig(), build_timeout: float = 15.0,
                 run_timeout: float = 10.0, retries: int = 2, round_timeout: float | None = None,
                 resource_wait: float = 30.0, keep_source: bool = False, workers: Sequence[str] = (),
                 here: frozenset[str] | None = None):
        self.client, self.timing = client, timing
        # hosts of this process (where the flow searches): None = local_hosts()
        self.here = local_hosts() if here is None else here
        # builds started ahead (prebuild), by (workload key, steps), taken by the measure() of their batch
        self._prebuilt: dict[tuple[str, str], tuple[Future, list[str]]] = {}
        self._prebuilt_lock = threading.Lock()
        # builds of the last calls' programs: a program timed again (codegen.confirmation) is not rebuilt
        self.recent: RecentBuilds[Future] = RecentBuilds()
        self.build_timeout, self.run_timeout, self.retries = build_timeout, run_timeout, retries
        self.round_timeout, self.resource_wait, self.keep_source = round_timeout, resource_wait, keep_source
        self.workers = tuple(workers)              # timings only on these (the target's measure nodes); () = any
        self.stats = DaskStats()
        # remembered: a client that gave up reconnecting forgets its scheduler, and the error names it
        self._scheduler_address = client.scheduler.address if client.scheduler is not None else "?"

    def measure(self, task: SearchTask, steps_list: Sequence[str]) -> list[MeasureResult]:
        """One MeasureResult per program, in order; never fewer."""
        if not steps_list:
            return []
        resource = self._resource(task)
        builder = build_resource(task.target_kind)
        if builder is not None:
            require_resource(self.client, builder, wait=self.resource_wait)
        tj = task.to_json()
        deadline = time.monotonic() + self._round_timeout(len(steps_list))
        stats = DaskStats()

        def run(todo: list[int], out: dict[int, MeasureResult], tag: str) -> None:
            t0 = time.perf_counter()
            builds = self._take_prebuilt(task, steps_list, todo)
            first = {steps_list[i]: i for i in reversed(todo)}     # a program listed twice is built once
            for i in todo:
                if i in builds:
                    continue
                if first[steps_list[i]] in builds:
                    builds[i] = builds[first[steps_list[i]]]
                elif (done := self._recent_build(tj, steps_list[i])) is not None:
                    builds[i] = done                                # built by an earlier call
                else:
                    builds[i] = self._submit(build_candidate, tj, steps_list[i], self.build_timeout,
                                             self.keep_source, pure=False, retries=self.retries,
                                             key=f"build-{task.name}-{tag}-{i}",
                                             resources={builder: 1} if builder else None)
            self._wait(list(builds.values()), deadline)     # no build may share a node with a timing
            self._check_scheduler(builds.values())
            for i in todo:
                if builds[i].status == "finished":
                    self.recent.put(tj, steps_list[i], builds[i])
            t1 = time.perf_counter()
            stats.build_s += t1 - t0
            self._collect(self._run_submitter(task, tj, tag, resource, builds), todo, deadline, out, stats)
            stats.run_s += time.perf_counter() - t1

        results = self._restartable(task, run, len(steps_list), deadline, [resource, builder], stats)
        for steps, r in zip(steps_list, results):
            if r.error_code in BUILD_ERRORS:           # a failed build (a timeout may pass) is tried again
                self.recent.discard(tj, steps)
        stats.lost = sum(r.error_code == ErrorCode.UNKNOWN_ERROR and r.error_msg.startswith("dask:")
                         for r in results)
        self.stats = stats
        return results

    def prebuild_workers(self, task: SearchTask) -> list[str]:
        """Workers that may build the task's next batch while this one is being timed: builders (with
        nvcc, for CUDA) on nodes where no worker times this task's programs. Empty, so no overlap,
        when a timing worker shares this process's node, where the next round is searched meanwhile
        (the embedded LocalCluster: one machine does everything), or when every builder shares a node
        with a timing worker."""
        if self.client.status != "running":
            return []                                # measure() says what happened to the cluster
        info = cluster_workers(self.client)
        timers = set(self.workers) or set(workers_with(self.client, measure_resource(task.target_kind)))
        busy = {info[a]["host"] for a in timers if a in info}
        if not busy or busy & self.here:
            return []
        need = build_resource(task.target_kind)
        return sorted(a for a, w in info.items()
                      if w["host"] not in busy and (need is None or w.get("resources", {}).get(need, 0) > 0))

    def prebuild(self, task: SearchTask, steps_list: Sequence[str]) -> bool:
        """Start building a batch now, on `prebuild_workers` only, so its builds run while the batch
        before it is timed; its measure() then waits for these builds instead of submitting its own
        (a build that is lost or fails there is retried as any other). False, and nothing started,
        where no worker qualifies: measure() builds after the timings, as always."""
        workers = self.prebuild_workers(task)
        if not workers:
            return False
        tj, tag = task.to_json(), uuid.uuid4().hex[:10]
        builder = build_resource(task.target_kind)
        with self._prebuilt_lock:
            for n, steps in enumerate(steps_list):
                self._prebuilt.setdefault((task.workload_key, steps), (self.client.submit(
                    build_candidate, tj, steps, self.build_timeout, self.keep_source, pure=False,
                    retries=self.retries, key=f"prebuild-{task.name}-{tag}-{n}", workers=workers,
                    # strict: a loose restriction lets Dask's work stealing move builds onto a timing node
                    allow_other_workers=False, resources={builder: 1} if builder else None), workers))
        return True

    def build_ahead(self, batches: Sequence[tuple[SearchTask, Sequence[str]]]) -> None:
        """Build the programs of every batch not built already, all at once on the builders, and wait for
        them (no timing runs meanwhile, so the measure nodes build too); the finished builds are kept (as
        many as `recent` holds) for the measure() calls that time them, as a call keeps its own (one
        whose build failed reports that failure and is built anew by the call after). A cluster that
        goes away meanwhile is measure()'s to report."""
        todo: dict[tuple[str, str], SearchTask] = {}
        for task, steps_list in batches:
            tj = task.to_json()
            for steps in steps_list:
                if (tj, steps) not in todo and self._recent_build(tj, steps) is None:
                    todo[(tj, steps)] = task
        todo = dict(list(todo.items())[:self.recent.size])
        builders = {b for task in todo.values() if (b := build_resource(task.target_kind)) is not None}
        tag = uuid.uuid4().hex[:10]
        futures = {}
        try:
            for needed in builders:
                require_resource(self.client, needed)          # none now: measure() waits, and says so
            for n, ((tj, steps), task) in enumerate(todo.items()):
                builder = build_resource(task.target_kind)
                futures[(tj, steps)] = self._submit(
                    build_candidate, tj, steps, self.build_timeout, self.keep_source, pure=False,
                    retries=self.retries, key=f"build-ahead-{tag}-{n}", resources={builder: 1} if builder else None)
        except (SchedulerLost, ClusterError, OSError):
            for future in futures.values():
                future.cancel()
            return
        self._wait(list(futures.values()), time.monotonic() + self._round_timeout(len(futures)))
        for (tj, steps), future in futures.items():
            if future.status == "finished":
                self.recent.put(tj, steps, future)
            else:
                future.cancel()

    def _recent_build(self, tj: str, steps: str) -> Future | None:
        """The finished build of `steps` from one of the last calls; None if there is none, or if it
        was cancelled or lost since (a restarted cluster: built anew)."""
        future = self.recent.get(tj, steps)
        if future is not None and future.status != "finished":
            self.recent.discard(tj, steps)
            return None
        return future

    def _take_prebuilt(self, task: SearchTask, steps_list: Sequence[str], todo: Sequence[int]) -> dict[int, Future]:
        """The builds started ahead for candidates `todo`, except those that can no longer finish: still
        pending while none of the workers they are bound to is left (cancelled, to be built anew)."""
        with self._prebuilt_lock:
            found = {i: f for i in todo if (f := self._prebuilt.pop((task.workload_key, steps_list[i]), None))}
        if any(future.status == "pending" for future, _ in found.values()):
            alive = set(cluster_workers(self.client))      # asked once per batch
            for i, (future, workers) in list(found.items()):
                if future.status == "pending" and not alive & set(workers):
                    future.cancel()
                    del found[i]
        return {i: future for i, (future, _) in found.items()}

    def run_builds(self, task: SearchTask, builds: Sequence[BuildResult]) -> list[MeasureResult]:
        """Time already-built programs (e.g. hand-made artifacts) on the measure workers."""
        resource = self._resource(task)
        tj = task.to_json()
        deadline = time.monotonic() + self._round_timeout(len(builds))
        stats = DaskStats()

        def run(todo: list[int], out: dict[int, MeasureResult], tag: str) -> None:
            self._collect(self._run_submitter(task, tj, tag, resource, builds), todo, deadline, out, stats)

        results = self._restartable(task, run, len(builds), deadline, [resource], stats)
        self.stats = stats
        return results

    def _restartable(self, task: SearchTask, run: Callable[[list[int], dict[int, MeasureResult], str], None],
                     n: int, deadline: float, resources: Sequence[str | None],
                     stats: DaskStats) -> list[MeasureResult]:
        """run(todo, out, tag) over the candidates not yet in `out`, again after each scheduler loss
        the cluster comes back from; the rest become error records that say what happened."""
        out: dict[int, MeasureResult] = {}
        tag = uuid.uuid4().hex[:10]
        for restart in range(MAX_RESTARTS + 1):
            todo = [i for i in range(n) if i not in out]
            try:
                run(todo, out, f"{tag}-{restart}" if restart else tag)
                break
            except SchedulerLost:
                stats.restarts += 1
                gone = ("it went away again" if restart == MAX_RESTARTS else
                        self._cluster_back(task, [r for r in resources if r], deadline))
                if gone is None:
                    continue
                why = (f"dask: the Dask scheduler at {self._address()} went away mid-round and {gone}; "
                       "this candidate was not measured")
                for i in range(n):
                    out.setdefault(i, MeasureResult([], int(ErrorCode.UNKNOWN_ERROR), why))
                break
        return [out[i] for i in range(n)]

    def _cluster_back(self, task: SearchTask, resources: list[str], deadline: float) -> str | None:
        """Wait (up to resource_wait, within the round) for the client to reconnect and workers with
        `resources` to register: None once they have, else why not. A measurer tied to measure nodes
        is tied to their successors (the same CPU, at new addresses)."""
        until = min(deadline, time.monotonic() + self.resource_wait)
        while time.monotonic() < until:
            if self.client.status in ("closing", "closed"):
                return "the client could not reconnect to it"
            if self.client.status == "running":
                try:
                    if all(workers_with(self.client, r) for r in resources):
                        if self.workers:
                            nodes = measure_node_targets(self.client)
                            self.workers = resolve_measure_target(task.target, nodes).workers
                        return None
                except (OSError, ClusterError):
                    pass                            # the new scheduler is still starting, or its nodes are
            time.sleep(0.2)
        return f"no worker advertising {', '.join(resources)} joined it within {self.resource_wait:.0f} s"

    def _resource(self, task: SearchTask) -> str:
        if self.client.status in ("closing", "closed"):
            raise ClusterError(f"the Dask client lost the scheduler at {self._address()} and could not "
                               "reconnect: the cluster is gone. Restart it and run again (stored rounds "
                               "are kept)")
        resource = measure_resource(task.target_kind)
        require_resource(self.client, resource, wait=self.resource_wait)
        return resource

    def _address(self) -> str:
        return self._scheduler_address

    def _submit(self, *args, **kwargs) -> Future:
        if self.client.status != "running":
            raise SchedulerLost()                   # it would go to a scheduler that never saw the builds
        try:
            return self.client.submit(*args, **kwargs)
        except ClosedClientError as err:
            raise SchedulerLost() from err

    def _check_scheduler(self, futures: Iterable[Future]) -> None:
        """Raise SchedulerLost when the client lost its scheduler: it cancels every future with that
        reason (a future cancelled for another reason is lost data, handled by resubmitting)."""
        if self.client.status != "running":
            raise SchedulerLost()
        for f in futures:
            if f.status == "cancelled":
                try:
                    f.result(timeout=1)
                except CancelledError as err:
                    if getattr(err, "reason", "") == _SCHEDULER_LOST:
                        raise SchedulerLost() from err
                except Exception:  # noqa: BLE001 - anything else is not the scheduler's loss
                    continue

    def _run_submitter(self, task: SearchTask, tj: str, tag: str, resource: str,
                       builds: Mapping[int, object] | Sequence) -> Callable[[int, int], Future]:
        """submit(i, attempt): the timing future of candidate i (a fresh key for each attempt)."""
        def submit(i: int, attempt: int) -> Future:
            return self._submit(run_candidate, tj, builds[i], self.timing, self.run_timeout, pure=False,
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

    def _collect(self, submit: Callable[[int, int], Future], todo: list[int], deadline: float,
                 out: dict[int, MeasureResult], stats: DaskStats) -> None:
        """Every candidate's result into `out`; SchedulerLost when the scheduler goes away meanwhile.

        A result is fetched to this process as soon as its future finishes, so a worker that dies
        afterwards cannot take it along. A future that lost its result with its worker (status `lost`,
        a fetch that fails because the data is gone, or `cancelled` when the scheduler forgot the key)
        is submitted again, up to MAX_RESUBMITS times, until the round's deadline. Only a candidate that
        no worker finished in time, or whose function raised after its retries, becomes an error record,
        saying which of the two it was."""
        futures = {i: submit(i, 0) for i in todo}
        attempts = dict.fromkeys(todo, 0)
        while futures and time.monotonic() < deadline:
            self._wait(list(futures.values()), deadline, return_when="FIRST_COMPLETED")
            self._check_scheduler(futures.values())
            for i, f in list(futures.items()):
                if f.status == "finished":
                    try:
                        out[i] = f.result(timeout=FETCH_SECONDS)
                        del futures[i]
                        continue
                    except (CancelledError, TimeoutError, OSError):   # Dask's FutureCancelledError too
                        self._check_scheduler([f])   # the data went with its worker: time it again
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
                                   f"({self._round_timeout(len(out) + len(futures)):.0f} s; submitted "
                                   f"{attempts[i] + 1} times)")
        stats.resubmitted += sum(attempts.values())

    def close(self) -> None:
        """The client belongs to the caller; workers keep their pools for the next batch. Builds started
        ahead for a batch that was never measured are cancelled."""
        with self._prebuilt_lock:
            left, self._prebuilt = list(self._prebuilt.values()), {}
        for future, _ in left:
            future.cancel()

    def __enter__(self) -> "DaskMeasurer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
