"""`python -m bench codegen`: can the backend emit code the search can win with?

Times float32 matmul 1024^3 and the ResNet-18 conv2d+relu layer three ways — the naive schedule, a
hand-written schedule (a step list: multi-level tiling, vectorize, unroll, parallel) and the library
(NumPy/OpenBLAS, PyTorch CPU) — through the same isolated runner the tuner uses, and reports each as
GFLOP/s, a ratio against the library and a fraction of the measured FMA peak. Also reports the median
build time of tiled matmul candidates (it bounds trials per minute).
"""
from __future__ import annotations

import argparse
import statistics

from bench.common import (blas_info, ensure_clean_blas_env, measure_fma_peak, median_time, print_table,
                          torch_threads, write_json)


# (ib, jb, kb, ri, rj) of the hand-written matmul per float32 lanes of a hardware vector
TILES_BY_LANES = {16: (128, 256, 64, 8, 32), 8: (128, 128, 64, 4, 16)}


def matmul_schedule(dag, ib: int = 128, jb: int = 256, kb: int = 64, ri: int = 8, rj: int = 32):
    """Register tile ri x rj accumulated in C.local over a kb slice of K; (ib x jb) blocks run in parallel.

    The defaults won a sweep on an AVX-512 Xeon: an 8 x 32 tile (16 zmm accumulators, two 16-float loads
    of B and eight broadcasts of A per k) ran at 200-234 GFLOP/s where 4 x 64 ran at 146-177. With AVX2
    (16 ymm registers) that tile spills; `TILES_BY_LANES` holds the winner of a sweep on a Zen 3 EPYC.
    """
    from search.state import State
    s = State(dag).cache_write("C", "local")
    s = s.split("C.local", 0, [ib // ri, ri]).split("C.local", 3, [jb // rj, rj]).split("C.local", 6, [kb])
    s = s.reorder("C.local", [0, 3, 6, 1, 4, 7, 2, 5]).unroll("C.local", 6).vectorize("C.local", 7)
    s = s.split("C", 0, [ib]).split("C", 2, [jb]).reorder("C", [0, 2, 1, 3]).fuse("C", [0, 1])
    s = s.parallel("C", 0).vectorize("C", 2)
    return s.compute_at("C.local", "C", 0)


def conv_relu_schedule(dag, f1: int = 2, f2: int = 8, y1: int = 28, y2: int = 2, x2: int = 8, rc: int = 64):
    """The relu loop nest tiles (f, y, x) and computes the conv per tile: an f2 x y2 x x2 register tile."""
    from search.state import State
    r, c = "T_relu", "conv2d_nchw"
    s = State(dag)
    s = s.split(r, 1, [f1, f2]).split(r, 4, [y1, y2]).split(r, 7, [x2])
    s = s.reorder(r, [0, 1, 4, 7, 2, 5, 3, 6, 8]).fuse(r, [0, 1, 2, 3]).parallel(r, 0).vectorize(r, 5)
    s = s.compute_at(c, r, 0)
    s = s.split(c, 1, [f2]).split(c, 3, [y2]).split(c, 5, [x2]).split(c, 7, [rc])
    s = s.reorder(c, [0, 1, 3, 5, 7, 9, 10, 8, 2, 4, 6]).unroll(c, 8).unroll(c, 9).vectorize(c, 10)
    p = s.stage_id("pad_temp")
    return s.split(p, 3, [8]).fuse(p, [0, 1, 2]).parallel(p, 0).vectorize(p, 2)


def main(argv: list[str]) -> int:
    ensure_clean_blas_env()
    ap = argparse.ArgumentParser(prog="python -m bench codegen")
    ap.add_argument("--json", help="write one JSON object per row to this file")
    ap.add_argument("--size", type=int, default=1024, help="matmul N=M=K")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-naive", action="store_true", help="skip the (slow) naive schedules")
    args = ap.parse_args(argv)

    from codegen.measure import LocalBuilder, LocalRunner, TimingConfig
    from codegen.target import make_task
    from search.state import State
    from tasks.workload_registry import make_dag

    peak1, peak_all = measure_fma_peak(1), measure_fma_peak(args.threads)
    print(f"BLAS: {blas_info()}; fp32 FMA peak {peak1:.0f} GFLOP/s (1 thread), {peak_all:.0f} ({args.threads})")
    builder, runner = LocalBuilder(), LocalRunner(timeout=120, config=TimingConfig(repeat=5, min_repeat_ms=200))
    rows = []

    def run(task, name: str, state, lib_ms: float, lib: str) -> None:
        (b,) = builder.build(task, [state.steps_json()])
        (r,) = runner.run(task, [b])
        if r.error_code:
            print(f"{name}: error {r.error_code}: {r.error_msg[:300]}")
            return
        ms = statistics.median(r.costs) * 1e3
        rows.append({"name": name, "ms": ms, "gflops": task.flops / ms / 1e6, f"{lib}_ms": lib_ms,
                     f"ratio_vs_{lib}": lib_ms / ms, "peak_frac": task.flops / ms / 1e6 / peak_all,
                     "build_s": b.seconds, "steps": state.steps_json()})

    n = args.size
    mm = make_task(make_dag("matmul", n, n, n))
    a, b = mm.dag.random_inputs()
    np_ms = median_time(lambda: a @ b) * 1e3
    rows.append({"name": f"numpy matmul {n}^3", "ms": np_ms, "gflops": mm.flops / np_ms / 1e6, "numpy_ms": np_ms,
                 "ratio_vs_numpy": 1.0, "peak_frac": mm.flops / np_ms / 1e6 / peak_all})
    if not args.skip_naive:
        run(mm, f"naive matmul {n}^3", State(mm.dag), np_ms, "numpy")
    tile = TILES_BY_LANES.get(mm.hardware.vector_unit_bytes // 4, TILES_BY_LANES[16])
    run(mm, f"hand-written matmul {n}^3", matmul_schedule(mm.dag, *tile), np_ms, "numpy")

    conv = make_task(make_dag("conv2d_relu", 1, 56, 56, 64, 64, 3, 3, 1, 1))
    torch = torch_threads(args.threads)
    if torch is not None:
        x, w = (torch.from_numpy(v) for v in conv.dag.random_inputs())
        fn = torch.nn.functional.conv2d
        t_ms = median_time(lambda: torch.relu(fn(x, w, padding=1))) * 1e3
        rows.append({"name": "torch conv2d+relu (ResNet-18 layer)", "ms": t_ms, "gflops": conv.flops / t_ms / 1e6,
                     "torch_ms": t_ms, "ratio_vs_torch": 1.0, "peak_frac": conv.flops / t_ms / 1e6 / peak_all})
    else:
        t_ms = float("nan")
        print("PyTorch is not installed (pip install torch==2.13.0): conv rows have no torch ratio")
    if not args.skip_naive:
        run(conv, "naive conv2d+relu", State(conv.dag), t_ms, "torch")
    run(conv, "hand-written conv2d+relu", conv_relu_schedule(conv.dag), t_ms, "torch")

    # build-time distribution of tiled matmul candidates (what bounds trials per minute)
    variants = [matmul_schedule(mm.dag, ib, jb, kb, ri, rj).steps_json()
                for ib, jb, kb, ri, rj in [(64, 256, 256, 4, 64), (32, 128, 128, 8, 32), (64, 128, 64, 4, 32),
                                           (128, 256, 128, 8, 64), (32, 256, 512, 2, 64), (64, 64, 256, 4, 16),
                                           (16, 512, 128, 2, 128), (128, 128, 32, 16, 16)]]
    times = sorted(r.seconds for r in builder.build(mm, variants) if r.error_code == 0)
    med = statistics.median(times)
    print(f"median build time of {len(times)} tiled matmul candidates: {med:.3f} s "
          f"(min {times[0]:.3f}, max {times[-1]:.3f})")
    rows.append({"name": "median build, tiled matmul candidate", "build_s": med})
    builder.close()
    runner.close()
    print_table(rows, ["name", "ms", "gflops", "numpy_ms", "ratio_vs_numpy", "torch_ms", "ratio_vs_torch",
                       "peak_frac", "build_s"])
    write_json(args.json, [{**r, "peak_gflops": peak_all, "peak_gflops_1t": peak1} for r in rows])
    return 0
