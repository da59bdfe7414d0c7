"""`tensortune tune NETWORK`: the tune-network flow on the embedded default, or on a real server and cluster.

Without PREFECT_API_URL it starts (or reuses) a Prefect server on 127.0.0.1 and leaves it running so
the run can be looked at in the UI afterwards (`--stop-server` stops it by pid at the end); without
--cluster the flow starts a LocalCluster; records go to ./tuning-records. It ends by printing where
to look: the record store, the flow run's page, and the server's pid.
"""
from __future__ import annotations

import math
import os
from datetime import datetime, timezone
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from tensortune.codegen.confirmation import RETIME_PROGRAMS
from tensortune.flows.cli_app import app
from tensortune.flows.cli_input import (
    USAGE,
    at_least,
    check_cluster,
    check_count,
    check_target,
    fail,
    open_store,
    records_to_write,
)
from tensortune.flows.network_cli import (
    BatchOption,
    ImageSizeOption,
    InputShapeOption,
    LayersOption,
    NetworkArg,
    SeqLenOption,
    TargetOption,
    ThreadsOption,
    WinogradOption,
    load_network,
    winograd_tiles,
    with_threads,
)
from tensortune.flows.tuned_network import GAP_WARNING
from tensortune.search.training_set import TASK_PROGRAMS

console = Console(width=max(120, Console().width))


def _records_url(records: str) -> str:
    return records if "://" in records else os.path.abspath(records)


