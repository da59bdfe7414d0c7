"""`python -m bench transfer`: how many trials does a network's tuning save when its store holds other
networks' records, as a user's does after tuning them? (issue 19: ResNet-50 with the history of
ResNet-18 and MobileNet-V2 should reach the cold run's final estimate in at most half the trials.)

Two runs of the same network, budget and seed, taking turns one round each on one measurer (so this VM's
drift hits both alike): *cold*, whose model starts empty, so rounds are drawn at random until its first
fit, as on a first night; *transfer*, whose model starts trained on every record of the target in the
`--history` stores (its own tasks' aside: they resume, below; flows.retrain.Trainer with transfer=True,
as the flow's retrain step reads the store: other tasks' programs rebuilt from the task files stored
beside their records), so the first round of every task is already proposed by a model. Both keep
learning from their own measurements (the transfer model keeps the history in its training data, as the
flow's does). The figure: the trials the transfer run needs to reach the cold run's final estimated
latency, against the cold run's budget.

The transfer run tunes into a store that holds the history's records of the network's own tasks, as a
user's store does after tuning the other networks in it: a task the network shares with them (ResNet-50's
stem and its stride-1 3x3 convs are ResNet-18's) resumes as the flow resumes it (flows.tuning.resume_policy:
its programs are never measured again, the scheduler starts from its stored best, the model learns them
there, so the history model leaves them out rather than learn them twice). `--model-only` starts that store
empty: only the model carries the history, the question of what a model trained on other tasks is worth.
The stored timings are another hour's: the row names the tasks resumed and their part of both runs'
final estimates, as the runs ended and with both runs' best programs of those tasks timed again in turns.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Collection
from typing import TYPE_CHECKING

from bench.common import Stopwatch, environment, llvm_target, missing_folder, print_table, write_json
from bench.network import take_turns, trials_to_reach
from tensortune.search.cost_model import DEFAULT_MODEL

if TYPE_CHECKING:
    from tensortune.codegen.measure import Measurer
    from tensortune.flows.tuning import NetworkTuner
    from tensortune.storage.schema import MeasureRecord


def history_model(history: list[str], tasks: list, seed: int, exclude: tuple[str, ...] = ()):
    """flows.retrain.history_model over the `history` store folders; no records, or too few to train
    on, is one line and an exit."""
    from tensortune.flows.retrain import history_model as trained_on
    from tensortune.storage.records import RecordStore
    found = trained_on([RecordStore(path) for path in history], tasks, seed, exclude)
    if found.programs == 0 and exclude:
        raise SystemExit(f"error: every record for {tasks[0].target} in {', '.join(history)} is of the network's "
                         "own tasks, which resume: the model has no other tasks' records to learn from")
    if found.programs == 0:
        raise SystemExit(f"error: no records for {tasks[0].target} in {', '.join(history)}")
    if found.model.booster is None:
        raise SystemExit(f"error: {found.programs} programs in the history are too few to train a model")
    return found.model, found.programs, found.tasks, found.unknown


def shared_records(history: list[str], tasks: list) -> dict[str, list[MeasureRecord]]:
    """The history's records of `tasks` on their target, per workload key (keys with none left out)."""
    from tensortune.storage.records import RecordStore
    keys = [t.workload_key for t in tasks]
    found: dict[str, list[MeasureRecord]] = {}
    for path in history:
        for record in RecordStore(path).load_records(target=str(tasks[0].target), workload_key=keys):
            found.setdefault(record.workload_key, []).append(record)
    return found


def part_ms(tuner: NetworkTuner, keys: Collection[str]) -> float:
    """The tasks `keys`' part of the tuner's estimate: the sum of weight x best latency (seconds)."""
    return sum(p.task.weight * cost for p, cost in zip(tuner.policies, tuner.sched.best_costs)
               if p.task.workload_key in keys)


