"""The LLVM backend: State -> lowered program -> LLVM IR -> O3 -> object code, and object code -> callable.

Builders and runners may live in different processes: only the object-code bytes travel. Loading
uses MCJIT on the bytes; libgomp is loaded once per process for `parallel` loops.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import threading
from functools import lru_cache
from typing import Callable

import llvmlite.binding as llvm
import numpy as np

from tensortune.codegen.alignment import aligned
from tensortune.codegen.artifact import Artifact
from tensortune.codegen.ir import LoweredFunc
from tensortune.codegen.llvm_codegen import generate_llvm_ir
from tensortune.codegen.lower import lower
from tensortune.codegen.target import Target, parse_target
from tensortune.codegen.timing import FLUSH_BYTES, ErrorCode, TimingConfig, flush_cpu_cache, load_reference, time_runs
from tensortune.schedule.layout_rewrite import WeightLayout, weight_layouts
from tensortune.schedule.state import State
from tensortune.tasks import te
from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.reference import mismatch
from tensortune.tasks.search_task import SearchTask

_lock = threading.Lock()


@lru_cache(maxsize=None)
def _gomp() -> ctypes.CDLL:
    """libgomp, found once: find_library runs `ldconfig -p` in a subprocess, and a runner sets the
    thread count before every candidate it times."""
    path = ctypes.util.find_library("gomp")
    if path is None:
        raise RuntimeError("libgomp is not installed (parallel loops run on its thread pool); "
                           "install it, e.g. `apt-get install libgomp1`")
    llvm.load_library_permanently(path)
    return ctypes.CDLL(path)


@lru_cache(maxsize=None)
def _init() -> bool:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    _gomp()
    return True


def set_default_threads(n: int) -> None:
    """libgomp's default team size in this process (what OMP_NUM_THREADS would have set). Generated
    kernels carry their own thread count; this keeps anything else a runner runs from inheriting a
    worker's OMP_NUM_THREADS=1."""
    _init()
    _gomp().omp_set_num_threads(ctypes.c_int(n))


def _new_target_machine(cpu: str, features: str):
    _init()
    return llvm.Target.from_default_triple().create_target_machine(
        cpu=cpu, features=features, opt=3, reloc="pic", codemodel="jitdefault")


@lru_cache(maxsize=8)
def _target_machine(cpu: str, features: str):
    """Shared by compilations. Never hand it to an execution engine: the engine takes ownership."""
    return _new_target_machine(cpu, features)


def compile_ir(ir: str, target: Target) -> bytes:
    """Verify, optimise at O3 and emit object code for the target CPU."""
    tm = _target_machine(target.cpu, target.features)
    with _lock:
        mod = llvm.parse_assembly(ir)
        mod.verify()
        pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
        pb.getModulePassManager().run(mod, pb)
        return tm.emit_object(mod)


@lru_cache(maxsize=4)
def _shared_object_machine(cpu: str, features: str):
    """For code linked into a shared library: position independent, small code model."""
    _init()
    return llvm.Target.from_default_triple().create_target_machine(
        cpu=cpu, features=features, opt=3, reloc="pic", codemodel="default")


def compile_module(irs: list[str], target: Target) -> bytes:
    """Link several IR modules (names must not clash) into one, optimise it at O3 and emit one object
    file for a shared library (what `compile` writes; kernels and driver in one module)."""
    tm = _shared_object_machine(target.cpu, target.features)
    with _lock:
        main = llvm.parse_assembly(irs[0])
        for ir in irs[1:]:
            mod = llvm.parse_assembly(ir)
            mod.verify()
            main.link_in(mod)
        main.verify()
        pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
        pb.getModulePassManager().run(main, pb)
        return tm.emit_object(main)


def default_triple() -> str:
    _init()
    return llvm.get_default_triple()


