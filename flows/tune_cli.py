"""`tensortune tune-op` and `tensortune show`: tune one operator, or print a schedule's loop nest."""
from __future__ import annotations

import os
import time
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from tensortune.codegen.confirmation import RETIME_PROGRAMS
from tensortune.flows.cli_app import app
from tensortune.flows.cli_input import (
    MODELS,
    USAGE,
    at_least,
    check_count,
    check_model,
    check_workload_args,
    fail,
    open_store,
)

if TYPE_CHECKING:                     # the CLI imports the heavy modules only in the command that runs
    from tensortune.search.cost_model import CostModel
    from tensortune.storage.records import RecordStore
    from tensortune.tasks.search_task import SearchTask

console = Console()


def print_code(text: str) -> None:
    """Programs and step lists print unwrapped and unstyled, so they can be copied back (`show --steps`)."""
    console.print(text, markup=False, soft_wrap=True, highlight=False)


def loop_nest(state, task) -> str:
    from tensortune.codegen.lower import lower
    return lower(state, target_kind="cuda" if task.target_kind == "cuda" else "cpu").text()


def parse_args(text: str) -> tuple[list, dict]:
    """'1024,1024,1024' or '1,56,56,64,64,3,3,1,1' or 'N=1,layout=NHWC' -> (positional, keyword)."""
    pos, kw = [], {}

    def value(v: str):
        v = v.strip()
        for conv in (int, float):
            try:
                return conv(v)
            except ValueError:
                pass
        return {"true": True, "false": False}.get(v.lower(), v)

    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" in part:
            k, v = part.split("=", 1)
            kw[k.strip()] = value(v)
        else:
            pos.append(value(part))
    return pos, kw


