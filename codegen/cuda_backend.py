"""The CUDA backend: State -> CUDA C -> cubin (nvcc), and cubin -> checked, timed runs (pycuda).

Building needs nvcc only (no driver, no GPU), so compile-only tests and CPU builder nodes can build;
running needs a GPU and pycuda, which is imported on first use. An artifact is the cubin plus its
launch plan: `launch = (kernels, temporaries)`, kernels = ((name, grid xyz, block xyz, dynamic shared
bytes, parameter buffer names, written buffer names), ...) launched in order, temporaries = ((name,
dtype, elements), ...) the global buffers passed between kernels. Timing follows TVM's protocol
(warm-up, `number` runs per repeat raised until a repeat lasts `min_repeat_ms`, `repeat` repeats),
measured with CUDA events around back-to-back launches. A kernel that faults with a sticky error (an
illegal address) leaves no usable CUDA context in its process: the runner process then ends and its
pool replaces it.
"""
from __future__ import annotations

import atexit
import math
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Sequence

import numpy as np

from tensortune.codegen.artifact import Artifact
from tensortune.codegen.cuda_codegen import CudaCodegenError, CudaModule, generate_cuda
from tensortune.codegen.gpu_device import device_hardware_params
from tensortune.codegen.lower import LoweringError, lower
from tensortune.codegen.target import Target, parse_target
from tensortune.codegen.timing import ErrorCode, load_reference, reference_file
from tensortune.schedule.state import State
from tensortune.tasks.search_task import HardwareParams, SearchTask

DEFAULT_TARGET = "cuda -arch=sm_90"
NVCC_ENV = "TENSORTUNE_NVCC"
DEVICE_ENV = "TENSORTUNE_CUDA_DEVICE"
FAULT_EXIT_CODE = 70          # a runner process ends with this after a sticky CUDA fault


class CudaCompileError(RuntimeError):
    """nvcc rejected the generated source; the message holds its diagnostics."""


# ------------------------------------------------------------------------------ build (no GPU needed)

