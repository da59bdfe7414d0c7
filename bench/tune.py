"""`python -m bench tune`: does the search find kernels faster than the libraries people use?

Tunes matmul 1024^3, matmul+bias+relu 1024^3, the ResNet-18 conv2d+relu layer and a MobileNet-V2
depthwise conv, then re-times the best program with more repeats and compares it with NumPy/OpenBLAS or
PyTorch CPU (same thread count, alternating timings) and the measured FMA peak. Reports search and measurement time
separately and the best-so-far curve; `--ablate` adds the random-model and no-crossover runs at equal
trials; `--retime JSON` re-times the fastest programs a previous run wrote, without searching.
`--target cuda` runs the GPU benchmark (bench/tune_cuda.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.common import (blas_info, ensure_clean_blas_env, measure_fma_peak, paired_ms, print_table,
                          torch_threads, write_json)

WORKLOADS = {
    "matmul": ("matmul", (1024, 1024, 1024), "numpy"),
    "matmul_bias_relu": ("matmul_bias_relu", (1024, 1024, 1024), "numpy"),
    "conv2d_relu": ("conv2d_relu", (1, 56, 56, 64, 64, 3, 3, 1, 1), "torch"),
    "depthwise_conv2d": ("depthwise_conv2d", (1, 112, 112, 32, 3, 1, 1), "torch"),
}


def library_fn(key: str, dag, threads: int) -> tuple[str, object]:
    """The library's call for the same computation on the same inputs (None when torch is missing)."""
    import numpy as np
    inputs = dag.random_inputs()
    if key == "matmul":
        a, b = inputs
        return "numpy", lambda: a @ b
    if key == "matmul_bias_relu":
        a, b, bias = inputs
        return "numpy", lambda: np.maximum(a @ b + bias, 0)
    torch = torch_threads(threads)
    if torch is None:
        return "torch", None
    x, w = (torch.from_numpy(v) for v in inputs)
    if key == "conv2d_relu":
        return "torch", lambda: torch.relu(torch.nn.functional.conv2d(x, w, padding=1))
    return "torch", lambda: torch.nn.functional.conv2d(x, w, padding=1, groups=w.shape[0])


def run_one(key: str, trials: int, model: str, crossover: float, measurer, seed: int, per_round: int,
            overrides: dict | None = None):
    from codegen.target import make_task
    from flows.tuning import tune_task
    from search.sketch_policy import SearchParams
    from tasks.workload_registry import make_dag
    name, args, _ = WORKLOADS[key]
    task = make_task(make_dag(name, *args))
    params = SearchParams(**{"crossover_prob": crossover, "num_measures_per_round": per_round, **(overrides or {})})
    t0 = time.perf_counter()
    res = tune_task(task, trials, measurer=measurer, model=model, params=params, seed=seed,
                    progress=lambda log, r: print(f"  {key} [{model}, crossover {crossover}] round {log.round}: "
                                                  f"{log.trials} trials, best {log.best_gflops:.1f} GFLOP/s, "
                                                  f"search {log.search_s + log.train_s:.1f}s measure {log.measure_s:.1f}s",
                                                  flush=True))
    wall = time.perf_counter() - t0
    per_round_overhead = [x.search_s + x.train_s for x in res.rounds]
    return task, res, wall, per_round_overhead


def retime_against_library(key: str, task, fastest: list, threads: int,
                           top: int = 10) -> tuple[str, float, float, float, str | None]:
    """(library, library ms, our ms, ratio, steps). The search timed each program once, so its fastest
    may owe its place to a lucky moment of this machine: the `top` fastest are re-timed in a fresh
    runner, and the fastest of those is then timed alternating with the library (bench.common.paired_ms).
    The runner is the only one alive: two processes' thread pools meeting on two cores can put a kernel
    into a slow mode that costs milliseconds per parallel region (README, "Tuning one operator")."""
    from codegen.measure import LocalRunner
    from codegen.timing import TimingConfig
    lib, fn = library_fn(key, task.dag, threads)
    candidates = [steps for _, steps in fastest[:top]]
    builds = retime_builds(task, candidates) if candidates else []
    retime = LocalRunner(timeout=60, config=TimingConfig(repeat=3, min_repeat_ms=200))

    def timed(build) -> float:
        if build.artifact is None:
            return float("nan")
        (r,) = retime.run(task, [build])
        return statistics.median(r.costs) * 1e3 if r.ok else float("nan")
    try:
        ranked = sorted((t, i) for i, t in enumerate(timed(b) for b in builds) if t == t)
        if not ranked:
            return lib, float("nan"), float("nan"), float("nan"), None
        best = ranked[0][1]
        if fn is None:
            return lib, float("nan"), ranked[0][0], float("nan"), candidates[best]
        return (lib, *paired_ms(fn, lambda: timed(builds[best])), candidates[best])
    finally:
        retime.close()


