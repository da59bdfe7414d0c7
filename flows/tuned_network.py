"""The tuned network as it will be deployed: built from the store's best records, checked, timed.

What a tuning run promises is an estimate: the weighted sum of each task's best latency, every kernel
timed alone and warm. What the user gets is the network run end to end. Both the nightly flow and
`run-network` end here, so the two figures are always printed side by side and a gap is seen.

The thread count is part of the configuration: records are kept per target string, which carries
`-num-threads`, and the network is built for the target its records were measured on (unless the
caller asks for another thread count), so a deployed network runs on the threads it was tuned for.

This module never imports Prefect: the flow runs `measure_tuned_network` on a Dask measure worker.
"""
from __future__ import annotations

import math
import shutil
import socket
from dataclasses import dataclass, field
from typing import BinaryIO, Callable

from tensortune.codegen.aot import AOTResult, compile_network, dispatch_overhead
from tensortune.codegen.network_runtime import NETWORK_TOLERANCE, NetworkCheck, build_network, relative_errors
from tensortune.codegen.target import Target, parse_target
from tensortune.codegen.worker_pool import WorkerPool
from tensortune.storage.records import RecordStore
from tensortune.tasks.extract import NetworkTasks

# estimated and measured latency further apart than this is a warning in the flow's UI and the CLI
GAP_WARNING = 0.20


def _threads_given(text: str) -> bool:
    return any(part.startswith(("-num-threads=", "-num-cores=")) for part in text.split())


def tuned_target(store: RecordStore | None, target: str, workload_keys: list[str]) -> Target:
    """The target to build for: `target` itself when it names a thread count (or there are no
    records); else, of the store's targets for the same CPU, the one whose records cover most of the
    network's tasks (ties: the most threads), so `run-network` follows the thread count the network was
    tuned with; else `target` on all cores."""
    want = parse_target(target)
    if store is None or want.kind != "llvm" or _threads_given(target):
        return want
    best = store.best_per_task()
    if best.empty:
        return want
    keys = set(workload_keys)
    coverage: dict[str, int] = {}
    for name, frame in best.groupby("target", observed=True):
        try:
            got = parse_target(str(name))
        except ValueError:
            continue
        if got.cpu == want.cpu and _threads_given(str(name)):
            coverage[str(name)] = len(keys & set(frame["workload_key"]))
    if not coverage or max(coverage.values()) == 0:
        return want
    return parse_target(max(coverage, key=lambda t: (coverage[t], parse_target(t).num_threads)))


def best_records(store: RecordStore, target: Target) -> tuple[dict[str, str], dict[str, float]]:
    """(workload_key -> steps, workload_key -> seconds) of the fastest record of each task measured on
    exactly this target (CPU and thread count): records of other configurations are never mixed in."""
    frame = store.best_per_task(target=str(target))
    if frame.empty:
        return {}, {}
    frame = frame.sort_values("mean_latency", kind="stable").drop_duplicates("workload_key")
    return (dict(zip(frame["workload_key"], frame["steps"])),
            {k: float(v) for k, v in zip(frame["workload_key"], frame["mean_latency"])})


@dataclass
class TaskTiming:
    name: str
    weight: int
    source: str                 # "record" or "default ..."
    estimate_s: float           # the best record's latency (NaN: no record)
    measured_s: float           # per network run, all its calls together, inside the network


