"""`python -m bench retrain`: a round's retrain as a store's nights add up, with the training bound and without.

The flow retrains the cost model after every round from its record store (flows.retrain.Trainer): every
stored program of the network's tasks and, with transfer, of every other task of the target. A nightly
store only grows, so without a bound every night made every round's retrain slower; the bound
(search.training_set; `tensortune tune --train-programs N`: N programs of a tuned task, N/4
of another's) is meant to stop that. This suite reads the `--history` stores once as the flow's Trainer
does, focused on NETWORK's tasks, then times the retrain of one round on that history repeated as if
each program had been measured on each of N nights (`--nights`): the model before it ranks the round's
programs (the held-out figures the flow logs), then a booster is trained. Bounded and unbounded take
turns, `--repeats` pairs at each N (a model trained on the same history first, untimed, as the retrain
before it). Repeating a night's programs is a stand-in for new nights: the same programs again train as
long as new ones would, and the bound keeps the same number of them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from bench.common import Stopwatch, environment, llvm_target, missing_folder, print_table, write_json
from tensortune.search.training_set import TASK_PROGRAMS


def nights_list(text: str) -> list[int]:
    """`1,4,16` -> [1, 4, 16]; each at least 1."""
    try:
        nights = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nights takes whole numbers such as 1,4,16, got {text!r}") from None
    if not nights or min(nights) < 1:
        raise argparse.ArgumentTypeError(f"--nights must each be at least 1, got {text!r}")
    return nights


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench retrain", description=__doc__.splitlines()[0])
    ap.add_argument("network", nargs="?", default="resnet-18", help="the network being tuned (the model's focus)")
    ap.add_argument("--history", action="append", required=True, metavar="STORE",
                    help="a record store (root folder) on this target; repeat for more")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2, help="the target's threads (names the stored records)")
    ap.add_argument("--nights", type=nights_list, default=[1, 4, 16],
                    help="the history repeated as if measured on this many nights (default 1,4,16)")
    ap.add_argument("--train-programs", type=int, default=TASK_PROGRAMS,
                    help="the bound timed against every program (as `tensortune tune --train-programs`)")
    ap.add_argument("--per-round", type=int, default=64, help="the round's programs the model before it ranks")
    ap.add_argument("--repeats", type=int, default=3, help="bounded/unbounded pairs at each number of nights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the environment and the rows to this JSON file")
    args = ap.parse_args(argv)
    if missing_folder("--history", args.history):
        return 2
    for name, low in (("threads", 1), ("train_programs", 1), ("per_round", 2), ("repeats", 1)):
        if getattr(args, name) < low:
            print(f"error: --{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}",
                  file=sys.stderr)
            return 2

    from tensortune.flows.retrain import Trainer
    from tensortune.flows.tuning import network_tasks
    from tensortune.search.cost_model import MIN_FIT_PROGRAMS, XGBModel
    from tensortune.search.training_set import training_bounds
    from tensortune.storage.records import RecordStore
    from tensortune.tasks.graph_ops import GraphError
    try:
        _, tasks = network_tasks(args.network, llvm_target(args.threads), image_size=args.image_size)
    except GraphError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    target = str(tasks[0].target)
    trainer = Trainer(tasks, target, seed=args.seed, transfer=True)
    with Stopwatch() as read_watch:
        for path in args.history:
            trainer.read_new(RecordStore(path))
    history = {key: rows for key, rows in trainer.xgb.data.items() if rows}
    mine = [t.workload_key for t in tasks if t.workload_key in history]     # the network's tasks with records
    if not mine:
        print(f"error: no records of {args.network}'s tasks for {target} in {', '.join(args.history)}",
              file=sys.stderr)
        return 2
    # the round the retrain follows: the newest programs of the network's task with the most (fit ranks a
    # task's new programs only where it has two; with fewer it would split the history, two trainings)
    newest = max(mine, key=lambda key: len(history[key]))
    programs = sum(map(len, history.values()))
    if len(history[newest]) < 2 or programs < MIN_FIT_PROGRAMS:
        print(f"error: {programs} programs in {', '.join(args.history)} are too few to time a retrain on "
              f"(at least {MIN_FIT_PROGRAMS}, two of them of one of {args.network}'s tasks)", file=sys.stderr)
        return 2
    env = environment(args.threads, peak=False)
    print(f"history: {programs} programs of {len(history)} tasks ({len(mine)} of {args.network}'s) read in "
          f"{read_watch.seconds:.1f} s; the round: {min(args.per_round, len(history[newest]))} programs of "
          f"{trainer.tasks[newest].name}", flush=True)

    sides = {f"{args.train_programs} a task": training_bounds(args.train_programs), "every program": (None, None)}
    rows = []
    for nights in args.nights:
        models = {}
        for label, (task_programs, other_task_programs) in sides.items():
            model = XGBModel(seed=args.seed, features=trainer.xgb.features, focus=mine,
                             task_programs=task_programs, other_task_programs=other_task_programs)
            model.data = {key: rows * nights for key, rows in history.items()}
            model.fit()                                    # the retrain before: its booster ranks the round
            models[label] = model
        seconds: dict[str, list[float]] = {label: [] for label in sides}
        trained: dict[str, int] = {}
        ranked: dict[str, dict[str, int]] = {}
        for r in range(args.repeats):
            for label in (list(sides) if r % 2 == 0 else list(reversed(sides))):
                model = models[label]
                model.unseen = {newest: min(args.per_round, len(history[newest]))}
                with Stopwatch() as watch:
                    metrics = model.fit()
                seconds[label].append(watch.seconds)
                assert metrics is not None, "a model with a history to train on trains"
                trained[label] = metrics.n_programs
                # what the model before ranked: the round's programs (the flow's path, one training), not a
                # held-out split of every task (two)
                ranked[label] = {trainer.tasks[key].name: int(n) for key, (_, _, n) in metrics.per_task.items()}
        for label in sides:
            rows.append({"nights": nights, "history_programs": programs * nights, "training": label,
                         "trained_programs": trained[label], "ranked_programs": ranked[label],
                         "retrain_s": statistics.median(seconds[label]), "retrain_s_runs": seconds[label]})
        print(f"{nights} night(s): " + ", ".join(f"{label} {statistics.median(seconds[label]):.2f} s "
                                                 f"({trained[label]} trained)" for label in sides), flush=True)
    print_table(rows, ["nights", "history_programs", "training", "trained_programs", "retrain_s"])
    write_json(args.json, rows, env, benchmark="retrain", network=args.network, image_size=args.image_size,
               target=target, history=[os.path.abspath(p) for p in args.history], read_s=read_watch.seconds,
               round_task=trainer.tasks[newest].name, train_programs=args.train_programs)
    return 0
