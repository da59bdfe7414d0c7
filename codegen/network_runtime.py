"""Whole-network build and run: one kernel per extracted task, buffers planned once, end to end.

Each unique task is compiled from its best record's steps, or from `default_schedule`
(schedule.default_schedule) where it has none. At build time every value gets its storage: constants
are used in place, reshapes are views,
and task outputs share a 64-byte aligned arena by liveness (a buffer is reused once its last reader
has run; a kernel's output never shares memory with its own inputs). Every kernel call's argument
pointers are packed once, so a network run is a loop of kernel calls with no allocation.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from tensortune.codegen.alignment import aligned, aligned_empty
from tensortune.codegen.llvm_backend import LLVMKernel, build
from tensortune.codegen.lower import LoweringError
from tensortune.codegen.target import parse_target
from tensortune.schedule.default_schedule import default_schedule
from tensortune.schedule.stage import IllegalStep
from tensortune.schedule.state import State
from tensortune.tasks.extract import ExtractedTask, NetworkTasks
from tensortune.tasks.graph import contiguous

# A float32 network's outputs are compared with the float64 reference by max |out - ref| / max |ref|.
# Each layer's float32 result carries a relative error of about sqrt(K) * 2^-24 for K-term dot
# products (K up to ~5000 here: ~4e-6), and ~50 layers at most compound that to ~2e-4; 1e-3 leaves a
# margin of 5 while a wrong kernel (a bad index, a missed term) errs by O(1) of the output scale.
NETWORK_TOLERANCE = 1e-3


# ------------------------------------------------------------------------------------ compiled network

class _Arena:
    """Liveness-planned storage: freed blocks are reused for later buffers of at most their size."""

    def __init__(self) -> None:
        self.free: list[np.ndarray] = []
        self.total_bytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        fits = [i for i, b in enumerate(self.free) if b.nbytes >= nbytes]
        if fits:
            return self.free.pop(min(fits, key=lambda i: self.free[i].nbytes))
        self.total_bytes += nbytes
        return aligned_empty((nbytes,), np.uint8)

    def give(self, block: np.ndarray) -> None:
        self.free.append(block)


def _view(block: np.ndarray, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    n = math.prod(shape) * np.dtype(dtype).itemsize
    return block[:n].view(dtype).reshape(shape)


def plan_buffers(net: NetworkTasks, arena: _Arena) -> dict[str, np.ndarray]:
    """Every group output's block: taken from `arena` and given back after the last group that reads it
    (graph outputs get blocks of their own, never reused)."""
    graph, groups = net.graph, net.groups
    pinned = {net.storage(v) for v in graph.outputs}
    last_use: dict[str, int] = {}
    for i, g in enumerate(groups):
        for v in g.inputs:
            last_use[net.storage(v)] = i
    planned, live = {}, {}
    for i, g in enumerate(groups):
        nbytes = graph.values[g.output].nbytes
        if g.output in pinned:
            planned[g.output] = _Arena().take(nbytes)
        else:
            planned[g.output] = live[g.output] = arena.take(nbytes)
        for r in {net.storage(v) for v in g.inputs} | {g.output}:
            if r in live and last_use.get(r, i) <= i:
                arena.give(live.pop(r))
    return planned


def touched_bytes(net: NetworkTasks) -> int:
    """Bytes one run of the network reads or writes, each once: its inputs, the constants its groups read
    (a gathered table by the rows taken: BERT reads 128 of its 30522 word embeddings), the planned arena
    and its outputs. Between two runs of one kernel the rest of the network streams about this much
    through the caches: the cold timing of network tuning streams as much (TimingConfig.flush_bytes).
    The direct forms count: a Winograd form's larger weight is not in it."""
    graph = net.graph
    gathered = {n.inputs[0] for n in graph.nodes if n.op == "gather"}
    read: dict[str, int] = {}
    for g in net.groups:
        for v in g.inputs:
            r = net.storage(v)
            if r in graph.constants:
                read[r] = graph.values[g.output].nbytes if r in gathered else graph.constants[r].nbytes
    arena = _Arena()
    plan_buffers(net, arena)
    return (sum(read.values()) + sum(graph.values[v].nbytes for v in graph.inputs) + arena.total_bytes
            + sum(graph.values[v].nbytes for v in graph.outputs))


