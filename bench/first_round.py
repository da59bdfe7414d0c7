"""`python -m bench first_round`: how large should a task's first round be in a network tuning?

TVM's warm-up gives every task a full round before the gradient scheduler chooses, so at a nightly budget
the warm-up is most of it (ResNet-50 with its Winograd forms: 36 tasks, 2300 of 3000 trials in rounds of
64). `NetworkTuner(first_round=N)` makes the first round short. This benchmark runs the same network,
budget and seed once per first-round size, taking turns one round each on one measurer (so this VM's drift hits
all alike), each into a store of its own, and reports per size: the final estimate, the trials it needed to
reach the other sizes' finals, its rounds and wall seconds; then the networks built from each run's bests,
checked against the NumPy reference and timed in alternating pairs (bench.common.compare).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from bench.common import PAIRS, compare, environment, in_process, llvm_target, print_table, write_json
from bench.network import take_turns, trials_to_reach, tuned_programs
from tensortune.tasks.winograd import parse_tiles


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench first_round")
    ap.add_argument("network", nargs="?", default="resnet-50", help="a built-in network (tensortune extract NAME)")
    ap.add_argument("--sizes", default="64,16", help="first-round sizes to compare, e.g. 64,16 (64: TVM's warm-up "
                                                     "at the default round size)")
    ap.add_argument("--trials", type=int, default=3000)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--winograd", metavar="TILES", type=parse_tiles, default=(),
                    help="also tune the Winograd forms F(m x m, 3 x 3) of eligible convs (e.g. 2,4)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pairs", type=int, default=PAIRS, help="network timing pairs (alternating order)")
    ap.add_argument("--json", help="write the environment and the row to this JSON file")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) < 2 or len(set(sizes)) != len(sizes) or min(sizes) < 1:
        print(f"error: --sizes needs two or more distinct positive sizes, got {args.sizes!r}", file=sys.stderr)
        return 2
    if args.trials < 1:
        print(f"error: --trials needs a positive budget, got {args.trials}", file=sys.stderr)
        return 2

    from tensortune.codegen.network_runtime import build_network
    from tensortune.flows.tuning import NetworkTuner, network_measurer, network_tasks
    from tensortune.storage.records import RecordStore
    from tensortune.tasks.graph_ops import GraphError
    target = llvm_target(args.threads)
    try:
        net, tasks = network_tasks(args.network, target, args.winograd, image_size=args.image_size)
    except GraphError as err:              # an unknown network, or one that takes no image size
        print(f"error: {err}", file=sys.stderr)
        return 2
    env = environment(args.threads)
    home = tempfile.mkdtemp(prefix="tensortune-bench-first-round-")
    measurer = network_measurer(net)
    tuners = {size: NetworkTuner(tasks, args.trials, measurer, seed=args.seed, network_name=args.network,
                                 records=RecordStore(os.path.join(home, str(size))), form_sets=net.form_sets(),
                                 first_round=size,
                                 progress=lambda i, log, r, size=size: print(
                                     f"  [first round {size}] {r.trials}/{args.trials} trials, est. "
                                     f"{r.estimated_latency * 1e3:.3f} ms", flush=True))
              for size in sizes}
    try:
        seconds = take_turns(tuners)
    finally:
        measurer.close()
        shutil.rmtree(home, ignore_errors=True)
    results = {size: t.result for size, t in tuners.items()}
    networks = {}
    for size, res in results.items():
        best, costs = tuned_programs(res)
        networks[size] = build_network(net, best, target, costs)
    checks = {size: n.check() for size, n in networks.items()}
    for n in networks.values():
        n.set_inputs(net.graph.random_inputs(args.seed))
    timed = compare({f"first_{size}": in_process(n.run_planned) for size, n in networks.items()}, args.pairs)
    row: dict = {"network": args.network, "tasks": len(tasks), "trials": args.trials, "seed": args.seed,
                 "per_round": tuners[sizes[0]].per_round, "winograd": list(args.winograd)}
    for size, res in results.items():
        key = f"first_{size}"
        row.update({f"{key}_final_ms": res.estimated_latency * 1e3, f"{key}_rounds": tuners[size].rounds,
                    f"{key}_s": seconds[size], f"{key}_check": "ok" if checks[size].passed else str(checks[size]),
                    f"{key}_curve": res.curve, f"{key}_trials_per_task": tuners[size].trials_run})
        for other, theirs in results.items():
            if other != size:
                row[f"{key}_trials_to_first_{other}_final"] = trials_to_reach(res.curve, theirs.estimated_latency)
    row.update(timed.fields())
    labels = [f"first_{s}" for s in sizes]
    print_table([row], ["network", "trials"] + [f"{k}_final_ms" for k in labels] + [f"{k}_ms" for k in labels]
                + [f"{k}_s" for k in labels])
    for size in sizes:
        reached = (f"first {o}'s final at {row[f'first_{size}_trials_to_first_{o}_final']}" for o in sizes if o != size)
        print(f"first round {size} reaches " + ", ".join(reached))
    write_json(args.json, [row], env, benchmark="first_round")
    return 0 if all(c.passed for c in checks.values()) else 1
