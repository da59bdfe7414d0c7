"""`python -m bench ceiling`: what a register kernel reaches on this machine, and how steady its peak is.

Issue 19's bar is a fraction of the FMA peak, the best of 20 short runs of independent FMAs
(common.fma_peak_runs). Two questions decide what a tuned kernel's fraction says about the search:

1. How far the other runs of the peak fall below their best. On a shared VM a vCPU is lent, not owned:
   where the median run of the peak loop itself is at 0.89 of the best (the Xeon VM of 2026-11-26:
   0.83-0.96), no kernel holds 0.93 for long.
   The runs of the peak loop and batches of each kernel (each about 5 ms) take turns, 20 rounds, so a
   slow moment of the host falls on all of them; each series reports its best, median, lower quartile
   and worst as fractions of the best peak run.
2. What the kernel a BLAS would use reaches here, with nothing between it and the machine: a block of
   accumulators in registers (4 rows x 4 vectors with 32 vector registers, 6 x 2 with 16), fed by
   broadcasts of A and vector loads of a packed B, written straight in LLVM IR and run by libgomp as
   our kernels are. Three placements of its operands: both in L1; B's panel (the whole 1024-long
   reduction) streaming from L2; and, on top of that, A streaming from memory, its rows 4 KB apart as a
   1024^3 matmul's are. The gap between the placements is what the memory system costs; the gap between
   the last and a tuned matmul is what our schedules cost.

Every kernel's output is checked against NumPy before it is timed.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from dataclasses import dataclass

import numpy as np

from bench.common import FmaPeakLoop, _perf_clock, environment, jit_function, print_table, write_json
from tensortune.codegen.alignment import aligned
from tensortune.codegen.target import parse_target

ROUNDS = 20                   # rounds of one peak run and one batch of each kernel, as the peak takes 20
BATCH_SECONDS = 0.005         # a batch lasts about as long as one run of the peak loop


@dataclass(frozen=True)
class Placement:
    """Where the kernel's operands live: a reduction of `k`, A's rows `lda` floats apart; each of the
    `blocks` blocks of a call reads A (and B) `a_step` (`b_step`) floats further on (0: the same data)."""
    name: str
    k: int
    lda: int
    blocks: int
    a_step: int
    b_step: int


def placements(rows: int) -> list[Placement]:
    """L1: a 64-long reduction over the same panels; L2: B's 1024 x N panel (256 KB with AVX-512);
    memory: A's 1024 rows of 4 KB each streamed once per call, B's panel from L2."""
    return [Placement("A and B in L1", 64, 64, 30_000, 0, 0),
            Placement("B from L2 (1024-long panel)", 1024, 1024, 2_000, 0, 0),
            Placement("B from L2, A streamed (rows 4 KB apart)", 1024, 1024, 1024 // rows, rows * 1024, 0)]


def register_block(vector_unit_bytes: int) -> tuple[int, int, int]:
    """(rows, vectors, lanes) of the accumulator block: 16 of 32 registers with AVX-512, 12 of 16 below,
    leaving room for B's vectors and one broadcast."""
    lanes = max(4, vector_unit_bytes // 4)
    return (4, 4, lanes) if vector_unit_bytes >= 64 else (6, 2, lanes)


def host_block() -> tuple[int, int, int]:
    """The accumulator block for this machine's vector width."""
    return register_block(parse_target("llvm").hardware.vector_unit_bytes)


def kernel_ir(rows: int, vecs: int, lanes: int, k: int, lda: int, cpu: str, features: str) -> str:
    """@kernel_threads(ptr args, i32 threads): on each libgomp thread t, args[t] = {A, B, C, blocks,
    a_step, b_step} (six i64) and C[rows x N] += sum over blocks b of A_b[rows x k] @ B_b[k x N], N =
    vecs * lanes, A_b = A + b * a_step (rows lda apart), B_b = B + b * b_step (k x N, row-major)."""
    vec, n = f"<{lanes} x float>", vecs * lanes
    body = ["  %tid = call i32 @omp_get_thread_num()",
            "  %slot = mul i32 %tid, 6",
            "  %s = sext i32 %slot to i64"]
    body.append("  %mine = getelementptr i64, ptr %args, i64 %s")
    for f, name in enumerate(("a", "b", "c", "blocks", "astep", "bstep")):
        body.append(f"  %p{name} = getelementptr i64, ptr %mine, i64 {f}")
        body.append(f"  %{name} = load i64, ptr %p{name}")
    body += ["  %A = inttoptr i64 %a to ptr", "  %B = inttoptr i64 %b to ptr", "  %C = inttoptr i64 %c to ptr",
             "  br label %block", "block:",
             "  %r = phi i64 [0, %entry], [%r.next, %store]",
             "  %aoff = mul i64 %r, %astep", "  %boff = mul i64 %r, %bstep",
             "  %Ar = getelementptr float, ptr %A, i64 %aoff", "  %Br = getelementptr float, ptr %B, i64 %boff",
             "  br label %step", "step:",
             "  %k = phi i64 [0, %block], [%k.next, %step]"]
    body += [f"  %acc{a} = phi {vec} [zeroinitializer, %block], [%fma{a}, %step]" for a in range(rows * vecs)]
    body.append(f"  %brow = mul i64 %k, {n}")
    for j in range(vecs):
        body += [f"  %bo{j} = add i64 %brow, {j * lanes}", f"  %bp{j} = getelementptr float, ptr %Br, i64 %bo{j}",
                 f"  %bv{j} = load {vec}, ptr %bp{j}, align 4"]
    for i in range(rows):
        body += [f"  %ao{i} = add i64 %k, {i * lda}", f"  %ap{i} = getelementptr float, ptr %Ar, i64 %ao{i}",
                 f"  %as{i} = load float, ptr %ap{i}",
                 f"  %ai{i} = insertelement {vec} poison, float %as{i}, i32 0",
                 f"  %ab{i} = shufflevector {vec} %ai{i}, {vec} poison, <{lanes} x i32> zeroinitializer"]
        body += [f"  %fma{i * vecs + j} = call {vec} @llvm.fma.v{lanes}f32({vec} %ab{i}, {vec} %bv{j}, "
                 f"{vec} %acc{i * vecs + j})" for j in range(vecs)]
    body += ["  %k.next = add i64 %k, 1", f"  %more = icmp ult i64 %k.next, {k}",
             "  br i1 %more, label %step, label %store", "store:"]
    for i in range(rows):
        for j in range(vecs):
            a = i * vecs + j
            body += [f"  %cp{a} = getelementptr float, ptr %C, i64 {i * n + j * lanes}",
                     f"  %co{a} = load {vec}, ptr %cp{a}, align 4",
                     f"  %cs{a} = fadd {vec} %co{a}, %fma{a}",
                     f"  store {vec} %cs{a}, ptr %cp{a}, align 4"]
    body += ["  %r.next = add i64 %r, 1", "  %again = icmp ult i64 %r.next, %blocks",
             "  br i1 %again, label %block, label %done", "done:", "  ret void"]
    return "\n".join([
        "declare void @GOMP_parallel(ptr, ptr, i32, i32)",
        "declare i32 @omp_get_thread_num()",
        f"declare {vec} @llvm.fma.v{lanes}f32({vec}, {vec}, {vec})",
        "define void @kernel_body(ptr %args) #0 {", "entry:", *body, "}",
        "define void @kernel_threads(ptr %args, i32 %threads) #0 {",
        "  call void @GOMP_parallel(ptr @kernel_body, ptr %args, i32 %threads, i32 0)",
        "  ret void", "}",
        f'attributes #0 = {{ nounwind "target-cpu"="{cpu}" "target-features"="{features}" '
        f'"prefer-vector-width"="{lanes * 32}" "min-legal-vector-width"="{lanes * 32}" }}'])


class RegisterKernel:
    """The IR kernel compiled for the host, with per-thread operands (each thread its own A, B, C, as
    a parallel matmul's threads own their rows of A and C)."""

    def __init__(self, place: Placement, threads: int, seed: int = 0):
        target = parse_target("llvm")
        self.rows, self.vecs, self.lanes = register_block(target.hardware.vector_unit_bytes)
        self.place, self.threads, self.n = place, threads, self.vecs * self.lanes
        ir = kernel_ir(self.rows, self.vecs, self.lanes, place.k, place.lda, target.cpu, target.features)
        self._engine, self._fn = jit_function(ir, "kernel_threads", ctypes.c_void_p, ctypes.c_int32)
        rng = np.random.default_rng(seed)
        a_len = (place.blocks - 1) * place.a_step + (self.rows - 1) * place.lda + place.k
        b_len = (place.blocks - 1) * place.b_step + place.k * self.n
        self.a = [aligned(rng.random(a_len, dtype=np.float32)) for _ in range(threads)]
        self.b = [aligned(rng.random(b_len, dtype=np.float32)) for _ in range(threads)]
        self.c = [aligned(np.zeros(self.rows * self.n, np.float32)) for _ in range(threads)]
        self._args = np.array([[x.ctypes.data for x in (a, b, c)] + [place.blocks, place.a_step, place.b_step]
                               for a, b, c in zip(self.a, self.b, self.c)], dtype=np.int64)

    @property
    def flops(self) -> int:
        """Floating-point operations of one call, all threads."""
        return 2 * self.place.blocks * self.place.k * self.rows * self.n * self.threads

    def __call__(self) -> None:
        self._fn(self._args.ctypes.data, self.threads)

    def expected(self, t: int, blocks: int) -> np.ndarray:
        """Thread t's C after one call of `blocks` blocks from zero, by NumPy (float64)."""
        p, out = self.place, np.zeros((self.rows, self.n))
        for r in range(blocks):
            rows = [self.a[t][r * p.a_step + i * p.lda: r * p.a_step + i * p.lda + p.k] for i in range(self.rows)]
            panel = self.b[t][r * p.b_step: r * p.b_step + p.k * self.n].reshape(p.k, self.n)
            out += np.array(rows, dtype=np.float64) @ panel.astype(np.float64)
        return out

    def check(self, blocks: int = 4) -> None:
        """One call of at most `blocks` blocks from zero (a float32 sum of 30 000 would drift from the
        float64 reference by more than any tolerance that still catches a wrong index), each thread's C
        against NumPy; AssertionError on a mismatch."""
        blocks = min(blocks, self.place.blocks)
        for c in self.c:
            c[:] = 0
        self._args[:, 3] = blocks
        try:
            self()
        finally:
            self._args[:, 3] = self.place.blocks
        for t, c in enumerate(self.c):
            want = self.expected(t, blocks)
            np.testing.assert_allclose(c.reshape(want.shape), want, rtol=1e-5)

    def calls_per_batch(self) -> int:
        """Calls that make one timed batch last about as long as a run of the peak loop."""
        return max(1, round(BATCH_SECONDS / max(_perf_clock(self, 1), 1e-6)))

    def batch(self, calls: int) -> float:
        """GFLOP/s of one batch of `calls` calls (bench.common's host clock, as the peak's runs)."""
        return self.flops * calls / _perf_clock(self, calls) / 1e9


def spread(runs: list[float], peak: float) -> dict:
    """The best, median, lower quartile and worst of a series of runs as fractions of `peak` (the best
    run of the peak loop in the same rounds)."""
    ranked = sorted(runs)
    return {"peak_frac": ranked[-1] / peak, "median_frac": statistics.median(runs) / peak,
            "p25_frac": ranked[len(ranked) // 4] / peak, "worst_frac": ranked[0] / peak}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench ceiling")
    ap.add_argument("--threads", type=int, default=2, help="the most threads (1 is always measured too)")
    ap.add_argument("--json", help="write the environment and the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.threads < 1:
        print("error: --threads must be at least 1", file=sys.stderr)
        return 2
    env = environment(args.threads, peak=False)
    rows = []
    for threads in sorted({1, args.threads}):
        peak = FmaPeakLoop(threads)
        kernels = [RegisterKernel(place, threads) for place in placements(host_block()[0])]
        for kernel in kernels:
            kernel.check()
        calls = [kernel.calls_per_batch() for kernel in kernels]
        # one peak run and one batch of each kernel per round: a slow moment of the host falls on all
        peak_runs, runs = [], [[] for _ in kernels]
        for _ in range(ROUNDS):
            peak_runs.append(peak.run())
            for kernel, n, out in zip(kernels, calls, runs):
                out.append(kernel.batch(n))
        best = max(peak_runs)
        rows.append({"threads": threads, "case": f"FMA peak loop ({ROUNDS} runs)", "gflops": best,
                     **spread(peak_runs, best)})
        for kernel, out in zip(kernels, runs):
            rows.append({"threads": threads, "case": kernel.place.name, "gflops": max(out), **spread(out, best),
                         "block": f"{kernel.rows}x{kernel.vecs} vectors of {kernel.lanes}"})
            print(f"  {threads} thread(s), {kernel.place.name}: best {max(out):.0f} GFLOP/s, "
                  f"{max(out) / best:.3f} of the peak", flush=True)
    print_table(rows, ["threads", "case", "gflops", "peak_frac", "median_frac", "p25_frac", "worst_frac",
                       "block"])
    write_json(args.json, rows, env)
    return 0
