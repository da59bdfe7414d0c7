"""`python -m bench search`: the network search's seconds per round, without the rounds' measuring.

Issue 19 asks the flow's search for at most 2 s a round (median). The main job reports that figure, but
its rounds run beside builds, timings and a Prefect server on a machine other tenants share, so telling
one commit's search from another's by it takes many runs. This suite runs only the search: it resumes a
NetworkTuner from a record store as the flow does (each task's history in its policy, the cost model
trained on all of it), then times one proposal of a round per task, in `--passes` fresh tuners, with the
parts the policy times itself (drawing the initial population, the cost model's scores, the mutation
loop). The same store and seed give the same proposals, and their digest is printed: run it at two
commits, in alternation, and compare the seconds of the same work (the digests must agree unless the
search itself changed).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys

from bench.common import environment, llvm_target, missing_folder, print_table, write_json
from tensortune.search.cost_model import DEFAULT_MODEL, MODEL_OBJECTIVES
from tensortune.tasks.winograd import parse_tiles

# the parts of a proposal a row gives (fields of the policy's RoundTiming)
PHASES = ("sample_s", "predict_s", "evolve_s", "identify_s")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench search")
    ap.add_argument("network", nargs="?", default="resnet-18")
    ap.add_argument("--records", required=True, help="the record store to resume from (e.g. ./tuning-records)")
    ap.add_argument("--image-size", type=int, default=32, help="the main job's default")
    ap.add_argument("--winograd", metavar="TILES", type=parse_tiles, default=(),
                    help="offer eligible convs' Winograd forms as tasks, as `tensortune tune --winograd` does")
    ap.add_argument("--trials", type=int, default=300,
                    help="the run's budget: sets the round size as the flow does (min(64, trials / tasks))")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tasks", type=int, default=0, help="only the first N tasks (0: all)")
    ap.add_argument("--population", type=int, default=2048, help="search population (TVM: 2048)")
    ap.add_argument("--passes", type=int, default=3, help="fresh tuners, each proposing once per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=list(MODEL_OBJECTIVES),
                    help="the cost model the tuners train on the store and score with")
    ap.add_argument("--json", help="write the environment and the rows to this JSON file")
    args = ap.parse_args(argv)
    if missing_folder("--records", [args.records]):
        return 2
    for name in ("trials", "threads", "population", "passes"):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be at least 1, got {getattr(args, name)}", file=sys.stderr)
            return 2

    from tensortune.flows.tuning import NetworkTuner, network_tasks
    from tensortune.search.params import SearchParams
    from tensortune.storage.records import RecordStore
    from tensortune.tasks.graph_ops import GraphError
    try:
        _, tasks = network_tasks(args.network, llvm_target(args.threads), args.winograd, image_size=args.image_size)
    except GraphError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tasks = tasks[:args.tasks] if args.tasks else tasks
    env = environment(args.threads, peak=False)
    params = SearchParams(population=args.population, sample_init_population=args.population)
    seconds: list[list[float]] = [[] for _ in tasks]
    # where each proposal went (the policy's RoundTiming): drawing the initial population, the cost
    # model's scores (features and XGBoost), the mutation loop; the rest is selection and bookkeeping
    phases: dict[str, list[list[float]]] = {name: [[] for _ in tasks] for name in PHASES}
    digests, sizes, history = [], [0] * len(tasks), 0
    for p in range(args.passes):
        tuner = NetworkTuner(tasks, args.trials, None, model=args.model, params=params,
                             records=RecordStore(args.records), seed=args.seed)
        try:
            history = sum(tuner.history)
            digest = hashlib.sha256()
            for i in range(len(tasks)):
                batch = tuner.propose(i)
                seconds[i].append(batch.search_s)
                timing = tuner.policies[i].timing
                for name in PHASES:
                    phases[name][i].append(getattr(timing, name))
                sizes[i] = len(batch.candidates)
                for c in batch.candidates:
                    digest.update(c.steps_json.encode())
            digests.append(digest.hexdigest()[:16])
        finally:
            helpers = tuner.model.helpers
            if helpers is not None:
                helpers.close()
        print(f"pass {p + 1}/{args.passes}: {sum(s[-1] for s in seconds):.2f} s for {len(tasks)} proposals, "
              f"median {statistics.median(s[-1] for s in seconds):.2f} s, programs {digests[-1]}", flush=True)
    rows = [{"task": i, "name": t.name, "programs": sizes[i], "search_s": statistics.median(seconds[i]),
             **{name: statistics.median(phases[name][i]) for name in PHASES},
             "search_s_passes": seconds[i]} for i, t in enumerate(tasks)]
    totals = [sum(s[p] for s in seconds) for p in range(args.passes)]
    print_table(rows, ["task", "name", "programs", "search_s", *PHASES])
    same = "identical" if len(set(digests)) == 1 else "DIFFERENT"
    print(f"{args.network} at {args.image_size}^2, {len(tasks)} tasks, {history} stored programs: search per round "
          f"median {statistics.median(r['search_s'] for r in rows):.2f} s; all tasks {min(totals):.2f}-"
          f"{max(totals):.2f} s over {args.passes} passes; programs {same} across passes ({digests[0]})")
    print("of the tasks' median seconds: " + ", ".join(f"{name} {sum(r[name] for r in rows):.2f} s" for name in PHASES)
          + f" of {sum(r['search_s'] for r in rows):.2f} s")
    write_json(args.json, rows, env, benchmark="search", network=args.network, image_size=args.image_size,
               winograd=list(args.winograd), model=args.model,
               records=os.path.abspath(args.records), stored_programs=history, totals_s=totals, digests=digests)
    return 0