@app.command("tune")
def tune(network: NetworkArg,
         trials: Annotated[int, typer.Option("--trials", help="Programs to measure in this run.")] = 200,
         records: Annotated[str, typer.Option("--records", envvar="TENSORTUNE_RECORDS",
                                              help="Record store (folder or URL); the run resumes from it.")]
         = "./tuning-records",
         cluster: Annotated[Optional[str], typer.Option(
             "--cluster", envvar="TENSORTUNE_CLUSTER",
             help="Dask scheduler to join, e.g. tcp://host:8786 (default: a local cluster).")] = None,
         target: TargetOption = "llvm", threads: ThreadsOption = None, batch: BatchOption = None,
         image_size: ImageSizeOption = None,
         seq_len: SeqLenOption = None, layers: LayersOption = None, input_shape: InputShapeOption = None,
         per_round: Annotated[int, typer.Option("--per-round", help="Measurements per round.")] = 64,
         retrain_every: Annotated[int, typer.Option(
             "--retrain-every", **at_least("--retrain-every", 1),
             help="Retrain the cost model every R rounds (1: after every round, as the library learns).")] = 1,
         train_programs: Annotated[int, typer.Option(
             "--train-programs", **at_least("--train-programs", 0),
             help="Train the cost model on at most N programs of each task (its best quarter, then its newest) "
                  "and a quarter as many (at least 1) of another network's task, so a retrain's cost stops "
                  "growing with the nights (0: every stored program).")] = TASK_PROGRAMS,
         population: Annotated[Optional[int], typer.Option(
             "--population", **at_least("--population", 16),
             help="Evolutionary search population (TVM: 2048).")] = None,
         latency_target_ms: Annotated[Optional[float], typer.Option(
             "--latency-target-ms", **at_least("--latency-target-ms", 0.0),
             help="Stop once the network's estimated latency meets this.")] = None,
         early_stopping: Annotated[Optional[int], typer.Option(
             "--early-stopping", **at_least("--early-stopping", 1),
             help="Give a task no more trials after this many without improvement.")]
         = None,
         objective: Annotated[Optional[str], typer.Option(
             "--objective", help="What the task scheduler minimises: f1 (weighted latency sum), f2 (f1 down to "
                                 "--latency-target-ms; the default when one is given), f3 (geometric-mean "
                                 "speedup over --reference-ms).")] = None,
         reference_ms: Annotated[Optional[float], typer.Option(
             "--reference-ms", **at_least("--reference-ms", 0.0),
             help="f3: the network latency to beat (e.g. ONNX Runtime's).")] = None,
         seed: int = 0, winograd: WinogradOption = None,
         retime: Annotated[int, typer.Option(
             "--retime", **at_least("--retime", 0),
             help="Time each resumed task's best N stored programs again first, so this run "
                                     "compares with tonight's figures (0: trust the stored timings).")]
         = RETIME_PROGRAMS,
         time_network: Annotated[bool, typer.Option(
             "--time-network/--no-time-network",
             help="End by building the network from the best records, checking and timing it.")] = True,
         port: Annotated[int, typer.Option("--port", help="Port of the local Prefect server.")] = 4200,
         stop_server: Annotated[bool, typer.Option(
             "--stop-server/--keep-server",
             help="Stop the Prefect server this command started when the run ends (default: keep it for the UI).")]
         = False) -> None:
    """Tune a network as a Prefect flow with Dask-measured rounds, resuming from the record store."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tensortune.flows.dask_cluster import ClusterError
    from tensortune.flows.prefect_server import PrefectServerError, ensure_server
    from tensortune.flows.tune_flow import tune_network_flow
    from tensortune.search.task_scheduler import network_objective
    # bad input fails before anything starts (server, cluster, flow run)
    check_count("--trials", trials)
    check_count("--per-round", per_round)
    tiles = winograd_tiles(winograd)
    if not 1 <= port <= 65535:
        fail(f"--port must be a TCP port, 1 to 65535, got {port}", USAGE)
    url = _records_url(records_to_write(records))
    load_network(network, batch=batch, seq_len=seq_len, layers=layers, image_size=image_size,
                 input_shapes=input_shape)
    check_target(with_threads(target, threads))
    try:
        if objective is not None or reference_ms is not None:
            network_objective(objective or ("f2" if latency_target_ms is not None else "f1"), network, [1.0],
                              latency_target_s=latency_target_ms / 1e3 if latency_target_ms else None,
                              reference_s=reference_ms / 1e3 if reference_ms else None)
    except ValueError as err:
        fail(str(err), USAGE)
    check_cluster(cluster)
    open_store(records, write=True)          # a corrupt store fails here, not in the flow's first step
    try:
        server = ensure_server(port)
    except PrefectServerError as err:
        fail(str(err))
    how = "started" if server.started_here else "using"
    console.print(f"Prefect API: {how} {server.api_url}" + (f" (pid {server.pid})" if server.pid else ""))
    search = {"population": population, "sample_init_population": population} if population else None
    state = None
    started = datetime.now(timezone.utc)
    try:
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            state = tune_network_flow(network=network, trials=trials, target=with_threads(target, threads),
                                      records=url, cluster=cluster, time_network=time_network,
                                      batch=batch, image_size=image_size, seq_len=seq_len, layers=layers,
                                      input_shapes=input_shape, per_round=per_round, retrain_every=retrain_every,
                                      seed=seed, search=search, latency_target_ms=latency_target_ms,
                                      early_stopping_task=early_stopping, objective=objective,
                                      reference_ms=reference_ms, winograd_tiles=list(tiles) or None,
                                      retime=retime, train_programs=train_programs, return_state=True)
        if state.is_completed():
            _print_summary(state.result())
    except KeyboardInterrupt:
        _interrupted(url, started)
    finally:
        _where(url, server, state.state_details.flow_run_id if state is not None else None, stop_server)
    if state is None:
        raise typer.Exit(130)                 # interrupted (after _where said where to look)
    if not state.is_completed():
        try:
            state.result()
        except (ClusterError, ValueError, OSError) as err:
            fail(str(err))
        except Exception as err:  # noqa: BLE001 - the flow's own failure, shown in full in the UI
            fail(f"the flow run ended {state.type.value}: {type(err).__name__}: {err}")
        fail(f"the flow run ended {state.type.value}")


def _interrupted(records: str, since: datetime) -> None:
    """Ctrl-C: one line saying what the run stored (each measured batch is appended before the next one)."""
    from tensortune.storage.records import RecordStore
    try:
        n = len(RecordStore(records, auto_compact=None).read(since=since, columns=["record_id"]))
        what = f"{n} measurements of this run are stored in {records}; the next run goes on from them"
    except (OSError, ValueError) as err:
        what = f"the records could not be counted ({err})"
    Console(stderr=True).print(f"interrupted: {what}", markup=False, highlight=False, soft_wrap=True)


def _where(records: str, server, run_id, stop: bool) -> None:
    """Where to look: the records, the run's page, and what became of the server."""
    console.print(f"records:    {records}", soft_wrap=True)
    console.print(f"Prefect UI: {server.flow_run_url(str(run_id)) if run_id else server.ui_url}", soft_wrap=True)
    if server.started_here and stop:
        pid = server.pid
        server.stop()
        console.print(f"stopped the Prefect server (pid {pid}); `tensortune tune` or `prefect server start "
                      f"--port {server.ui_url.rsplit(':', 1)[-1]}` shows the run again", soft_wrap=True)
    elif server.started_here:
        console.print(f"the Prefect server (pid {server.pid}) keeps running for the UI; stop it with "
                      f"`kill {server.pid}`", soft_wrap=True)