@dataclass
class TunedNetworkTiming:
    """Estimated beside measured latency of one build of the network."""
    network: str
    target: str
    host: str
    estimate_s: float           # weighted sum of the records' latencies (NaN: a task has none)
    measured_s: float           # median of the end-to-end runs
    runs: int
    check: str                  # the check against the NumPy reference, as text
    passed: bool
    tasks: list[TaskTiming] = field(default_factory=list)

    @property
    def tuned(self) -> int:
        return sum(t.source == "record" for t in self.tasks)

    @property
    def gap(self) -> float:
        """measured / estimate - 1 (NaN without an estimate)."""
        if not (math.isfinite(self.estimate_s) and self.estimate_s > 0):
            return math.nan
        return self.measured_s / self.estimate_s - 1.0

    @property
    def gap_too_large(self) -> bool:
        return abs(self.gap) > GAP_WARNING if math.isfinite(self.gap) else False

    def line(self) -> str:
        """One line for logs and the CLI."""
        est = f"{self.estimate_s * 1e3:.3f} ms" if math.isfinite(self.estimate_s) else "n/a"
        gap = f"{self.gap:+.0%}" if math.isfinite(self.gap) else "n/a"
        return (f"{self.network} on {self.target} ({self.host}): estimated {est}, measured "
                f"{self.measured_s * 1e3:.3f} ms (median of {self.runs} runs; gap {gap}); "
                f"{self.tuned}/{len(self.tasks)} tasks from records; check: {self.check}")

    def as_dict(self) -> dict:
        return {"network": self.network, "target": self.target, "host": self.host,
                "estimate_s": self.estimate_s, "measured_s": self.measured_s, "gap": self.gap,
                "runs": self.runs, "check": self.check, "passed": self.passed, "tuned_tasks": self.tuned,
                "tasks": [t.__dict__ for t in self.tasks]}


def measure_tuned_network(net: NetworkTasks, records: RecordStore | None, target: str = "llvm",
                          repeat: int = 20, check: bool = True) -> TunedNetworkTiming:
    """Build every task from its best record on the tuned target (default schedule without one),
    check the outputs against the graph's NumPy reference, and time `repeat` end-to-end runs."""
    chosen = tuned_target(records, target, [t.workload_key for t in net.tasks])
    steps, latency = best_records(records, chosen) if records is not None else ({}, {})
    compiled = build_network(net, steps, str(chosen), latency)     # latency: the faster of alternative forms
    result = compiled.check() if check else None
    per_task = compiled.profile()
    runs = compiled.benchmark(repeat=repeat)
    tasks = [TaskTiming(k.name, k.weight, k.source, latency.get(k.workload_key, math.nan), per_task[i])
             for i, k in enumerate(compiled.kernels)]
    estimate = math.fsum(t.weight * t.estimate_s for t in tasks)
    return TunedNetworkTiming(net.source.name, str(chosen), socket.gethostname(), estimate,
                              runs.median_ms / 1e3, repeat, str(result) if result is not None else "not run",
                              result.passed if result is not None else True, tasks)


def compile_tuned(net: NetworkTasks, store: RecordStore | None, target: str, out_dir: str,
                  name: str | None = None) -> tuple[AOTResult, Target, float, list]:
    """Build `net` from the store's best records on the tuned target (defaults without) into `out_dir`.
    Returns (AOTResult, the target built for, estimated seconds per run or NaN, tasks without records)."""
    chosen = tuned_target(store, target, [t.workload_key for t in net.tasks])
    steps, latency = best_records(store, chosen) if store is not None else ({}, {})
    net = net.resolve_forms(steps, latency)      # of alternative forms (Winograd), the faster one
    untuned = [t for t in net.tasks if t.workload_key not in latency]
    estimate = math.fsum(t.weight * latency[t.workload_key] for t in net.tasks) if not untuned else math.nan
    result = compile_network(net, steps, out_dir, chosen, name=name,
                             extra={"estimated_latency_s": None if math.isnan(estimate) else estimate})
    return result, chosen, estimate, untuned


def measure_compiled_network(net: NetworkTasks, records: RecordStore | None, target: str = "llvm",
                             repeat: int = 20, check: bool = True, out_dir: str | None = None
                             ) -> tuple[TunedNetworkTiming, AOTResult, float]:
    """As `measure_tuned_network`, on the library `compile` writes (into `out_dir`, else a temporary
    folder), loaded by `tensortune.runtime`. Also returns the driver's dispatch cost per kernel call."""
    import tempfile
    import time

    import numpy as np

    from tensortune.runtime import load
    with tempfile.TemporaryDirectory() as tmp:
        result, chosen, estimate, _ = compile_tuned(net, records, target, out_dir or tmp)
        m = load(result.out_dir)
        passed, text = True, "not run"
        if check:
            inputs = net.source.random_inputs(0)
            result_check = NetworkCheck(relative_errors(m.run(inputs), net.source.run_reference(inputs)),
                                        NETWORK_TOLERANCE)
            passed, text = result_check.passed, str(result_check)
        else:
            m.run(net.source.random_inputs(0))
        runs = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            m.run_pointers()
            runs.append(time.perf_counter() - t0)
        del m
    per_call = dispatch_overhead(net, chosen)
    steps, latency = best_records(records, chosen) if records is not None else ({}, {})
    tasks = [TaskTiming(k.name, k.weight, k.schedule, latency.get(k.workload_key, math.nan), math.nan)
             for k in result.kernels]
    timing = TunedNetworkTiming(net.source.name, str(chosen), socket.gethostname(), estimate,
                                float(np.median(runs)), repeat, text, passed, tasks)
    return timing, result, per_call