def retimed_parts(measurer: Measurer, tuners: dict[str, NetworkTuner], keys: Collection[str],
                  passes: int = 4) -> dict[str, float]:
    """The tasks `keys`' part of each run's final estimate with their best programs timed again now: the
    stored bests a resumed run starts from were timed on another hour of the machine, the cold run's on
    this one (seconds, weight x latency). The runs' bests of a task are timed in one batch, `passes`
    times each in turns (ABBA), each program's fastest counting: in a batch as the search times its
    rounds, since a program timed alone reads slower (its data not settled: codegen.timing)."""
    parts = dict.fromkeys(tuners, 0.0)
    first = next(iter(tuners.values()))
    for i, policy in enumerate(first.policies):
        if policy.task.workload_key not in keys:
            continue
        bests = {label: tuner.result.best_steps[i] for label, tuner in tuners.items()}
        order = [label for p in range(passes) for label in (list(bests) if p % 2 == 0 else list(bests)[::-1])
                 if bests[label] is not None]
        results = measurer.measure(policy.task, [bests[label] for label in order]) if order else []
        for label in tuners:
            fastest = min((r.latency for lab, r in zip(order, results) if lab == label), default=math.inf)
            parts[label] += policy.task.weight * fastest
    return parts


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench transfer")
    ap.add_argument("network", nargs="?", default="resnet-50")
    ap.add_argument("--history", action="append", required=True, metavar="STORE",
                    help="a record store (root folder) of other networks on this target; repeat for more")
    ap.add_argument("--trials", type=int, default=2000, help="the cold run's budget (and the transfer run's)")
    ap.add_argument("--per-round", type=int, default=64,
                    help="programs per round: a finite estimate needs a round of every task, so the transfer run "
                         "can only reach the cold one's in half the trials if tasks x per-round is under half")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-only", action="store_true",
                    help="the transfer run's store starts empty: tasks the history shares with the network are "
                         "tuned from scratch, only the model carries the history")
    ap.add_argument("--json", help="write the environment and the row to this JSON file")
    args = ap.parse_args(argv)
    if missing_folder("--history", args.history):
        return 2
    if args.trials < 1 or args.per_round < 1:
        print(f"error: --trials and --per-round must be at least 1, got {args.trials} and {args.per_round}",
              file=sys.stderr)
        return 2

    from tensortune.flows.tuning import NetworkTuner, network_measurer, network_tasks
    from tensortune.search.sketch_policy import SearchParams
    from tensortune.storage.records import RecordStore
    from tensortune.tasks.graph_ops import GraphError
    try:
        net, tasks = network_tasks(args.network, llvm_target(args.threads), image_size=args.image_size)
    except GraphError as err:              # an unknown network, or one that takes no image size
        print(f"error: {err}", file=sys.stderr)
        return 2
    shared = {} if args.model_only else shared_records(args.history, tasks)
    with Stopwatch() as train_watch:
        model, programs, keys, unknown = history_model(args.history, tasks, args.seed, exclude=tuple(shared))
    accuracy = model.metrics.pairwise_accuracy      # of the history alone (later trainings replace it)
    env = environment(args.threads)
    print(f"transfer model: {programs} programs of {keys} tasks from {len(args.history)} store(s) "
          f"({train_watch.seconds:.0f} s); held-out pairwise accuracy {accuracy:.3f}"
          + (f"; {len(unknown)} task(s) without a stored description skipped" if unknown else ""), flush=True)
    home = tempfile.mkdtemp(prefix="tensortune-bench-transfer-")
    runs = {"cold": DEFAULT_MODEL, "transfer": model}
    stores = {label: RecordStore(os.path.join(home, label)) for label in runs}
    stores["transfer"].append([record for records in shared.values() for record in records])
    names = {t.workload_key: t.label for t in tasks}
    resumed = sum(map(len, shared.values()))
    if shared:
        print(f"resumed from the history: {len(shared)} task(s), {resumed} programs: "
              + "; ".join(names[k] for k in shared), flush=True)
    measurer = network_measurer(net)
    params = SearchParams(num_measures_per_round=args.per_round)
    tuners = {label: NetworkTuner(tasks, args.trials, measurer, model=m, params=params, seed=args.seed,
                                  network_name=args.network,
                                  records=stores[label],
                                  progress=lambda i, log, r, label=label: print(
                                      f"  [{label}] {r.trials}/{args.trials} trials, est. "
                                      f"{r.estimated_latency * 1e3:.3f} ms", flush=True))
              for label, m in runs.items()}
    try:
        seconds = take_turns(tuners)
        retimed = retimed_parts(measurer, tuners, shared)
    finally:
        measurer.close()
        shutil.rmtree(home, ignore_errors=True)
    cold, warm = tuners["cold"].result, tuners["transfer"].result
    final = cold.estimated_latency
    reached = trials_to_reach(warm.curve, final)
    row = {"network": args.network, "image_size": args.image_size, "target": str(tasks[0].target),
           "tasks": len(tasks), "trials": args.trials, "per_round": tuners["cold"].per_round,
           "history": args.history, "history_programs": programs,
           "history_tasks": keys, "history_train_s": train_watch.seconds, "model_only": args.model_only,
           "resumed_tasks": [names[k] for k in shared], "resumed_programs": resumed,
           # the resumed tasks' part of each final estimate (weight x best): stored bests against the cold
           # run's own timings of the same tasks
           "resumed_part_cold_ms": part_ms(tuners["cold"], shared) * 1e3,
           "resumed_part_transfer_ms": part_ms(tuners["transfer"], shared) * 1e3,
           "resumed_part_retimed_cold_ms": retimed["cold"] * 1e3,
           "resumed_part_retimed_transfer_ms": retimed["transfer"] * 1e3,
           "history_model_pairwise_accuracy": accuracy,
           "cold_final_ms": final * 1e3, "transfer_final_ms": warm.estimated_latency * 1e3,
           "transfer_trials_to_cold_final": reached,
           "trials_fraction": reached / cold.trials if reached is not None else None,
           "cold_trials_to_own_final": trials_to_reach(cold.curve, final),
           "cold_s": seconds["cold"], "transfer_s": seconds["transfer"],
           "cold_curve": cold.curve, "transfer_curve": warm.curve}
    print_table([row], ["network", "trials", "history_programs", "cold_final_ms", "transfer_final_ms",
                        "transfer_trials_to_cold_final", "trials_fraction", "cold_s", "transfer_s"])
    write_json(args.json, [row], env, benchmark="transfer")
    return 0
