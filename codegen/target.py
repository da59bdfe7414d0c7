"""Targets: what a kernel is compiled for, parsed from a TVM-like string ("llvm", "cuda -arch=sm_90")."""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from functools import lru_cache

from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.search_task import HardwareParams, SearchTask


class TargetError(ValueError):
    pass


@dataclass(frozen=True)
class Target:
    kind: str                                   # "llvm" | "cuda"
    cpu: str = ""
    features: str = ""
    arch: str = ""                              # cuda: sm_90
    options: tuple = field(default=())
    hardware: HardwareParams = field(kw_only=True, compare=False)  # every target knows its limits
    num_threads: int = 0                        # llvm: the threads every parallel loop runs on

    def __str__(self) -> str:
        """The target as records store it: CPU and thread count are both part of what was measured, so
        history taken with another thread count never answers for this one."""
        if self.kind == "cuda":
            return f"cuda -arch={self.arch}"
        return f"llvm -mcpu={self.cpu} -num-threads={self.num_threads}"

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"


def _host_cpu() -> tuple[str, str]:
    import llvmlite.binding as llvm
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_threads() -> int:
    """The cores this process may run on. Deliberately not OMP_NUM_THREADS: a Dask nanny sets that to 1
    in every worker it spawns, and a kernel tuned under it would be tuned for one core."""
    return _cpu_count()


def _threads_option(opts: dict[str, str], text: str) -> int:
    value = opts.get("num-threads", opts.get("num-cores"))
    if value is None:
        return default_threads()
    if not value.isdigit() or int(value) < 1:
        raise TargetError(f"-num-threads must be a positive integer, got {value!r} in {text!r}")
    return int(value)


def _option(part: str) -> tuple[str, str]:
    """'-name=value' -> (name, value); a bare '-flag' has the value ''."""
    name, _, value = part.lstrip("-").partition("=")
    return name, value


def parse_target(text: str | Target = "llvm") -> Target:
    """'llvm' (this host, all its cores), 'llvm -mcpu=znver4 -mattr=+avx2 -num-threads=4', 'cuda' (this
    machine's GPU when there is one, else sm_90), 'cuda -arch=sm_90 [-max-threads=N -max-shared-memory=B
    -warp-size=W -num-sms=S]'. An llvm target's thread count (`-num-threads`, or TVM's `-num-cores`) is
    compiled into every parallel loop, so a kernel runs on it whatever its process's environment says."""
    if isinstance(text, Target):
        return text
    try:
        parts = shlex.split(text or "llvm")
    except ValueError as err:
        raise TargetError(f"cannot parse target {text!r}: {err}") from None
    kind, opts = parts[0], dict(_option(p) for p in parts[1:])
    if kind in ("llvm", "cpu", "c"):
        host_cpu, host_features = _host_cpu()
        cpu = opts.get("mcpu", host_cpu)
        features = opts.get("mattr", host_features if cpu == host_cpu else "")
        vec = 64 if "+avx512f" in features else 32 if "+avx2" in features or "+avx" in features else 16
        threads = _threads_option(opts, text)
        opts = {k: v for k, v in opts.items() if k not in ("num-threads", "num-cores")}
        return Target("llvm", cpu, features, options=tuple(sorted(opts.items())),
                      hardware=HardwareParams(num_cores=threads, vector_unit_bytes=vec), num_threads=threads)
    if kind == "cuda":
        if not opts and (local := _local_gpu()) is not None:
            return local                         # bare "cuda": this machine's GPU, with its own limits
        arch = opts.get("arch", "sm_90")
        if not arch.startswith("sm_") or not arch[3:].isdigit():
            raise TargetError(f"cuda target needs -arch=sm_XY (e.g. sm_90), got {arch!r}")
        hw = HardwareParams(
            num_cores=int(opts.get("num-sms", 132)), vector_unit_bytes=16, cache_line_bytes=128,
            max_shared_memory_per_block=int(opts.get("max-shared-memory", 48 * 1024)),
            max_local_memory_per_block=2 ** 31 - 1,
            max_threads_per_block=int(opts.get("max-threads", 1024)), max_vthread_extent=8,
            warp_size=int(opts.get("warp-size", 32)))
        return Target("cuda", arch=arch, options=tuple(sorted(opts.items())), hardware=hw)
    raise TargetError(f"unknown target {kind!r} in {text!r}; use 'llvm' (the host CPU) or 'cuda -arch=sm_XY'")


@lru_cache(maxsize=1)
def _local_gpu() -> Target | None:
    """The first GPU of this machine as a target (arch and limits read from the driver), if pycuda finds
    one; without one a bare "cuda" means sm_90 with the usual limits."""
    try:
        from tensortune.codegen.gpu_device import device_hardware_params
        arch, hw = device_hardware_params(0)
    except Exception:  # noqa: BLE001 - no pycuda, no driver or no GPU: the string's defaults stand
        return None
    options = (("arch", arch), ("max-shared-memory", str(hw.max_shared_memory_per_block)),
               ("max-threads", str(hw.max_threads_per_block)), ("num-sms", str(hw.num_cores)),
               ("warp-size", str(hw.warp_size)))
    return Target("cuda", arch=arch, options=options, hardware=hw)


def make_task(dag: ComputeDAG, target: str | Target = "llvm", name: str = "", weight: int = 1,
              layout_rewrite: tuple[str, ...] = ()) -> SearchTask:
    """A SearchTask whose hardware limits come from the parsed target (the host CPU for 'llvm');
    `layout_rewrite` names the constant weights its kernels take rewritten (CPU only)."""
    t = parse_target(target)
    return SearchTask(dag, str(t), t.hardware, name or dag.name, weight,
                      tuple(layout_rewrite) if t.kind == "llvm" else ())