def assembly(ir: str, target: Target) -> str:
    """The optimised machine code as text (tests check it for zmm registers)."""
    tm = _target_machine(target.cpu, target.features)
    with _lock:
        mod = llvm.parse_assembly(ir)
        pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
        pb.getModulePassManager().run(mod, pb)
        return tm.emit_assembly(mod)


def build_lowered(func: LoweredFunc, target: Target | str = "llvm", keep_source: bool = False,
                  layouts: tuple[WeightLayout, ...] = ()) -> Artifact:
    target = parse_target(target)
    ir = generate_llvm_ir(func, target.cpu, target.features, target.num_threads)
    obj = compile_ir(ir, target)
    return Artifact("llvm", func.name, obj, tuple((b.name, b.shape, b.dtype) for b in func.args),
                    source=ir if keep_source else "", layouts=layouts)


def build(state: State, target: Target | str = "llvm", keep_source: bool = False,
          rewrite: tuple[str, ...] = ()) -> Artifact:
    """Compile a state; the inputs named in `rewrite` (constant weights of a task that opted in) are
    taken in the layout the schedule reads them in where the rule applies (the artifact lists them)."""
    layouts = weight_layouts(state, rewrite) if rewrite else {}
    return build_lowered(lower(state, target_kind="cpu", layouts=layouts), target, keep_source,
                         tuple(layouts.values()))


class LLVMKernel:
    """A loaded kernel: call it with numpy arrays (inputs then outputs), or time `n` calls in one go."""

    def __init__(self, artifact: Artifact):
        _init()
        target = parse_target("llvm")
        self.artifact = artifact
        self._engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""),
                                                  _new_target_machine(target.cpu, target.features))
        self._engine.add_object_file(llvm.ObjectFileRef.from_data(artifact.binary))
        self._engine.finalize_object()
        name = artifact.func_name
        self._packed = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._engine.get_function_address(name + "_packed"))
        self._repeat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)(
            self._engine.get_function_address(name + "_repeat"))
        seen = self._engine.get_global_value_address(name + "_threads")     # 0: a hand-written kernel
        self._threads = ctypes.c_int32.from_address(seen) if seen else None

    @property
    def threads_seen(self) -> int:
        """The threads the last parallel loop this kernel ran had (0: it has run none)."""
        return int(self._threads.value) if self._threads is not None else 0

    def pack(self, arrays) -> ctypes.Array:
        specs = self.artifact.args
        if len(arrays) != len(specs):
            raise ValueError(f"kernel takes {len(specs)} arrays ({', '.join(s[0] for s in specs)}), got {len(arrays)}")
        ptrs = (ctypes.c_void_p * len(arrays))()
        for i, (arr, (name, shape, dtype)) in enumerate(zip(arrays, specs)):
            if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype("bool" if dtype == "bool" else dtype):
                raise ValueError(f"argument {name} must be {dtype}{list(shape)}, got {arr.dtype}{list(arr.shape)}")
            if not arr.flags.c_contiguous:
                raise ValueError(f"argument {name} must be C-contiguous")
            ptrs[i] = arr.ctypes.data
        return ptrs

    def __call__(self, *arrays) -> None:
        self._packed(self.pack(arrays))

    def run_packed(self, packed: ctypes.Array, n: int = 1) -> None:
        self._repeat(packed, n)


class PoolWaker:
    """Runs one tiny parallel loop on `threads` threads: it wakes libgomp's pool.

    Why: between two kernels of a network the pool's threads spin, so a kernel starts on all of them at
    once; after a cache flush (tens of ms) they have gone to sleep, and waking them cost a timed kernel
    30-60 us (MobileNet-V2's 14x14 depthwise conv: 83 us cold, 52 us cold after this call, 44 us warm),
    more than some kernels' own work."""

    def __init__(self, threads: int):
        x = te.placeholder((threads, 16), "float32", "x")
        y = te.compute((threads, 16), lambda i, j: x[i, j] + 1.0, name="y")
        self.kernel = LLVMKernel(build(State(ComputeDAG([x, y])).parallel("y", 0), f"llvm -num-threads={threads}"))
        self._arrays = [np.zeros((threads, 16), np.float32), np.zeros((threads, 16), np.float32)]
        self._packed = self.kernel.pack(self._arrays)      # the packed pointers do not own the arrays

    def __call__(self) -> None:
        self.kernel.run_packed(self._packed, 1)