def find_nvcc() -> str | None:
    """$TENSORTUNE_NVCC, the CUDA toolkit's own nvcc, or the first one on PATH."""
    for cand in (os.environ.get(NVCC_ENV), "/usr/local/cuda/bin/nvcc", shutil.which("nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def compile_cubin(source: str, arch: str = "sm_90", options: Sequence[str] = ()) -> bytes:
    """nvcc -cubin for one architecture; raises CudaCompileError with nvcc's output."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaCompileError(f"nvcc not found (set ${NVCC_ENV} or install the CUDA toolkit)")
    with tempfile.TemporaryDirectory(prefix="tensortune-cuda-") as tmp:
        src, out = os.path.join(tmp, "kernel.cu"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(source)
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", *options, "-o", out, src]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            output = proc.stderr.strip() or proc.stdout.strip()
            raise CudaCompileError(f"nvcc failed ({' '.join(cmd[1:-3])}):\n{output}")
        with open(out, "rb") as f:
            return f.read()


def check_limits(module: CudaModule, hw: HardwareParams) -> None:
    """Reject kernels the target cannot launch, before spending nvcc time on them."""
    for k in module.kernels:
        if hw.max_threads_per_block and k.threads > hw.max_threads_per_block:
            raise LoweringError(f"{k.name}: {k.threads} threads per block exceed the target's "
                                f"{hw.max_threads_per_block}")
        if hw.max_shared_memory_per_block and k.shared_bytes > hw.max_shared_memory_per_block:
            raise LoweringError(f"{k.name}: {k.shared_bytes} bytes of shared memory exceed the target's "
                                f"{hw.max_shared_memory_per_block} per block")
        if hw.max_vthread_extent and k.vthreads > hw.max_vthread_extent:
            raise LoweringError(f"{k.name}: vthread extent {k.vthreads} exceeds the target's {hw.max_vthread_extent}")
        if k.block[2] > 64 or max(k.grid[1:]) > 65535:
            raise LoweringError(f"{k.name}: launch dimensions grid {k.grid} block {k.block} out of range")


def generate(state: State, name: str = "default_function") -> CudaModule:
    """The CUDA C module of a state (what `build` compiles)."""
    try:
        return generate_cuda(lower(state, name, target_kind="cuda"))
    except CudaCodegenError as err:
        raise LoweringError(str(err)) from None


def build(state: State, target: Target | str = DEFAULT_TARGET, keep_source: bool = False,
          hardware: HardwareParams | None = None) -> Artifact:
    """Lower, generate CUDA C, check the target's limits, compile to a cubin for the target's -arch."""
    t = parse_target(target)
    hw = hardware or t.hardware
    func_name = "default_function"
    module = generate(state, func_name)
    check_limits(module, hw)
    cubin = compile_cubin(module.source, t.arch or "sm_90")
    kernels = tuple((k.name, k.grid, k.block, 0, k.params, k.writes) for k in module.kernels)
    args = tuple((t_.name, t_.shape, t_.dtype) for t_ in state.dag.args)
    return Artifact("cuda", func_name, cubin, args, launch=(kernels, module.temps),
                    source=module.source if keep_source else "")


# ------------------------------------------------------------------------------ device (pycuda, lazily)

class _Runtime:
    """One CUDA context per process, made current on first use and released at exit."""

    def __init__(self, device: int):
        import pycuda.driver as cuda
        cuda.init()
        self.cuda = cuda
        self.device = cuda.Device(device)
        self.ctx = self.device.make_context()
        atexit.register(self.close)

    def close(self) -> None:
        if self.ctx is None:
            return
        try:
            self.ctx.pop()
            self.ctx.detach()
        except Exception:  # noqa: BLE001 - a context broken by a faulting kernel cannot be released cleanly
            pass
        self.ctx = None


_RUNTIME: _Runtime | None = None


def runtime() -> _Runtime:
    global _RUNTIME
    if _RUNTIME is None or _RUNTIME.ctx is None:
        _RUNTIME = _Runtime(int(os.environ.get(DEVICE_ENV, "0")))
    return _RUNTIME


def reset_runtime() -> None:
    """Drop the context (after a faulting kernel it is unusable); the next use makes a fresh one."""
    global _RUNTIME
    if _RUNTIME is not None:
        _RUNTIME.close()
    _RUNTIME = None


def gpu_available() -> bool:
    """Whether pycuda imports and sees at least one GPU (never raises)."""
    try:
        import pycuda.driver as cuda
        cuda.init()
        return cuda.Device.count() > 0
    except Exception:  # noqa: BLE001 - no pycuda, no driver, no device: all mean "no"
        return False


def device_target(device: int = 0, default: str = DEFAULT_TARGET) -> str:
    """A target string carrying the GPU's own limits when one is present, else `default`."""
    try:
        arch, hw = device_hardware_params(device)
    except Exception:  # noqa: BLE001 - no GPU here: the target string's limits stand
        return default
    return (f"cuda -arch={arch} -max-threads={hw.max_threads_per_block} "
            f"-max-shared-memory={hw.max_shared_memory_per_block} -warp-size={hw.warp_size} "
            f"-num-sms={hw.num_cores}")


class CUDAKernel:
    """A loaded artifact: call it with numpy arrays (inputs then outputs, like LLVMKernel), or keep
    arguments on the device (`device_args`) and `launch` / `time` it there."""

    def __init__(self, artifact: Artifact):
        if artifact.kind != "cuda":
            raise ValueError(f"CUDAKernel needs a cuda artifact, got {artifact.kind!r}")
        rt = runtime()
        self.cuda, self.artifact = rt.cuda, artifact
        self.module = rt.cuda.module_from_buffer(artifact.binary)
        kernels, temps = artifact.launch
        self.kernels = []
        for name, grid, block, shared, params, _ in kernels:
            fn = self.module.get_function(name)
            fn.prepare("P" * len(params))
            self.kernels.append((fn, tuple(grid), tuple(block), int(shared), tuple(params)))
        self.written = sorted({p for k in kernels for p in k[5]})
        self.temps = {name: rt.cuda.mem_alloc(max(1, size * np.dtype(_np(dtype)).itemsize))
                      for name, dtype, size in temps}

    def device_args(self, arrays: Sequence[np.ndarray]) -> dict:
        """Device copies of the arguments (checked against the signature), by buffer name."""
        specs = self.artifact.args
        if len(arrays) != len(specs):
            raise ValueError(f"kernel takes {len(specs)} arrays ({', '.join(s[0] for s in specs)}), got {len(arrays)}")
        out = dict(self.temps)
        for arr, (name, shape, dtype) in zip(arrays, specs):
            if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(_np(dtype)):
                raise ValueError(f"argument {name} must be {dtype}{list(shape)}, got {arr.dtype}{list(arr.shape)}")
            out[name] = self.cuda.to_device(np.ascontiguousarray(arr))
        return out

    def launch(self, dev: dict, n: int = 1) -> None:
        """Launch the kernels in order, n times (asynchronous)."""
        calls = [(fn, grid, block, shared, [int(dev[p]) for p in params])
                 for fn, grid, block, shared, params in self.kernels]
        for _ in range(n):
            for fn, grid, block, shared, ptrs in calls:
                fn.prepared_call(grid, block, *ptrs, shared_size=shared)

    def __call__(self, *arrays: np.ndarray) -> None:
        dev = self.device_args(arrays)
        self.launch(dev)
        self.cuda.Context.synchronize()
        for arr, (name, _, _) in zip(arrays, self.artifact.args):
            if name in self.written:
                self.cuda.memcpy_dtoh(arr, dev[name])

    def time(self, dev: dict, number: int = 3, repeat: int = 1, min_repeat_ms: float = 100.0,
             warmup: int = 1, warm: bool = False) -> list[float]:
        """Seconds per run, one per repeat (TVM's time_evaluator with CUDA events): `number` runs per
        repeat, raised until a repeat lasts min_repeat_ms; a kernel whose one run already lasts that
        long runs once per repeat. `warm`: it just ran (the correctness check), skip the warm-up."""
        start, end = self.cuda.Event(), self.cuda.Event()

        def run(n: int) -> float:
            start.record()
            self.launch(dev, n)
            end.record()
            end.synchronize()
            return start.time_till(end) / 1e3

        if not warm:
            for _ in range(warmup):
                run(1)
        once = max(run(1), 1e-9)
        if once * 1e3 >= min_repeat_ms:
            number = 1
        else:
            number = int(min(max(number, math.ceil(min_repeat_ms / 1e3 / once)), 1_000_000))
        return [run(number) / number for _ in range(max(1, repeat))]


def _np(dtype: str) -> str:
    return "bool" if dtype == "bool" else dtype


def _recover_or_exit(err: Exception) -> None:
    """After a failed launch: rebuild the context; if the error is sticky (an illegal address poisons
    every context of the process), end the process so its pool starts a fresh one (the job is
    recorded as a runtime-device failure of this candidate, never of the next)."""
    reset_runtime()
    try:
        rt = runtime()
        rt.cuda.mem_alloc(4).free()
    except Exception:  # noqa: BLE001 - the process's CUDA state is gone
        sys.stderr.write(f"tensortune cuda runner: {type(err).__name__}: {err}; the CUDA context is "
                         f"unusable, restarting the runner process\n")
        sys.stderr.flush()
        os._exit(FAULT_EXIT_CODE)


def run_artifact(task: SearchTask, artifact: Artifact, cfg) -> tuple[list[float], int, str]:
    """Check the kernel against the NumPy reference (poisoned outputs), then time it. A kernel that
    faults costs its own record: the context is rebuilt, or the runner process ends (exit code
    FAULT_EXIT_CODE) when the fault is sticky, so never call this where a fault must not end the
    process — CUDAKernel is the in-process way."""
    from tensortune.tasks.reference import mismatch
    try:
        kernel = CUDAKernel(artifact)
    except ImportError as err:
        return [], int(ErrorCode.RUNTIME_DEVICE), f"pycuda is not installed (pip install tensortune[gpu]): {err}"
    except Exception as err:  # noqa: BLE001 - module load failures are this candidate's
        _recover_or_exit(err)
        return [], int(ErrorCode.RUNTIME_DEVICE), f"{type(err).__name__}: {err}"
    dag = task.dag
    try:
        if cfg.check_correctness:
            path = getattr(cfg, "reference", None) or reference_file(task)
            inputs, refs = load_reference(path, len(dag.inputs))
            outs = [np.full(t.shape, np.nan, dtype=t.dtype) if np.issubdtype(np.dtype(t.dtype), np.floating)
                    else np.zeros(t.shape, dtype=t.dtype) for t in dag.outputs]
            kernel(*inputs, *outs)
            for t, out, ref in zip(dag.outputs, outs, refs):
                bad = mismatch(out, ref)
                if bad is not None:
                    return [], int(ErrorCode.WRONG_ANSWER), f"{t.name}: {bad}"
            args = list(inputs) + outs
        else:
            args = dag.random_inputs(seed=7) + dag.empty_outputs()
        dev = kernel.device_args(args)
        costs = kernel.time(dev, cfg.number, cfg.repeat, cfg.min_repeat_ms, cfg.warmup, warm=cfg.check_correctness)
        return costs, int(ErrorCode.NO_ERROR), ""
    except Exception as err:  # noqa: BLE001 - launch failures, illegal addresses: this candidate's error
        del kernel
        _recover_or_exit(err)
        return [], int(ErrorCode.RUNTIME_DEVICE), f"{type(err).__name__}: {err}"
