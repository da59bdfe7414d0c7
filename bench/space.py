"""`python -m bench space`: how good is the space a search draws from, before any model guides it?

Draws `--programs` random programs (SketchPolicy.sample: sketches plus random annotation, what a
search's first round measures) from each workload of `bench tune` under each `--params` setting of
SearchParams, times them as the search does (one ProgramMeasurer, the search's timing protocol), and
reports the fastest, the mean of the ten fastest, the 90th percentile (a tenth of the programs
faster) and the median in GFLOP/s and as fractions of the FMA peak measured in the same run.
Settings take turns batch by batch, so a slow minute of the machine falls on both. Why: a change to
the sketch or annotation rules moves every later round; 128 draws show it without the noise a learned
model adds (issue 19: the vectorisation width, `max_vectorize_size`).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from bench.common import ensure_clean_blas_env, environment, limit_threads, print_table, write_json
from bench.tune import WORKLOADS, param_overrides, workload_task
from tensortune.search.sketch_policy import SearchParams, SketchPolicy

BATCH = 16


def parse_setting(text: str) -> dict:
    """"name=value,name=value" -> SearchParams overrides ("" is the defaults)."""
    return param_overrides([item for item in text.split(",") if item])


def summary(gflops: list[float], peak: float) -> dict:
    ranked = sorted(gflops, reverse=True)
    n = len(ranked)
    return {"programs": n, "failed": sum(1 for g in ranked if g == 0),
            "best_gflops": ranked[0], "top10_mean_gflops": statistics.fmean(ranked[:10]),
            "p90_gflops": ranked[n // 10], "median_gflops": ranked[n // 2],
            "best_peak_frac": ranked[0] / peak, "p90_peak_frac": ranked[n // 10] / peak}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench space")
    ap.add_argument("--programs", type=int, default=128, help="random programs per workload and setting")
    ap.add_argument("--workloads", default="matmul,conv2d_relu,conv2d_nhwc_relu,depthwise_conv2d")
    ap.add_argument("--params", nargs="+", default=[""], metavar="NAME=VALUE[,...]",
                    help='SearchParams settings to compare ("" is the defaults)')
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the environment and the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.programs < 1:
        print("error: --programs must be at least 1", file=sys.stderr)
        return 2
    unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        print(f"error: --workloads {unknown[0]}: not one of {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    try:
        settings = [(text or "defaults", parse_setting(text)) for text in args.params]
    except ValueError as e:
        print(f"error: --params {e}", file=sys.stderr)
        return 2
    from tensortune.codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
    ensure_clean_blas_env()
    rows = []
    with limit_threads(args.threads):
        env = environment(args.threads)
        peak = env["fma_peak_gflops"][str(args.threads)]
        measurer = ProgramMeasurer(LocalBuilder(), LocalRunner())
        try:
            for key in args.workloads.split(","):
                task = workload_task(key, args.threads)
                drawn = [SketchPolicy(task, params=SearchParams(**overrides), seed=args.seed).sample(args.programs)
                         for _, overrides in settings]
                timed: list[list[float]] = [[] for _ in settings]
                for lo in range(0, args.programs, BATCH):
                    for programs, out in zip(drawn, timed):
                        for r in measurer.measure(task, [c.steps_json for c in programs[lo:lo + BATCH]]):
                            out.append(task.flops / r.latency / 1e9 if r.ok else 0.0)
                for (label, _), gflops in zip(settings, timed):
                    rows.append({"workload": key, "params": label, **summary(gflops, peak)})
                    print(f"{key} [{label}]: best {rows[-1]['best_gflops']:.0f} GFLOP/s "
                          f"({rows[-1]['best_peak_frac']:.2f} of peak), 90th percentile "
                          f"{rows[-1]['p90_gflops']:.0f}", flush=True)
        finally:
            measurer.close()
    print_table(rows, ["workload", "params", "programs", "failed", "best_gflops", "top10_mean_gflops",
                       "p90_gflops", "median_gflops", "best_peak_frac", "p90_peak_frac"])
    write_json(args.json, rows, env, benchmark="space", programs=args.programs, seed=args.seed)
    return 0
