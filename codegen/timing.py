"""The measuring protocol every backend shares: error codes, the timing configuration, TVM's
time_evaluator loop, the cache flush, and the task's reference inputs and outputs kept on disk.

Both backends' runners (llvm_backend.run_artifact, cuda_backend.run_artifact) and the process pools in
measure.py stand on this file; it imports neither, so the backends never import the measurer.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from typing import Callable

import numpy as np

from tensortune.tasks.search_task import SearchTask


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


FLUSH_BYTES = 64 << 20     # twice the largest L3 measured here (32 MiB): a flush this long empties the caches


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
    # bytes streamed through the caches before each cold run (flush_cache): a network's footprint
    # (codegen.network_runtime.touched_bytes) where the tuner knows the network, else all it takes to
    # empty every cache. Capped at FLUSH_BYTES.
    flush_bytes: int = FLUSH_BYTES
    # untimed flush-and-run cycles before the cold timed runs (flush_cache): a network's kernel meets its
    # data as a steady state of many runs leaves it, not as a first run does (COLD_WARMUP below)
    cold_warmup: int = 0
    # times a runner times its whole batch, every program once a pass (codegen.measure.LocalRunner), each
    # pass with min_repeat_ms / passes; a program's figure is then its fastest pass (OPERATOR_TIMING)
    passes: int = 1


# How network tuning times a kernel: each run with the CPU caches flushed first (TVM's
# enable_cpu_cache_flush, which its network-tuning tutorials turn on). Inside a network a kernel's
# weights come from as far as the rest of the network pushed them: ResNet-18's 44 MiB of weights
# outlive a 32 MiB L3 between two uses of one layer, while a kernel timed warm, back to back, reads them
# from cache: warm timings made the network estimate 18-24 % short of the measured network
# (docs/results/network_resnet18_1152.json) and steer the search toward programs that only win warm.
# Single-operator tuning stays warm, as libraries are timed.
# How far: the network's footprint (flush_bytes, set by the tuner that knows the network). Between two
# runs of one kernel the network streams about that many bytes through the caches, so streaming as many
# leaves in cache what the network leaves. MobileNet-V2 (13 MiB of weights, a 10 MiB arena) keeps its
# weights in a 32 MiB L3: flushing 64 MiB put its estimate 18 % above the measured network, its
# footprint (24 MiB) 1 % below (Zen 5, default schedules; ResNet-18 0.99 both ways).
# The flush leaves more cold than the network does: a CPU runner reads the kernel's activation inputs
# back in and wakes the thread pool before each run (llvm_backend.cold_start), as the kernel before it
# in the network would have left them. Without that, MobileNet-V2's estimate ran 62 % above its
# measured network (small kernels, where a sleeping pool's wake-up and cold activations dominate).
# At the network's pace: a deployed network runs its kernels over and over, and a kernel's data
# settle into the caches over several runs, not one (Xeon VM, 260 MiB L3, ResNet-18 at 32^2: after
# its caches were emptied the network took 5 passes to fall from 2.5 to 1.15 ms, and after a 20 ms
# sleep 4 passes from 2.05; one flush from its steady state cost it 12 %). Timed after one warm-up
# run, the same program measured 12 times in one batch got faster with its place in the batch, 426 to
# 285 us for a layer-3 conv (its reference weights, shared by the batch, settling in), so a round's
# first candidates read slower than its last, and the measured network ran 17-26 % under the estimate.
# Flush-and-run cycles before the timed cold runs bring a candidate, first or last, toward that steady
# state (sums over the 19 tasks against the steady network: 1.47-1.50x after one warm-up run,
# 1.21-1.24x after 2 cycles, 1.09-1.16x after 5, 1.06-1.08x after 10); a candidate whose data are
# already settled (the rest of a batch) stops after a few, the first of a batch runs more. The main
# job's records then sum to 8-11 % under its network's end-to-end time, where they were 37-38 % over,
# for networks as fast (docs/performance.md, "Kernels timed at the network's pace").
COLD_WARMUP = 12               # cycles at most; fewer once SETTLED_RUNS in a row are no faster than
SETTLED = 0.95                 # this fraction of the fastest cycle so far
SETTLED_RUNS = 2
NETWORK_TIMING = TimingConfig(number=3, repeat=1, flush_cache=True, cold_warmup=COLD_WARMUP)


# How a single operator is timed warm (the library's tune_task, `python -m bench tune`): the batch four
# times over, 25 ms a program a pass, the fastest pass counting. This VM's slow spells are one-sided (a
# program timed twelve times in a row read 100 GFLOP/s three times, then 211 nine times) and last longer
# than a timing, so one 100 ms timing a program ranked a batch of a search's conv programs as the
# next one did in 80-87 % of pairs; four interleaved passes of 25 ms in 83-92 %, in about the same
# time (8-13 s a batch of 64 either way); matmul programs 78-91 % against 86-95 %, 18-20 s a batch
# against 21-23 (six and three comparisons, 4-6 timings each; Zen 4 VM, 2026-11-28;
# `python -m bench timing`; docs/performance.md, "Timings that agree"). The passes' mean or median did
# no better than one timing: a slow spell is not noise around the kernel's figure, it is not the
# kernel. Cold network timing keeps one pass: its noise is another (DRAM and the flush), and its
# protocol was calibrated against the measured network.
OPERATOR_TIMING = TimingConfig(passes=4)
# Passes after the first time only the programs within this factor of the batch's fastest: a slow
# program's ranking against the fast ones is not in doubt, and its one run can fill a pass (a batch of
# 64 matmul programs took 57 s in four passes where one pass took 20). The slow spells seen here cost
# a kernel up to 2.1 times its time (once 5 times).
LATER_PASSES_WITHIN = 2.0


MAX_NUMBER = 1_000_000          # runs in one repeat, at most
COLD_SPREAD = 2.0               # a cold repeat whose median is this many times its fastest run ...
STALL_S = 20e-6                 # ... and this much slower (a small kernel's jitter is a few microseconds) ...
COLD_ROUNDS = 3                 # ... is timed longer, up to this many times `number` runs


def _stalled(runs: list[float]) -> bool:
    """The median of these cold runs sits in a stall of the host: far above the fastest run."""
    median, fastest = float(np.median(runs)), min(runs)
    return median > COLD_SPREAD * fastest and median - fastest > STALL_S


def time_runs(run_n: Callable[[int], None], cfg: TimingConfig, flush: Callable[[], None] | None = None,
              warm: bool = False, cutoff_s: float | None = None) -> list[float]:
    """TVM's time_evaluator: warm up, pick `number` so one repeat lasts >= min_repeat_ms, time `repeat`
    repeats. A kernel whose single run already lasts min_repeat_ms runs once per repeat (the run that
    found it so counts as the first), and one slower than `cutoff_s` is not timed further (slow
    candidates should not cost the tuner seconds each).

    With `flush_cache`, the cache is flushed before every timed run and a repeat is the median of `number`
    cold runs (min_repeat_ms does not apply). TVM flushes once per repeat, so only the first of its
    `number` runs is cold unless number=1, which its docs recommend; here every run is cold. The median,
    not the mean: a single run is short (a kernel of a network), so one preemption of one of its threads
    (seen on a shared 2-vCPU VM: gaps of 3-12 ms every ~30 ms) turned a 0.25 ms kernel into a 4 ms mean,
    and the network, timed as the median of its runs, never sees that. A stall can outlast one run, though:
    the main job recorded a 45 us conv's default schedule at 8.2 ms (the median of three cold runs: two
    of them took that long) and printed it as 183 times slower than the tuned program (the next run: an
    8.5 us conv's default at 69 us, 8.1 times). So a repeat whose median is more than COLD_SPREAD times
    its fastest run, and STALL_S slower, gets `number` runs more, up to COLD_ROUNDS * number, and is the
    median of them all; runs that agree within that (this VM's 10-40 % drift, a tiny kernel's
    microseconds of jitter) are timed as before. Untimed flush-and-run cycles come first, until
    SETTLED_RUNS in a row are no faster than SETTLED times the fastest of them, at most `cold_warmup`
    (NETWORK_TIMING: COLD_WARMUP), or until one is slower than `cutoff_s`."""
    if not warm:
        for _ in range(cfg.warmup):
            run_n(1)
    if cfg.flush_cache and flush is not None:
        def cold_run() -> float:
            flush()
            t0 = time.perf_counter()
            run_n(1)
            return time.perf_counter() - t0
        number = max(1, cfg.number)
        fastest, calm = math.inf, 0
        for _ in range(cfg.cold_warmup):
            secs = cold_run()
            if cutoff_s is not None and secs > cutoff_s:
                break                  # a hopeless candidate: its timed runs below are enough
            calm = 0 if secs < SETTLED * fastest else calm + 1
            fastest = min(fastest, secs)
            if calm == SETTLED_RUNS:
                break                  # no longer getting faster: settled
        costs = []
        for _ in range(max(cfg.repeat, 1)):
            runs: list[float] = []
            while not runs or (_stalled(runs) and len(runs) < COLD_ROUNDS * number):
                runs += [cold_run() for _ in range(number)]
            costs.append(float(np.median(runs)))
        return costs
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
        # `number` from one run, then checked: a first run slowed by the machine gives too small a
        # number, and a repeat far shorter than min_repeat_ms (a timeout test saw 2 s asked and 0.4 ms
        # run). A short repeat is run again with more, as bench.common.measure calibrates the other
        # side of every comparison; the first repeat that lasts min_repeat_ms counts.
        number = int(min(max(cfg.number, math.ceil(cfg.min_repeat_ms / 1e3 / once)), MAX_NUMBER))
        while True:
            t0 = time.perf_counter()
            run_n(number)
            secs = time.perf_counter() - t0
            if secs * 1e3 >= cfg.min_repeat_ms or number >= MAX_NUMBER:
                costs.append(secs / number)
                break
            number = int(min(MAX_NUMBER, max(number + 1,
                                              math.ceil(number * 1.1 * cfg.min_repeat_ms / max(secs * 1e3, 1e-6)))))
    for _ in range(max(cfg.repeat, 1) - len(costs)):
        t0 = time.perf_counter()
        run_n(number)
        costs.append((time.perf_counter() - t0) / number)
    return costs


@lru_cache(maxsize=1)
def _flush_buffer() -> np.ndarray:
    return np.zeros(FLUSH_BYTES // 8)


def flush_cpu_cache(nbytes: int = FLUSH_BYTES) -> None:
    """Stream `nbytes` (at most FLUSH_BYTES) through the caches, read and written, as the rest of a
    network does between two runs of one kernel. Always the same memory, as the network's is: what
    fits stays cached beside the kernel's own data, as it would in the network."""
    buf = _flush_buffer()
    buf[:max(1, min(nbytes, FLUSH_BYTES) // 8)] += 1.0


REFERENCE_SEED = 1234


def reference_file(task: SearchTask, cache_dir: str | None = None) -> str:
    """Inputs and reference outputs of a task, computed once (outside any kernel's timeout) and kept
    on disk so every runner process loads them instead of recomputing."""
    import tempfile

    from tensortune.tasks.reference import evaluate
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
