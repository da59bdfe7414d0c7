"""What every benchmark needs: a clean BLAS environment, the machine's peak, reference timings, tables.

Speed is reported as ratios against NumPy/OpenBLAS, PyTorch CPU and the measured FMA peak, all taken
in the same run. OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE (which slow OpenBLAS here) are removed by
re-executing the benchmark before numpy is loaded.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Callable, Sequence

BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def ensure_clean_blas_env() -> None:
    """Re-exec without the variables that slow OpenBLAS (they only take effect at library load)."""
    if any(v in os.environ for v in BLAS_ENV):
        env = {k: v for k, v in os.environ.items() if k not in BLAS_ENV}
        os.execve(sys.executable, [sys.executable, "-m", "bench"] + sys.argv[1:], env)


def blas_info() -> str:
    from threadpoolctl import threadpool_info
    libs = [f"{i['internal_api']} {i.get('version', '')} {i.get('architecture', '')} x{i['num_threads']}"
            for i in threadpool_info() if i["user_api"] == "blas"]
    return "; ".join(libs) or "no BLAS found"


def median_time(fn: Callable[[], object], min_seconds: float = 0.3, repeat: int = 5) -> float:
    """Median seconds per call over `repeat` batches, each batch lasting at least `min_seconds`."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    number = max(1, int(min_seconds / one))
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def paired_ms(library: Callable[[], object], ours: Callable[[], float], pairs: int = 5) -> tuple[float, float, float]:
    """(library ms, our ms, ratio library/ours), each the median over `pairs` alternating timings.

    This machine's speed drifts by tens of percent within minutes (other tenants), so a library timed
    once beside a kernel timed once can make a ratio of anything; timing them in turn and taking the
    median of the per-pair ratios keeps both in the same weather. `ours` returns milliseconds."""
    libs, mine, ratios = [], [], []
    for _ in range(pairs):
        lib = median_time(library, min_seconds=0.2, repeat=3) * 1e3
        me = ours()
        libs.append(lib)
        mine.append(me)
        ratios.append(lib / me if me == me and me > 0 else float("nan"))
    return statistics.median(libs), statistics.median(mine), statistics.median(ratios)


_PEAK_IR = """
declare void @GOMP_parallel(ptr, ptr, i32, i32)
declare VEC @llvm.fma.vWf32(VEC, VEC, VEC)
define void @peak(ptr %out, i64 %iters) #0 {
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%i.next, %loop]
ACC_PHIS
FMAS
  %i.next = add i64 %i, 1
  %c = icmp slt i64 %i.next, %iters
  br i1 %c, label %loop, label %done
done:
SUMS
  store volatile VEC %sum, ptr %out
  ret void
}
define void @peak_body(ptr %d) #0 {
  %buf = alloca VEC, align 64
  %n = load i64, ptr %d
  call void @peak(ptr %buf, i64 %n)
  ret void
}
define void @peak_threads(i64 %iters, i32 %threads) #0 {
  %d = alloca i64
  store i64 %iters, ptr %d
  call void @GOMP_parallel(ptr @peak_body, ptr %d, i32 %threads, i32 0)
  ret void
}
attributes #0 = { nounwind "target-cpu"="CPU" "target-features"="FEATURES" "prefer-vector-width"="BITS" "min-legal-vector-width"="BITS" }
"""


def measure_fma_peak(threads: int) -> float:
    """GFLOP/s of independent chains of native-width FMAs on `threads` threads (the machine's fp32 peak):
    16 chains of 16 floats with AVX-512 (32 registers), 12 of 8 with AVX2 (16 registers), enough to
    cover two FMA pipes' latency without spilling."""
    import ctypes

    import llvmlite.binding as llvm

    from codegen.llvm_backend import _init, _new_target_machine, compile_ir
    from codegen.target import parse_target
    _init()
    target = parse_target("llvm")
    lanes = max(4, target.hardware.vector_unit_bytes // 4)
    n_acc = 16 if lanes >= 16 else 12
    vec = f"<{lanes} x float>"
    phis = "\n".join(f"  %a{k} = phi {vec} [zeroinitializer, %entry], [%f{k}, %loop]" for k in range(n_acc))
    mul = "<" + ", ".join(["float 0x3FF0000020000000"] * lanes) + ">"
    fmas = "\n".join(f"  %f{k} = call {vec} @llvm.fma.v{lanes}f32({vec} %a{k}, {vec} {mul}, {vec} {mul})"
                     for k in range(n_acc))
    sums = f"  %s0 = fadd {vec} %f0, %f1\n" + "\n".join(
        f"  %s{k} = fadd {vec} %s{k - 1}, %f{k + 1}" for k in range(1, n_acc - 1))
    sums += f"\n  %sum = fadd {vec} %s{n_acc - 2}, %f0"
    ir = (_PEAK_IR.replace("ACC_PHIS", phis).replace("FMAS", fmas).replace("SUMS", sums)
          .replace("VEC", vec).replace("vWf32", f"v{lanes}f32").replace("BITS", str(lanes * 32))
          .replace("CPU", target.cpu).replace("FEATURES", target.features))
    obj = compile_ir(ir, target)
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), _new_target_machine(target.cpu, target.features))
    engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
    engine.finalize_object()
    fn = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int32)(engine.get_function_address("peak_threads"))
    iters = 2_000_000
    fn(iters, threads)
    # the best of many short runs: the peak is what the machine can do, and other tenants only slow it
    secs = min(_seconds(lambda: fn(iters, threads)) for _ in range(20))
    return iters * n_acc * lanes * 2 * threads / secs / 1e9


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def torch_threads(n: int):
    """PyTorch with n intra-op threads, or None when torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(n)
    return torch


def print_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "" if v is None else str(v)
    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in columns]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    text = "\n".join(lines)
    print(text)
    return text


def write_json(path: str | None, rows: Sequence[dict]) -> None:
    if path:
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"wrote {len(rows)} rows to {path}")