def _print_summary(summary: dict) -> None:
    rows = summary["tasks"]
    table = Table(title=f"{summary['network']} on {summary['target']}: {summary['trials']} trials in "
                        f"{summary['rounds']} rounds")
    # the task table's columns under short headers, so a network's task names (to ~30 characters) fit whole
    columns = {"#": "#", "task": "task", "weight": "weight", "best latency (ms)": "best ms", "GFLOP/s": "GFLOP/s",
               "speedup vs default": "vs default", "trials (this run)": "trials", "trials (total)": "total",
               "model accuracy (latest)": "model acc."}
    for c, header in columns.items():
        table.add_column(header, justify="left" if c == "task" else "right", min_width=30 if c == "task" else None)
    for r in rows:
        table.add_row(*("-" if r[c] is None else str(r[c]) for c in columns))
    console.print(table)

    def ms(x: float) -> str:
        return f"{x * 1e3:.4f} ms" if math.isfinite(x) else "n/a"
    stored = summary.get("estimate_stored_s", math.nan)
    console.print(f"estimated latency: {ms(summary['estimate_after_s'])} (runtime default schedules "
                  f"{ms(summary['estimate_default_s'])}, start of this run {ms(summary['estimate_before_s'])}"
                  + (f", {ms(stored)} as stored" if math.isfinite(stored) and stored != summary['estimate_before_s']
                     else "") + f"); cost model {summary['model_version'] or 'random'}")
    median = summary.get("round_median_s") or {}
    if median.get("search_s") is not None:
        def s(x: float | None) -> str:
            return f"{x:.1f} s" if x is not None else "n/a"
        console.print(f"per round (median): search {s(median['search_s'])}, builds {s(median['build_s'])}, "
                      f"timings {s(median['timing_s'])}, records+learning {s(median['learn_s'])}, "
                      f"retrain {s(median['retrain_s'])}")
    timing = summary.get("network_timing")
    if timing:
        gap = timing["gap"]
        console.print(f"measured latency:  {ms(timing['measured_s'])} end to end (median of {timing['runs']} runs on "
                      f"{timing['host']}, {timing['target']}), estimated {ms(timing['estimate_s'])}: gap "
                      + (f"{gap:+.0%}" if math.isfinite(gap) else "n/a")
                      + f"; check against the NumPy reference: {timing['check']}", soft_wrap=True)
        if math.isfinite(gap) and abs(gap) > GAP_WARNING:
            console.print(f"[yellow]warning:[/yellow] measured and estimated latency differ by {gap:+.0%}")