def retimed(key: str, task, fastest: list, threads: int, peak: float) -> dict:
    """The row fields the re-timing gives (ms, GFLOP/s, the library's ms and the ratio, best steps)."""
    lib, lib_ms, ms, ratio, steps = retime_against_library(key, task, fastest, threads)
    gflops = task.flops / ms / 1e6 if ms == ms else float("nan")
    return {"ms": ms, "gflops": gflops, f"{lib}_ms": lib_ms, "ratio": ratio, "vs": lib,
            "peak_frac": gflops / peak, "best_steps": steps}


def retime_file(path: str, keys: list[str], threads: int, peak: float) -> list[dict]:
    """Re-time the fastest programs a previous run wrote (its `fastest_seen`), without searching again."""
    from codegen.target import make_task
    from tasks.workload_registry import make_dag
    with open(path) as f:
        old = [json.loads(line) for line in f if line.strip()]
    rows = []
    for row in old:
        if row["workload"] not in keys:
            continue
        name, args, _ = WORKLOADS[row["workload"]]
        task = make_task(make_dag(name, *args))
        rows.append({**row, **retimed(row["workload"], task, row["fastest_seen"], threads, peak),
                     "retimed_from": path})
        print_row(rows[-1])
    return rows


def print_row(row: dict) -> None:
    """A row as one JSON line, without its long fields (the curve and the programs)."""
    print(json.dumps({k: v for k, v in row.items() if k not in ("curve", "best_steps", "fastest_seen")}), flush=True)


def retime_builds(task, steps: list[str]):
    from codegen.measure import LocalBuilder
    b = LocalBuilder(n_parallel=1)
    try:
        return b.build(task, steps)
    finally:
        b.close()


def plot(curves: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({k for k, _ in curves})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for (k, label), (xs, ys, ref) in curves.items():
            if k == key:
                ax.plot(xs, ys, label=label)
        ref = next(v[2] for (k, _), v in curves.items() if k == key)
        if ref == ref:
            ax.axhline(ref, color="k", ls="--", lw=1, label="library")
        ax.set_title(key)
        ax.set_xlabel("trials")
        ax.set_ylabel("best GFLOP/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def tune_and_retime(args, peak: float) -> tuple[list[dict], dict]:
    """Each workload (and ablation run) searched with its own measurer, then re-timed."""
    from codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
    overrides = {}
    for item in args.param:
        k, _, v = item.partition("=")
        overrides[k] = type(getattr(__import__("search.sketch_policy", fromlist=["SearchParams"]).SearchParams(), k))(v)
    rows, curves = [], {}
    runs = [("xgb", 0.05, "xgb+crossover")]
    if args.ablate:
        runs += [("random", 0.05, "random model"), ("xgb", 0.0, "no crossover")]
    for key in args.workloads.split(","):
        for model, cross, label in runs:
            measurer = ProgramMeasurer(LocalBuilder(), LocalRunner())
            try:
                task, res, wall, overhead = run_one(key, args.trials, model, cross, measurer, args.seed,
                                                    args.per_round, overrides)
            finally:
                measurer.close()        # its runner's thread pool must not meet the re-timing's
            rows.append({"workload": key, "run": label, **retimed(key, task, res.fastest, args.threads, peak),
                         "best_seen_gflops": res.best_gflops,
                         "trials": res.trials, "search_s": res.search_seconds, "measure_s": res.measure_seconds,
                         "wall_s": wall, "max_search_s_per_round": max(overhead) if overhead else 0.0,
                         "median_search_s_per_round": statistics.median(overhead) if overhead else 0.0,
                         "fastest_seen": res.fastest,
                         "curve": [[t, g] for t, g in res.curve]})
            lib_ms = rows[-1][f"{rows[-1]['vs']}_ms"]
            curves[(key, label)] = ([t for t, _ in res.curve], [g for _, g in res.curve],
                                    task.flops / lib_ms / 1e6 if lib_ms == lib_ms else float("nan"))
            print_row(rows[-1])
    return rows, curves


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench tune")
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--json", help="write one JSON object per row to this file")
    ap.add_argument("--ablate", action="store_true", help="also run the random model and no crossover")
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-round", type=int, default=64)
    ap.add_argument("--plot", default="docs/tune_curve.png")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retime", metavar="JSON", help="re-time the fastest programs of a previous run's JSON "
                                                     "(no search)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="override a SearchParams field, e.g. --param max_vectorize_size=64")
    args, rest = ap.parse_known_args(argv)
    if args.target.startswith("cuda"):
        from bench import tune_cuda
        return tune_cuda.main(argv)
    ensure_clean_blas_env()
    peak = measure_fma_peak(args.threads)
    print(f"BLAS: {blas_info()}; fp32 FMA peak {peak:.0f} GFLOP/s on {args.threads} threads")
    if args.retime:
        rows, curves = retime_file(args.retime, args.workloads.split(","), args.threads, peak), {}
    else:
        rows, curves = tune_and_retime(args, peak)
    print_table(rows, ["workload", "run", "ms", "gflops", "vs", "numpy_ms", "torch_ms", "ratio", "peak_frac",
                       "trials", "search_s", "measure_s", "median_search_s_per_round"])
    write_json(args.json, rows)
    if args.plot and curves:
        plot(curves, args.plot)
    return 0
