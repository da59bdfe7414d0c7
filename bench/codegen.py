"""`python -m bench codegen`: can the backend emit code the search can win with?

Times float32 matmul 1024^3 and the ResNet-18 conv2d+relu layer three ways — the naive schedule, a
hand-written schedule (a step list: packing, multi-level tiling, vectorize, unroll, parallel) and the library
(NumPy/OpenBLAS, PyTorch CPU) — and the float math the code generator writes out as vector polynomials (exp,
tanh, GELU's erf, sigmoid over 2^20 floats, parallel and vectorised) against PyTorch's. Our programs are timed
by the tuner's isolated runner (`RUNNER_TIMING`: median of 3 repeats of >= 200 ms, the protocol of
bench.common.measure, which times the library in this process); the two are timed in alternating pairs
(bench.common.compare) and each row reports GFLOP/s, the ratio of the medians and the median of the per-pair
ratios, and a fraction of the measured FMA peak. The runner checks every output against the NumPy reference: a
wrong program fails its pairs and has no ratio. `--threads N`: the kernels are compiled for `llvm
-num-threads=N`, NumPy's BLAS and PyTorch are limited to N. Also reports the median build time of tiled matmul
candidates (it bounds trials per minute).
"""
from __future__ import annotations

import argparse
import statistics

from bench.common import (
    BATCHES,
    MIN_BATCH_MS,
    PAIRS,
    compare,
    ensure_clean_blas_env,
    environment,
    in_process,
    limit_threads,
    llvm_target,
    print_table,
    threads_used,
    write_json,
)

# (ib, jb, kb, ri, rj) of the hand-written matmul per float32 lanes of a hardware vector
TILES_BY_LANES = {16: (128, 256, 64, 8, 32), 8: (128, 128, 128, 6, 16)}