@dataclass
class TaskKernel:
    """The compiled kernel of one unique task and where its schedule came from."""
    name: str
    workload_key: str
    weight: int
    flops: float
    source: str               # "record" | "default" | "default (record failed: ...)"
    kernel: LLVMKernel = field(repr=False)
    build_seconds: float = 0.0


@dataclass
class NetworkCheck:
    """Per output: max |out - ref| / max |ref| against the float64 reference of the original graph."""
    errors: dict[str, float]
    tolerance: float

    @property
    def passed(self) -> bool:
        return all(e <= self.tolerance for e in self.errors.values())

    def __str__(self) -> str:
        parts = ", ".join(f"{k}: {v:.2e}" for k, v in self.errors.items())
        return f"{'OK' if self.passed else 'MISMATCH'} (relative error {parts}; tolerance {self.tolerance:.0e})"


def relative_errors(outs: Mapping[str, np.ndarray], refs: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Per output: max |out - ref| / max |ref| (inf for a wrong shape or a non-finite value)."""
    errors = {}
    for k, ref in refs.items():
        out = outs[k]
        if out.shape != ref.shape:
            errors[k] = math.inf
            continue
        diff = np.abs(out.astype(np.float64) - ref.astype(np.float64))
        scale = max(float(np.max(np.abs(ref))), 1e-30) if ref.size else 1.0
        errors[k] = math.inf if not np.all(np.isfinite(diff)) else float(np.max(diff)) / scale
    return errors


@dataclass
class Latency:
    """Seconds per network run, one entry per timed run."""
    runs: list[float]

    @property
    def mean_ms(self) -> float:
        return 1e3 * float(np.mean(self.runs))

    @property
    def median_ms(self) -> float:
        return 1e3 * float(np.median(self.runs))

    @property
    def std_ms(self) -> float:
        return 1e3 * float(np.std(self.runs))


class CompiledNetwork:
    """A network ready to run: kernels per task, planned buffers, packed argument lists."""

    def __init__(self, net: NetworkTasks, kernels: list[TaskKernel]):
        self.net, self.kernels = net, kernels
        graph = net.graph
        self.arrays: dict[str, np.ndarray] = {}
        # every array a kernel reads or writes starts at a 64-byte boundary (codegen.alignment)
        for name, info in graph.inputs.items():
            self.arrays[name] = aligned_empty(info.shape, info.dtype)
        for name, arr in graph.constants.items():
            self.arrays[name] = aligned(contiguous(arr))
        self.arena = _Arena()
        self._plan()
        self._calls = []     # per group: (kernel, packed argument pointers, the arrays they point into)
        for g in net.groups:
            kernel = kernels[g.task].kernel
            dag = net.tasks[g.task].dag
            args = [self._array(v).reshape(t.shape) for v, t in zip(g.inputs, dag.inputs)]
            if kernel.artifact.layouts:       # constant weights stored as the kernel reads them, once
                args = [aligned(a) for a in kernel.artifact.layout_inputs([t.name for t in dag.inputs], args)]
            args.append(self._array(g.output))
            self._calls.append((kernel, kernel.pack(args), args))

    def _array(self, value: str) -> np.ndarray:
        if value not in self.arrays:
            info = self.net.graph.values[value]
            self.arrays[value] = self.arrays[self.net.storage(value)].reshape(info.shape)
        return self.arrays[value]

    def _plan(self) -> None:
        for value, block in plan_buffers(self.net, self.arena).items():
            info = self.net.graph.values[value]
            self.arrays[value] = _view(block, info.shape, info.dtype)

    # ------------------------------------------------------------------ running

    def run(self, inputs: Mapping[str, np.ndarray], copy: bool = True) -> dict[str, np.ndarray]:
        """Run the network on `inputs` (name -> array); returns the outputs (views reused by the next
        run when copy=False)."""
        self.set_inputs(inputs)
        self.run_planned()
        return {k: self._array(k).copy() if copy else self._array(k) for k in self.net.graph.outputs}

    def set_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        graph = self.net.graph
        graph.check_inputs(inputs)
        for name, info in graph.inputs.items():
            np.copyto(self.arrays[name], np.asarray(inputs[name]), casting="same_kind")

    def run_planned(self) -> None:
        """One pass of kernel calls over the planned buffers (inputs already set)."""
        for kernel, packed, _ in self._calls:
            kernel.run_packed(packed, 1)

    def benchmark(self, repeat: int = 10, warmup: int = 1, inputs: Mapping[str, np.ndarray] | None = None) -> Latency:
        if repeat < 1:
            raise ValueError(f"repeat must be at least 1, got {repeat}")
        self.set_inputs(inputs if inputs is not None else self.net.graph.random_inputs(0))
        for _ in range(warmup):
            self.run_planned()
        runs = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            self.run_planned()
            runs.append(time.perf_counter() - t0)
        return Latency(runs)

    def profile(self, repeat: int = 20) -> dict[int, float]:
        """Seconds per network run spent in each task (summed over its occurrences), each kernel timed
        alone: the median over `repeat` passes of the network. Not the mean: one pass that meets a stall
        (a descheduled thread on a shared VM) put a 13 us kernel at 1.4 ms in the mean of three, and the
        tasks' sum at four times the network's end-to-end time."""
        self.set_inputs(self.net.graph.random_inputs(0))
        self.run_planned()
        passes: dict[int, list[float]] = {i: [] for i in range(len(self.kernels))}
        for _ in range(repeat):
            spent = dict.fromkeys(passes, 0.0)
            for g, (kernel, packed, _) in zip(self.net.groups, self._calls):
                t0 = time.perf_counter()
                kernel.run_packed(packed, 1)
                spent[g.task] += time.perf_counter() - t0
            for i, seconds in spent.items():
                passes[i].append(seconds)
        return {i: statistics.median(runs) for i, runs in passes.items()}

    def check(self, inputs: Mapping[str, np.ndarray] | None = None, seed: int = 0,
              tolerance: float = NETWORK_TOLERANCE) -> NetworkCheck:
        """Run on random (or given) inputs and compare every output with the original graph's reference."""
        inputs = inputs if inputs is not None else self.net.source.random_inputs(seed)
        return NetworkCheck(relative_errors(self.run(inputs), self.net.source.run_reference(inputs)), tolerance)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the planned arena for intermediate values (outputs and constants excluded)."""
        return self.arena.total_bytes

    def summary(self) -> str:
        lines = [f"{'#':>3} {'task':40s} {'weight':>6} {'MFLOP':>10}  schedule"]
        for i, k in enumerate(self.kernels):
            lines.append(f"{i:3d} {k.name:40s} {k.weight:6d} {k.flops / 1e6:10.2f}  {k.source}")
        return "\n".join(lines)


def task_schedule(task: ExtractedTask, steps: str | list | None) -> tuple[State, str]:
    """The state to build a task from and where it came from: its record's steps when they replay,
    else the default schedule ("default", or "default (record failed: ...)")."""
    if steps:
        try:
            return State.from_json(task.dag, steps), "record"
        except (IllegalStep, LoweringError, KeyError, ValueError) as err:
            return default_schedule(task.dag), f"default (record failed: {str(err)[:120]})"
    return default_schedule(task.dag), "default"


def build_network(net: NetworkTasks, records: Mapping[str, str | list | None] | None = None,
                  target: str = "llvm", costs: Mapping[str, float] | None = None,
                  layout_rewrite: bool = True) -> CompiledNetwork:
    """Compile every task (from `records[workload_key]` steps where present, else the default schedule)
    and plan the network's buffers. With `layout_rewrite` (as network tuning measures), each task's
    constant weights are stored in the layout its schedule reads them in (schedule.layout_rewrite).

    A group with alternative forms (Winograd, `extract_tasks(winograd_tiles=...)`) runs the form whose
    record is fastest by `costs` (workload key -> seconds); with no such record, its direct form: the
    compiled network's `net` and kernels are those of the chosen forms only."""
    t = parse_target(target)
    if t.kind != "llvm":
        raise ValueError(f"run-network builds for the host CPU only (target 'llvm'), got {target!r}")
    records = records or {}
    net = net.resolve_forms(records, costs or {})
    kernels = []
    for task in net.tasks:
        t0 = time.perf_counter()
        state, source = task_schedule(task, records.get(task.workload_key))
        rewrite = task.layout_free if layout_rewrite else ()
        try:
            artifact = build(state, t, rewrite=rewrite)
        except (LoweringError, IllegalStep, ValueError) as err:
            if source != "record":
                raise
            source = f"default (record failed to build: {str(err)[:120]})"
            artifact = build(default_schedule(task.dag), t, rewrite=rewrite)
        kernels.append(TaskKernel(task.name, task.workload_key, task.weight, task.flops, source,
                                  LLVMKernel(artifact), time.perf_counter() - t0))
    return CompiledNetwork(net, kernels)