def interrupted(store, run_id: str) -> None:
    """Ctrl-C: one line saying what the run stored (every finished round is appended before the next one
    starts), then exit 130, the shell's code for an interrupt."""
    if store is None:
        line = "interrupted; nothing was stored (--records '')"
    else:
        n = len(store.read(flow_run_id=run_id, columns=["record_id"]))
        line = (f"interrupted: {n} measurements of run {run_id} are stored in {store.root}; run the command "
                "again to go on from them")
    Console(stderr=True).print(line, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(130)


def cli_run_id(command: str) -> str:
    """The run id of a command-line run (the records' flow_run_id: a flow's runs have Prefect's): the
    command and its UTC start, readable in `tensortune history`, plus a random part, so two runs made the
    same second never merge into one."""
    return f"{command}-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"


def _task(op: str, args: str, target: str):
    from tensortune.codegen.target import make_task
    from tensortune.tasks.workload_registry import make_dag, workload_signature
    pos, kw = parse_args(args)
    try:
        check_workload_args(op, workload_signature(op), pos)
        return make_task(make_dag(op, *pos, **kw), target)
    except (KeyError, TypeError, ValueError) as err:
        fail(str(err).strip('"'), USAGE)


def transfer_model(store: RecordStore | None, task: SearchTask, model: str, seed: int) -> CostModel | str:
    """The flow's transfer for one operator: a learned model first trained on the store's records of
    every other task of the target (other networks, other nights), so the first round is ranked, not
    drawn at random; the task's own records reach it through the resumed history. Without a store, or
    other records, or for the random model: the model by name."""
    from tensortune.flows.retrain import history_model
    from tensortune.search.cost_model import MODEL_OBJECTIVES
    if store is None or model == "random":
        return model
    with console.status("training the cost model on the store's other tasks"):
        found = history_model([store], [task], seed, exclude=[task.workload_key],
                              objective=MODEL_OBJECTIVES[model])
    if found.model.booster is None:
        return model
    console.print(f"cost model: trained on {found.programs} programs of {found.tasks} other task(s) in the store")
    return found.model


@app.command("tune-op")
def tune_op(op: str = typer.Argument(..., help="registered workload, e.g. matmul, conv2d_relu"),
            args: str = typer.Option("", "--args", help="workload arguments, e.g. 1024,1024,1024"),
            trials: int = typer.Option(200, help="programs to measure"),
            target: str = typer.Option("llvm", help="llvm (this CPU) or 'cuda -arch=sm_90'"),
            records: str = typer.Option("./tuning-records", help="record store (folder or URL); '' for none"),
            model: str = typer.Option(MODELS[0], help="cost model: xgb-blend (a regression and a pairwise "
                                      "ranker, scores added), xgb (Ansor's regression), xgb-rank or random"),
            per_round: int = typer.Option(64, help="measurements per round"),
            retime: int = typer.Option(RETIME_PROGRAMS, **at_least("--retime", 0),
                                       help="time the best N stored programs again first, "
                                       "so the run compares with today's figures (0: trust the stored timings)"),
            seed: int = typer.Option(0)) -> None:
    """Tune one operator and print the best program's schedule and loop nest."""
    from tensortune.flows.tuning import tune_task
    from tensortune.schedule.state import State
    from tensortune.search.sketch_policy import SearchParams
    check_count("--trials", trials)
    check_count("--per-round", per_round)
    check_model(model)
    task = _task(op, args, target)
    store = open_store(records, write=True) if records else None
    run_id = cli_run_id("tune-op")
    console.print(f"tuning [bold]{task.name}[/bold] ({task.flops / 1e9:.3f} GFLOP) on {task.target}, "
                  f"{trials} trials, records: {records or 'none'}, run {run_id}")
    columns = [TextColumn("round {task.fields[round]}"), BarColumn(),
               TextColumn("{task.completed}/{task.total} trials"),
               TextColumn("best {task.fields[best]:.1f} GFLOP/s"), TextColumn("{task.fields[model]}"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    start = time.time()
    cost_model = transfer_model(store, task, model, seed)
    try:
        with Progress(*columns, console=console) as bar:
            pid = bar.add_task("tune", total=trials, round=0, best=0.0, model="model: warming up")

            def progress(log, result) -> None:
                model = (f"model: pair-acc {log.model_accuracy:.2f} recall@10 {log.model_recall:.2f}"
                         if log.model_accuracy == log.model_accuracy else "model: warming up")
                bar.update(pid, completed=log.trials, round=log.round, best=log.best_gflops, model=model)

            result = tune_task(task, trials, model=cost_model, params=SearchParams(num_measures_per_round=per_round),
                               records=store, seed=seed, flow_run_id=run_id, progress=progress, retime=retime)
    except KeyboardInterrupt:
        interrupted(store, run_id)
    if result.best_steps is None:
        fail(f"no program ran successfully in {result.trials} trials (see the error records in {records or 'the log'})")
    state = State.from_json(task.dag, result.best_steps)
    console.print(f"best: {result.best_latency * 1e3:.3f} ms, {result.best_gflops:.1f} GFLOP/s after "
                  f"{result.trials} trials in {time.time() - start:.0f} s "
                  f"(search {result.search_seconds:.0f} s, measure {result.measure_seconds:.0f} s)")
    console.print("[bold]schedule[/bold]")
    print_code(str(state))
    console.print("[bold]loop nest[/bold]")
    print_code(loop_nest(state, task))
    print_code(f"steps: {result.best_steps}")


@app.command("show")
def show(op: str = typer.Argument(..., help="registered workload"),
         args: str = typer.Option("", "--args"),
         steps: str = typer.Option("", help="a step list (JSON); default: the best record, else the naive one"),
         records: str = typer.Option(None, help="record store to take the best record from "
                                                 "(default: ./tuning-records if it exists); '' for none"),
         target: str = typer.Option("llvm")) -> None:
    """Print a schedule as TVM prints a State and as the lowered loop nest."""
    from tensortune.flows.tuning import best_steps
    from tensortune.schedule.stage import IllegalStep
    from tensortune.schedule.state import State
    if records is None:
        records = "./tuning-records" if os.path.isdir("./tuning-records") else ""
    task = _task(op, args, target)
    if not steps and records:
        steps = best_steps(task, open_store(records)) or ""
    try:
        state = State.from_json(task.dag, steps) if steps else State(task.dag)
    except IllegalStep as err:
        fail(str(err), USAGE)
    print_code(task.dag.to_text())
    print_code(str(state))
    print_code(loop_nest(state, task))