def matmul_schedule(dag, ib: int = 128, jb: int = 256, kb: int = 64, ri: int = 8, rj: int = 32, pack: bool = True):
    """Register tile ri x rj accumulated in C.local over a kb slice of K; (ib x jb) blocks run in parallel.
    With `pack`, each kb x jb panel of B is copied to a contiguous local buffer first (what BLAS does and
    the search's add_cache_read_pack sketch does): B's rows are 4 KiB apart, so the k loop otherwise
    touches one cache line per row, all in the same few L1 sets.

    The 8 x 32 tile won an unpacked sweep on an AVX-512 Xeon (16 zmm accumulators, two loads of B and
    eight broadcasts of A per k). With AVX2 (16 ymm registers) that tile spills; 6 x 16 (12 accumulators,
    the classic Haswell sgemm kernel) with packing won on a Zen 3 EPYC: 0.75-0.97x numpy where the
    unpacked 4 x 16 ran at 0.5x.
    """
    from tensortune.schedule.state import State
    s = State(dag).cache_write("C", "local")
    if pack:
        s = s.cache_read("B", "local", ["C.local"])
    s = s.split("C.local", 0, [ib // ri, ri]).split("C.local", 3, [jb // rj, rj]).split("C.local", 6, [kb])
    s = s.reorder("C.local", [0, 3, 6, 1, 4, 7, 2, 5]).unroll("C.local", 6).vectorize("C.local", 7)
    s = s.split("C", 0, [ib]).split("C", 2, [jb]).reorder("C", [0, 2, 1, 3]).fuse("C", [0, 1])
    s = s.parallel("C", 0).vectorize("C", 2)
    s = s.compute_at("C.local", "C", 0)
    return s.compute_at("B.local", "C.local", 2).vectorize("B.local", 1) if pack else s


def conv_relu_schedule(dag, f1: int = 2, f2: int = 8, y1: int = 28, y2: int = 2, x2: int = 8, rc: int = 64):
    """The relu loop nest tiles (f, y, x) and computes the conv per tile: an f2 x y2 x x2 register tile."""
    from tensortune.schedule.state import State
    r, c = "T_relu", "conv2d_nchw"
    s = State(dag)
    s = s.split(r, 1, [f1, f2]).split(r, 4, [y1, y2]).split(r, 7, [x2])
    s = s.reorder(r, [0, 1, 4, 7, 2, 5, 3, 6, 8]).fuse(r, [0, 1, 2, 3]).parallel(r, 0).vectorize(r, 5)
    s = s.compute_at(c, r, 0)
    s = s.split(c, 1, [f2]).split(c, 3, [y2]).split(c, 5, [x2]).split(c, 7, [rc])
    s = s.reorder(c, [0, 1, 3, 5, 7, 9, 10, 8, 2, 4, 6]).unroll(c, 8).unroll(c, 9).vectorize(c, 10)
    p = s.stage_id("pad_temp")
    return s.split(p, 3, [8]).fuse(p, [0, 1, 2]).parallel(p, 0).vectorize(p, 2)


UNARY_OPS = ("exp", "tanh", "gelu", "sigmoid")     # math the code generator emits as vector polynomials


def unary_schedule(dag):
    """An elementwise op over NCHW: outer loops fused and parallel, the row split into 16-lane vectors."""
    from tensortune.schedule.state import State
    s = State(dag)
    out = s.stages[-1].name
    return s.split(out, 3, [16]).fuse(out, [0, 1, 2, 3]).parallel(out, 0).vectorize(out, 1)


def main(argv: list[str]) -> int:
    ensure_clean_blas_env()
    ap = argparse.ArgumentParser(prog="python -m bench codegen")
    ap.add_argument("--json", help="write the environment and the rows to this JSON file")
    ap.add_argument("--size", type=int, default=1024, help="matmul N=M=K")
    ap.add_argument("--threads", type=int, default=2, help="threads of every side (ours, NumPy's BLAS, PyTorch)")
    ap.add_argument("--pairs", type=int, default=PAIRS, help="timing pairs (alternating order)")
    ap.add_argument("--skip-naive", action="store_true", help="skip the (slow) naive schedules")
    args = ap.parse_args(argv)
    with limit_threads(args.threads) as torch:
        return run_all(args, torch)


def run_all(args, torch) -> int:
    from tensortune.codegen.measure import LocalBuilder, LocalRunner
    from tensortune.codegen.target import make_task
    from tensortune.codegen.timing import TimingConfig
    from tensortune.schedule.state import State
    from tensortune.tasks.workload_registry import make_dag

    env = environment(args.threads)
    peak_all = env["fma_peak_gflops"].get(str(args.threads), env["fma_peak_gflops"]["1"])
    print(f"BLAS: {env['blas']}; fp32 FMA peak {env['fma_peak_gflops']} GFLOP/s (by threads)")
    target = llvm_target(args.threads)
    runner_timing = TimingConfig(repeat=BATCHES, min_repeat_ms=MIN_BATCH_MS)     # bench.common's protocol
    builder, runner = LocalBuilder(), LocalRunner(timeout=120, config=runner_timing)
    rows = []

    def per_s(task, ms: float | None) -> float | None:
        return task.flops / ms / 1e6 if ms else None

    def run(task, name: str, state, library, lib: str, pairs: int) -> dict:
        """Time the program against the library in alternating pairs; returns the comparison's fields."""
        (b,) = builder.build(task, [state.steps_json()])

        def ours() -> float:
            if b.artifact is None:
                raise RuntimeError(f"build failed: {b.error_msg[:300]}")
            (r,) = runner.run(task, [b])
            if r.error_code:
                raise RuntimeError(f"error {r.error_code}: {r.error_msg[:300]}")
            return statistics.median(r.costs) * 1e3
        sides = {"ours": ours, **({lib: in_process(library)} if library else {})}
        got = compare(sides, pairs).fields("ours", [lib] if library else [])
        ms = got["ours_ms"]
        rows.append({"name": name, "ms": ms, "gflops": per_s(task, ms), f"{lib}_ms": got.get(f"{lib}_ms"),
                     f"ratio_vs_{lib}": got.get(f"ours_vs_{lib}"),
                     f"ratio_vs_{lib}_pairwise": got.get(f"ours_vs_{lib}_pairwise"),
                     "peak_frac": per_s(task, ms) / peak_all if ms else None,
                     "pairs_ok": f"{got['pairs'] - got['failed_pairs']}/{got['pairs']}",
                     "build_s": b.seconds, "steps": state.steps_json(), "target": target, **got})
        return got

    def library_row(task, name: str, lib: str, got: dict) -> None:
        ms = got[f"{lib}_ms"]
        rows.append({"name": name, "ms": ms, "gflops": per_s(task, ms), f"{lib}_ms": ms,
                     "peak_frac": per_s(task, ms) / peak_all if ms else None})

    n = args.size
    mm = make_task(make_dag("matmul", n, n, n), target)
    a, b = mm.dag.random_inputs()
    tile = TILES_BY_LANES.get(mm.hardware.vector_unit_bytes // 4, TILES_BY_LANES[16])
    got = run(mm, f"hand-written matmul {n}^3", matmul_schedule(mm.dag, *tile), lambda: a @ b, "numpy", args.pairs)
    library_row(mm, f"numpy matmul {n}^3", "numpy", got)
    if not args.skip_naive:
        run(mm, f"naive matmul {n}^3", State(mm.dag), lambda: a @ b, "numpy", pairs=1)

    conv = make_task(make_dag("conv2d_relu", 1, 56, 56, 64, 64, 3, 3, 1, 1), target)
    conv_fn = None
    if torch is not None:
        x, w = (torch.from_numpy(v) for v in conv.dag.random_inputs())
        conv_fn = lambda: torch.relu(torch.nn.functional.conv2d(x, w, padding=1))   # noqa: E731
    else:
        print("PyTorch is not installed (pip install torch==2.13.0): conv rows have no torch ratio")
    got = run(conv, "hand-written conv2d+relu", conv_relu_schedule(conv.dag), conv_fn, "torch", args.pairs)
    if conv_fn is not None:
        library_row(conv, "torch conv2d+relu (ResNet-18 layer)", "torch", got)
    if not args.skip_naive:
        run(conv, "naive conv2d+relu", State(conv.dag), conv_fn, "torch", pairs=1)

    # float math the code generator writes out itself (exp, tanh, GELU's erf, sigmoid): 2^20 floats
    if torch is not None:
        for op in UNARY_OPS:
            un = make_task(make_dag("elementwise", 1, 64, 128, 128, op=op), target)
            x = torch.from_numpy(un.dag.random_inputs()[0])
            fn = {"exp": torch.exp, "tanh": torch.tanh, "gelu": torch.nn.functional.gelu, "sigmoid": torch.sigmoid}[op]
            got = run(un, f"{op}, 2^20 floats", unary_schedule(un.dag), lambda fn=fn, x=x: fn(x), "torch", args.pairs)
            library_row(un, f"torch {op}", "torch", got)
            for row in rows[-2:]:                  # not FLOP-bound: the ratio is the figure
                row["gflops"] = row["peak_frac"] = None

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
    env["threads_used"] = threads_used(target)
    print(f"threads used: {env['threads_used']}")
    print_table(rows, ["name", "ms", "gflops", "numpy_ms", "ratio_vs_numpy", "ratio_vs_numpy_pairwise", "torch_ms",
                       "ratio_vs_torch", "ratio_vs_torch_pairwise", "pairs_ok", "peak_frac", "build_s"])
    print("ratio_vs_<lib> = median library ms / median ms over the pairs (recomputable from the ms columns); "
          "_pairwise = the median of the per-pair ratios")
    write_json(args.json, rows, env, benchmark="codegen")
    return 0
