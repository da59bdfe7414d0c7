"""`python -m bench timing`: do two timings of the same programs rank them alike?

A search ranks programs by their timings, the cost model learns from them and a task's best is the
minimum over them, so how far a second timing would reorder them bounds all three. On a shared VM the
machine's slow spells are one-sided and outlast a timing (codegen.timing.OPERATOR_TIMING). This suite
tunes each workload for `--trials` trials (the library's tune_task, its records in a scratch store:
the programs a search really measures, most of them near its best), re-times `--programs` of them
`--timings` times under each protocol, the protocols taking turns batch by batch so a slow minute
falls on both, and reports per protocol: the share of program pairs two timings order alike (mean
and range over every two timings), the same among the faster half, the spread of a program's timings
(standard deviation of log time) and the seconds a batch took. Protocols: one 100 ms timing a program
(TVM's, `TimingConfig()`) and the tuner's (`OPERATOR_TIMING`: four interleaved passes, the fastest).
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from itertools import combinations

import numpy as np

from bench.common import Stopwatch, ensure_clean_blas_env, environment, limit_threads, print_table, write_json
from bench.tune import WORKLOADS, workload_task
from tensortune.search.cost_model import pairwise_accuracy


def protocol_row(seconds: list[np.ndarray]) -> dict:
    """How alike the timings (each one array of seconds, program by program) of one protocol are: the
    share of program pairs two timings put in the same order is the cost model's pairwise accuracy of
    one timing against the other."""
    pairs = [pairwise_accuracy(a, b) for a, b in combinations(seconds, 2)]
    faster = np.argsort(np.median(seconds, axis=0))[:len(seconds[0]) // 2]
    halves = [pairwise_accuracy(a[faster], b[faster]) for a, b in combinations(seconds, 2)]
    logs = np.log(np.array(seconds))
    return {"agreement": float(np.mean(pairs)), "agreement_min": min(pairs), "agreement_max": max(pairs),
            "faster_half_agreement": float(np.mean(halves)),
            "log_sd": float(np.std(logs - logs.mean(axis=0)))}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench timing")
    ap.add_argument("--workloads", default="matmul,conv2d_nhwc_relu")
    ap.add_argument("--trials", type=int, default=192, help="trials of the search whose programs are re-timed")
    ap.add_argument("--programs", type=int, default=64, help="programs re-timed (drawn from the search's)")
    ap.add_argument("--timings", type=int, default=4, help="timings of each program under each protocol")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the environment and the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.programs < 2 or args.timings < 2 or args.trials < args.programs:
        print("error: --programs and --timings must be at least 2, and --trials at least --programs",
              file=sys.stderr)
        return 2
    unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        print(f"error: --workloads {unknown[0]}: not one of {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    from tensortune.codegen.measure import LocalBuilder, LocalRunner
    from tensortune.codegen.timing import OPERATOR_TIMING, TimingConfig
    from tensortune.flows.tuning import tune_task
    from tensortune.storage.records import RecordStore
    protocols = {"one 100 ms timing": TimingConfig(), "OPERATOR_TIMING": OPERATOR_TIMING}
    ensure_clean_blas_env()
    rows = []
    with limit_threads(args.threads), tempfile.TemporaryDirectory() as scratch:
        env = environment(args.threads)
        for key in args.workloads.split(","):
            task = workload_task(key, args.threads)
            store = RecordStore(f"{scratch}/{key}")
            tune_task(task, args.trials, records=store, seed=args.seed,
                      progress=lambda log, _: print(f"  {key}: {log.trials} of {args.trials} trials", flush=True))
            frame = store.records_of(task.workload_key)
            measured = list(frame["steps"][frame["error_code"] == 0])
            steps = random.Random(args.seed).sample(measured, min(args.programs, len(measured)))
            builder = LocalBuilder()
            try:
                builds = [b for b in builder.build(task, steps) if b.artifact is not None]
            finally:
                builder.close()
            runners = {name: LocalRunner(config=cfg) for name, cfg in protocols.items()}
            timed: dict[str, list[np.ndarray]] = {name: [] for name in protocols}
            spent = dict.fromkeys(protocols, 0.0)
            try:
                for n in range(args.timings):
                    for name in (list(protocols) if n % 2 == 0 else list(protocols)[::-1]):
                        with Stopwatch() as watch:
                            timed[name].append(np.array([r.latency for r in runners[name].run(task, builds)]))
                        spent[name] += watch.seconds
            finally:
                for runner in runners.values():
                    runner.close()
            ok = np.all(np.isfinite(np.array([t for ts in timed.values() for t in ts])), axis=0)
            for name, seconds in timed.items():
                rows.append({"workload": key, "timing": name, "programs": int(ok.sum()), "timings": args.timings,
                             **protocol_row([s[ok] for s in seconds]), "batch_s": spent[name] / args.timings})
                print(f"{key} [{name}]: pairs ordered alike {rows[-1]['agreement']:.3f}, "
                      f"log sd {rows[-1]['log_sd']:.3f}, {rows[-1]['batch_s']:.1f} s a batch", flush=True)
    print_table(rows, ["workload", "timing", "programs", "timings", "agreement", "agreement_min", "agreement_max",
                       "faster_half_agreement", "log_sd", "batch_s"])
    write_json(args.json, rows, env, benchmark="timing", trials=args.trials, seed=args.seed)
    return 0