@lru_cache(maxsize=None)
def pool_waker(threads: int) -> PoolWaker:
    """One PoolWaker per runner process and thread count (compiled once)."""
    return PoolWaker(threads)


def cold_start(activations: list[np.ndarray], threads: int, flush_bytes: int = FLUSH_BYTES) -> Callable[[], None]:
    """What a network's kernel meets when it starts, before each cold timed run: the network's footprint
    streamed through the caches (its weights are where the rest of the network left them,
    codegen.timing.NETWORK_TIMING), its activation inputs read back in (the kernel before it just wrote
    them) and the thread pool awake (the kernel before it just ran)."""
    wake = pool_waker(threads)

    def prepare() -> None:
        flush_cpu_cache(flush_bytes)
        for a in activations:
            a.view(np.uint8).sum()
        wake()
    return prepare


# The fastest run this runner process has timed per task: a candidate far slower than what this node
# already measured is timed once, not `repeat` times.
_BEST_SEEN: dict[str, float] = {}


def run_artifact(task: SearchTask, artifact: Artifact, cfg: TimingConfig) -> tuple[list[float], int, str]:
    """Check the kernel against the task's reference outputs (poisoned with NaN first), then time it on
    the target's threads (runs in a runner process: a crash here costs that process, not the caller)."""
    threads = task.hardware.num_cores
    set_default_threads(threads)
    kernel = LLVMKernel(artifact)
    if cfg.check_correctness and cfg.reference:
        inputs, refs = load_reference(cfg.reference, len(task.dag.inputs))
        # a rewritten kernel is checked on the same reference weights, stored as the network stores them
        inputs = artifact.layout_inputs([t.name for t in task.dag.inputs], inputs)
        outs = [np.full(t.shape, np.nan, dtype=t.dtype) if np.issubdtype(np.dtype(t.dtype), np.floating)
                else np.zeros(t.shape, dtype=t.dtype) for t in task.dag.outputs]
        kernel(*inputs, *outs)
        for t, out, ref in zip(task.dag.outputs, outs, refs):
            bad = mismatch(out, ref)
            if bad is not None:
                return [], int(ErrorCode.WRONG_ANSWER), f"{t.name}: {bad}"
        args = list(inputs) + outs
    else:
        args = artifact.layout_inputs([t.name for t in task.dag.inputs], task.dag.random_inputs(seed=7)) + \
            task.dag.empty_outputs()
    args = [aligned(a) for a in args]           # as the network stores them (codegen.alignment)
    packed = kernel.pack(args)
    warm = cfg.check_correctness and cfg.reference is not None        # the check already ran it
    best = _BEST_SEEN.get(task.workload_key)
    cutoff = best * cfg.slow_factor if best is not None and cfg.slow_factor > 0 else None
    activations = [a for t, a in zip(task.dag.inputs, args) if t.name not in task.layout_rewrite]
    costs = time_runs(lambda n: kernel.run_packed(packed, n), cfg, cold_start(activations, threads, cfg.flush_bytes),
                      warm=warm, cutoff_s=cutoff)
    if kernel.threads_seen not in (0, threads):
        return [], int(ErrorCode.RUNTIME_DEVICE), (
            f"the kernel's parallel loops ran on {kernel.threads_seen} threads, its target asks for {threads} "
            "(OMP_THREAD_LIMIT or another limit in the runner's environment?): not timed as if it were")
    _BEST_SEEN[task.workload_key] = min(best if best is not None else math.inf, min(costs))
    return costs, int(ErrorCode.NO_ERROR), ""