@dataclass
class StoredLibrary:
    """A network library compiled from a store's best records and written beside them."""
    folder: str                 # where the files are (a local path or the store's URL scheme)
    files: list[str]
    tuned: int
    kernels: int
    estimate_s: float
    check: str
    passed: bool

    def line(self) -> str:
        est = f"{self.estimate_s * 1e3:.3f} ms" if math.isfinite(self.estimate_s) else "n/a"
        return (f"library {self.folder}: {self.tuned}/{self.kernels} kernels from records, estimated {est}; "
                f"check: {self.check}")


COMPILED_DIR = "_compiled"      # private to the store: record and model readers skip "_" folders


def compile_into_store(net: NetworkTasks, records_url: str, target: str, label: str, stamp: str) -> StoredLibrary:
    """Compile the network from the store's best records (a temporary folder), check the library with
    `tensortune.runtime`, and write its files to `<store>/_compiled/<label>/<stamp>/`."""
    import os
    import tempfile

    from tensortune.runtime import load
    from tensortune.storage.filesystem import write_atomic
    store = RecordStore(records_url, auto_compact=None)
    with tempfile.TemporaryDirectory() as tmp:
        result, _, estimate, _ = compile_tuned(net, store, target, tmp)
        inputs = net.source.random_inputs(0)
        check = NetworkCheck(relative_errors(load(tmp).run(inputs), net.source.run_reference(inputs)),
                             NETWORK_TOLERANCE)
        folder = store.location.path(COMPILED_DIR, label, stamp)
        written = []
        for src in result.files:
            dest = f"{folder}/{os.path.basename(src)}"
            write_atomic(store.location, dest, _copy_of(src))
            written.append(dest)
    tuned = sum(k.schedule == "record" for k in result.kernels)
    return StoredLibrary(folder, written, tuned, len(result.kernels), estimate, str(check), check.passed)


def _copy_of(path: str) -> Callable[[BinaryIO], None]:
    """A payload for write_atomic that streams the file at `path` (a library's weights are megabytes)."""
    def write(out: BinaryIO) -> None:
        with open(path, "rb") as f:
            shutil.copyfileobj(f, out)
    return write


NETWORK_JOB_TIMEOUT_S = 1800.0    # builds every kernel (a Winograd F(4) one takes seconds), checks, times


def measure_tuned_network_job(net: NetworkTasks, records_url: str, target: str,
                              repeat: int = 20) -> TunedNetworkTiming:
    """Runs on a Dask measure worker (the flow's last step): the same, from the store at `records_url`,
    in a fresh worker process as the runner times each kernel (`codegen.worker_pool`), not in the Dask
    worker's own thread. There, beside the worker's event loop and other threads on a 2-core VM, the
    same ResNet-18 store timed 11.1-17.9 ms (median 13.4) against 10.1-12.6 (10.6) in a process of its
    own, five alternating pairs, 2026-11-27 (the flow had reported 14.7 and 16.6 ms for stores that
    `run-network` then timed at 9.4 and 9.9). And a network whose kernel crashes costs this job, not
    the worker."""
    with WorkerPool("tensortune.flows.tuned_network:_network_timing", 1, NETWORK_JOB_TIMEOUT_S) as pool:
        [done] = pool.map([(net, records_url, target, repeat)])
    if not done.ok:
        raise RuntimeError(f"timing the tuned network failed: {done.error}")
    return done.value


def _network_timing(payload: tuple[NetworkTasks, str, str, int]) -> TunedNetworkTiming:
    """The worker process's job (see measure_tuned_network_job)."""
    net, records_url, target, repeat = payload
    return measure_tuned_network(net, RecordStore(records_url, auto_compact=None), target, repeat=repeat)
