"""The tune-network flow: extract, resume, retrain, then rounds of search and Dask-measured batches.

Granularity (docs/architecture.md §7): one Prefect task run per search round, per measure batch and per
retrain, so the UI reads as the tuning story and orchestration costs milliseconds per round; inside a
measure batch, one Dask future per candidate build and timing (flows.dask_measure). Prefect task runs
stay in the flow process and the flow holds its own distributed.Client, so nothing on the Dask workers
ever talks to Prefect (prefect-dask's task runner cannot work in Prefect's ephemeral mode).

Every measured batch is appended to the record store before the policy and the scheduler learn from it,
so a run that dies loses at most the batch in flight; a new run resumes from the store: programs
measured before are never measured again, and each task starts from its stored best as timed again at
the start of the run (`retime-stored-bests`; flows.tuning.retime_stored_bests says why).
"""
from __future__ import annotations

import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any, Sequence

from distributed import Client
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from tensortune.codegen.measure import Measurer, Prebuilder
from tensortune.codegen.target import parse_target
from tensortune.codegen.timing import NETWORK_TIMING, TimingConfig
from tensortune.flows import artifacts
from tensortune.flows.compile_step import compile_network_step
from tensortune.flows.dask_cluster import (
    CLUSTER_ENV,
    CLUSTER_VARIABLE,
    CPU_RESOURCE,
    cluster_workers,
    dask_client,
    local_resources,
)
from tensortune.flows.dask_measure import DaskMeasurer
from tensortune.flows.measure_targets import MeasureTarget, measure_node_targets, resolve_measure_target
from tensortune.flows.retrain import NewestModel, Trainer, load_newest, retrain
from tensortune.flows.tuned_network import GAP_WARNING, TunedNetworkTiming, measure_tuned_network_job
from tensortune.flows.tuning import RETIME_PROGRAMS, NetworkTuner, Proposal, Retiming, network_tasks, network_timing
from tensortune.search.cost_model import WARMUP_PROGRAMS
from tensortune.search.sketch_policy import SearchParams
from tensortune.search.task_scheduler import INF_COST, Objective, network_objective
from tensortune.search.training_set import TASK_PROGRAMS
from tensortune.storage.models import ModelStore
from tensortune.storage.records import DEFAULT_ROOT, RecordStore
from tensortune.tasks.extract import NetworkTasks
from tensortune.tasks.models import load_graph
from tensortune.tasks.search_task import SearchTask

# task runs pass live objects: never hash or store them
_STEP: dict[str, Any] = dict(cache_policy=NONE, persist_result=False)


# ------------------------------------------------------------------ typed flow parameters

class SearchOptions(BaseModel):
    """The evolutionary search's settings a run may change (search.params.SearchParams' fields; the
    measurements per round are the flow's `per_round`). A field left out keeps SearchParams' default,
    which is written there only. Typed, so a deployment's parameters are checked, and shown as a form,
    by Prefect; an unknown field is an error, not ignored."""
    model_config = ConfigDict(extra="forbid")

    population: int | None = Field(None, ge=1)
    num_iters: int | None = Field(None, ge=0)
    mutation_prob: float | None = Field(None, ge=0, le=1)
    crossover_prob: float | None = Field(None, ge=0, le=1)
    eps_greedy: float | None = Field(None, ge=0, le=1)
    sample_init_population: int | None = Field(None, ge=1)
    sample_init_use_measured_ratio: float | None = Field(None, ge=0, le=1)
    max_innermost_split_factor: int | None = Field(None, ge=1)
    max_vectorize_size: int | None = Field(None, ge=1)
    disable_change_compute_location: bool | None = None
    disable_cpu_packing: bool | None = None
    cpu_multi_level_tiling_structure: str | None = None
    gpu_multi_level_tiling_structure: str | None = None
    mutation_weights: dict[str, float] | None = None

    def params(self, per_round: int) -> SearchParams:
        return SearchParams(**self.model_dump(exclude_none=True), num_measures_per_round=per_round)


class TimingOptions(BaseModel):
    """How candidates are timed (codegen.timing.TimingConfig's fields over the network-tuning defaults,
    NETWORK_TIMING) and how long a build or a timing may take; a field left out keeps its default."""
    model_config = ConfigDict(extra="forbid")

    number: int | None = Field(None, ge=1)
    repeat: int | None = Field(None, ge=1)
    min_repeat_ms: float | None = Field(None, ge=0)
    flush_cache: bool | None = None
    check_correctness: bool | None = None
    warmup: int | None = Field(None, ge=0)
    slow_factor: float | None = Field(None, ge=0)
    flush_bytes: int | None = Field(None, ge=0, description="bytes streamed through the caches before each "
                                    "cold run (default: the network's footprint)")
    cold_warmup: int | None = Field(None, ge=0, description="untimed flush-and-run cycles before the cold runs, "
                                    "at most (they stop once the kernel no longer gets faster; 0: none)")
    passes: int | None = Field(None, ge=1, description="timings of each candidate, the fastest counting (1: "
                               "one); on a cluster a candidate's passes run back to back, not interleaved "
                               "with the batch's as the library's runner does (codegen.timing.OPERATOR_TIMING)")
    build_timeout: float = Field(15.0, gt=0, description="seconds one candidate's build may take")
    run_timeout: float = Field(10.0, gt=0, description="seconds one candidate's timing may take")

    def config(self, base: TimingConfig = NETWORK_TIMING) -> TimingConfig:
        """These options over `base` (the network's timing, flows.tuning.network_timing, in a network flow)."""
        fields = self.model_dump(exclude_none=True, exclude={"build_timeout", "run_timeout"})
        return TimingConfig(**{**asdict(base), **fields})


def search_options(search: SearchOptions | dict[str, Any] | None) -> SearchOptions:
    """The flow's `search` parameter as given by any caller: the model, a plain dict, or nothing."""
    return search if isinstance(search, SearchOptions) else SearchOptions.model_validate(search or {})


def timing_options(timing: TimingOptions | dict[str, Any] | None) -> TimingOptions:
    """The flow's `timing` parameter as given by any caller: the model, a plain dict, or nothing."""
    return timing if isinstance(timing, TimingOptions) else TimingOptions.model_validate(timing or {})


class Session:
    """One flow run's tuning state, kept in the flow process (task runs receive it by reference). Its
    `tuner` holds the policies, the scheduler and the round body; the session adds what the flow
    reports (the stored bests before the run, the runtime defaults' latencies, where the time went)."""

    def __init__(self, tasks: list[SearchTask], network: str, records: RecordStore, measurer: Measurer,
                 params: SearchParams, strategy: str, seed: int, warmup: int, flow_run_id: str, trials: int,
                 objective: Objective | None = None, scheduler_options: dict[str, Any] | None = None,
                 form_sets: Sequence[Sequence[int]] = (), retime: int = RETIME_PROGRAMS,
                 train_programs: int = TASK_PROGRAMS):
        self.tasks, self.network, self.records = tasks, network, records
        self.form_sets = [tuple(f) for f in form_sets]     # alternative forms of one group: one term
        self.target = tasks[0].target
        self.models = ModelStore(records.location.url)
        self.model = NewestModel(seed)
        self.tuner = NetworkTuner(tasks, trials, measurer, model=self.model, params=params, records=records,
                                  strategy=strategy, objective=objective, seed=seed, flow_run_id=flow_run_id,
                                  network_name=network, scheduler_options=scheduler_options, resume=False,
                                  form_sets=self.form_sets, retime=retime)
        self.policies, self.sched = self.tuner.policies, self.tuner.sched
        # the model learns from the stored records of the target (other networks, earlier nights; each task's
        # best and newest, at most train_programs: Trainer)
        self.trainer = Trainer(tasks, self.target, warmup, seed, self.model.features, transfer=True,
                               train_programs=train_programs)
        n = len(tasks)
        self.index = {t.workload_key: i for i, t in enumerate(tasks)}
        # each task's latest held-out (pairwise accuracy, recall@k) from the retrain step
        self.ranking: dict[int, tuple[float, float]] = {}
        self.stored = [math.inf] * n                 # best latency stored before this run
        self.before = [math.inf] * n                 # ... as timed again at its start (retime-stored-bests)
        # where the run's time went, inside the steps (the rest of the wall time is orchestration)
        self.seconds = {"retime": 0.0, "search": 0.0, "measure": 0.0, "record+learn": 0.0, "retrain": 0.0}
        self.timeline: list[artifacts.RoundTiming] = []    # one line per measured round

    @property
    def rounds(self) -> int:
        return self.tuner.rounds

    @property
    def done(self) -> int:
        """Trials measured in this run."""
        return self.tuner.result.trials

    def best_latency(self, i: int) -> float:
        c = self.sched.best_costs[i]
        return c if c < INF_COST else math.inf

    def rows(self) -> list[artifacts.TaskRow]:
        run, before = self.tuner.trials_run, self.tuner.history
        return [artifacts.TaskRow(i, t.name, t.weight, t.flops, self.best_latency(i), run[i], before[i] + run[i],
                                  self.tuner.default_latency[i], *self.ranking.get(i, (math.nan, math.nan)))
                for i, t in enumerate(self.tasks)]

    def estimate(self) -> float:
        """The network's estimated latency from each task's best so far (NaN while a task has none)."""
        weights = [t.weight for t in self.tasks]
        return artifacts.estimate(weights, [self.best_latency(i) for i in range(len(self.tasks))], self.form_sets)


# ------------------------------------------------------------------ flow steps (Prefect task runs)

@task(name="extract-tasks", **_STEP)
def extract_network_tasks(network: str, target: str, options: dict[str, Any],
                          winograd_tiles: Sequence[int] = ()) -> tuple[NetworkTasks, list[SearchTask]]:
    """The network's tuning tasks (fused subgraphs, deduplicated, weighted) for the target; with
    `winograd_tiles`, also the Winograd forms of its eligible convs."""
    graph = load_graph(network, **options)
    net, tasks = network_tasks(graph, target, winograd_tiles)
    get_run_logger().info(f"{graph.name}: {len(tasks)} tasks, {net.total_flops / 1e9:.3f} GFLOP and "
                          f"{network_timing(net).flush_bytes / 2**20:.1f} MiB touched per run, "
                          f"target {tasks[0].target if tasks else target}")
    return net, tasks


def time_network_on_cluster(client: Client, net: NetworkTasks, records: str, target: str, repeat: int = 20,
                            workers: tuple[str, ...] = ()) -> TunedNetworkTiming:
    """`measure_tuned_network_job` on a measure worker. The network goes to the workers ahead of the
    job (scattered, not hashed): as an argument it would be pickled into the task graph the scheduler
    holds, which Dask warns of from 10 MB and ResNet-18's weights, twice (as given, for the reference,
    and as compiled), are 87 MiB, 298 with its Winograd forms' transformed weights."""
    # to any worker: one named here may have left since (Dask then moves the data to the job's)
    [net_future] = client.scatter([net], hash=False)
    try:
        future = client.submit(measure_tuned_network_job, net_future, records, target, repeat, pure=False,
                               resources={CPU_RESOURCE: 1}, workers=list(workers) or None,
                               allow_other_workers=False)
        return future.result()
    finally:
        net_future.release()


@task(name="build-and-time-network", **_STEP)
def build_and_time_network(client: Client, net: NetworkTasks, network: str, target: str, records: str,
                           repeat: int = 20, workers: tuple[str, ...] = ()) -> TunedNetworkTiming:
    """The network as it will be deployed: built from the store's best records on a measure worker of the
    target (the resource keeps timings one at a time), checked against the NumPy reference, timed end to end."""
    log = get_run_logger()
    timing = time_network_on_cluster(client, net, records, target, repeat, workers)
    artifacts.publish_network_timing(network, target, timing)
    log.info(timing.line())
    if timing.gap_too_large:
        log.warning(f"measured and estimated latency differ by {timing.gap:+.0%} (over {GAP_WARNING:.0%}): "
                    "see the network artifact for each task inside the network against its estimate")
    if not timing.passed:
        log.error(f"the network built from the records does not match the NumPy reference: {timing.check}")
    return timing


@task(name="load-history", **_STEP)
def load_history(s: Session) -> dict[str, int]:
    """Resume: stored programs count as measured, start each task's search and the scheduler."""
    log = get_run_logger()
    history = s.tuner.resume()
    for i, (p, n) in enumerate(zip(s.policies, history)):
        if n and p.best is not None:
            s.stored[i] = s.before[i] = p.best_cost
    total, resumed = sum(history), sum(1 for n in history if n)
    log.info(f"history: {total} programs of {resumed}/{len(s.tasks)} tasks in {s.records.location.url}")
    return {"records": total, "tasks_with_history": resumed}


@task(name="retime-stored-bests", **_STEP)
def retime_stored_bests(s: Session) -> dict[str, Any]:
    """Time each resumed task's best stored programs again, so this run compares its programs with
    figures of this night, not of the night that stored them (flows.tuning.retime_stored_bests)."""
    log = get_run_logger()
    t0 = time.perf_counter()

    def logged(i: int, r: Retiming) -> None:
        s.before[i] = r.now
        lost = (f" ({r.lost} lost by the cluster" + ("; the stored figures stand)" if r.lost == r.programs else ")")
                if r.lost else "")
        log.info(f"{s.tasks[i].name} (task {i}): {r.programs} stored programs timed again, best "
                 f"{_ms(r.stored)} as stored, {_ms(r.now)} now{lost}")
    todo = [len(programs) for programs in s.tuner.incumbents if programs]
    if todo:
        log.info(f"building the {sum(todo)} stored programs of {len(todo)} tasks to time again")
    done = [r for r in s.tuner.retime_stored_bests(on_task=logged) if r is not None]
    s.seconds["retime"] += time.perf_counter() - t0
    weights = [t.weight for t in s.tasks]
    stored, now = (artifacts.estimate(weights, xs, s.form_sets) for xs in (s.stored, s.before))
    if done:
        log.info(f"{sum(r.programs for r in done)} stored programs of {len(done)} tasks timed again in "
                 f"{time.perf_counter() - t0:.1f} s: estimated latency {_ms(stored)} as stored, {_ms(now)} now")
    return {"tasks": len(done), "programs": sum(r.programs for r in done), "estimate_stored_s": stored,
            "estimate_now_s": now}


@task(name="retrain-cost-model", task_run_name="retrain-{why}", **_STEP)
def retrain_cost_model(s: Session, why: str) -> dict[str, Any]:
    """Train the cost model from the stored history, store the new version, make rounds use it."""
    t0 = time.perf_counter()
    if why == "start" and not s.model.version:
        load_newest(s.models, s.target, s.model)
    report = retrain(s.trainer, s.records, s.models, s.model)
    s.seconds["retrain"] += time.perf_counter() - t0
    if s.timeline and why != "start":
        s.timeline[-1].retrain_s += time.perf_counter() - t0
    log = get_run_logger()
    if report.trained:
        m = report.metrics
        # the figures are on the programs the last model had not seen: after the first training, the ones
        # the search picked by it, which rank closer together than a task's whole history does
        log.info(f"cost model {report.version}: {report.record_count} programs ({report.new_records} new), "
                 f"pairwise accuracy {_figure(m.get('pairwise_accuracy'))}, recall@{m.get('k')} "
                 f"{_figure(m.get('recall_at_k'))} on programs it had not seen (since the last training: the "
                 f"search's own picks), {report.seconds:.1f} s")
        for key, figures in m.get("per_task", {}).items():
            if key in s.index:       # (not another network's task: the first training ranks those too)
                i = s.index[key]
                s.ranking[i] = (figures[0], figures[1])
                log.info(f"  {s.tasks[i].name} (task {i}): pairwise accuracy {figures[0]:.3f}, recall@{m.get('k')} "
                         f"{figures[1]:.3f} on its {int(figures[2])} programs")
    else:
        log.info(f"cost model unchanged ({report.version or 'random'}): {report.reason}")
    return {"trained": report.trained, "version": report.version, "records": report.record_count,
            "metrics": report.metrics}


@task(name="search-round", task_run_name="search-{label}", **_STEP)
def search_round(s: Session, i: int, label: str, in_flight: int = 0) -> Proposal:
    """Task i's policy proposes a round's programs, none measured before (and the model's scores).
    in_flight: trials of a round still being measured (this search runs during its timings)."""
    batch = s.tuner.propose(i, in_flight)
    s.seconds["search"] += batch.search_s
    twins = s.tuner.policies[i].timing.n_twins
    get_run_logger().info(f"{s.tasks[i].name} (task {i}): {len(batch.candidates)} programs proposed in "
                          f"{batch.search_s:.1f} s with cost model {s.model.version or 'random'}"
                          + (f", {twins} passed over (their kernels measured or picked already)" if twins else ""))
    return batch


@task(name="measure-batch", task_run_name="measure-{label}", **_STEP)
def measure_batch(s: Session, i: int, batch: Proposal, label: str,
                  running: Future | None = None) -> dict[str, Any]:
    """Build and time the batch on the cluster (or wait for `running`, its measurement started in the
    background while the next round was searched), append the records, then let policy and scheduler
    learn."""
    task_ = s.tasks[i]
    round_ = s.rounds
    t0 = time.perf_counter()
    results = running.result() if running is not None else s.tuner.measure(batch)
    t1 = time.perf_counter()
    s.tuner.learn(i, batch, results)
    s.seconds["measure"] += t1 - t0
    s.seconds["record+learn"] += time.perf_counter() - t1
    stats = getattr(s.tuner.measurer, "stats", None)
    s.timeline.append(artifacts.RoundTiming(
        round_, f"{i} {task_.name}", len(batch.candidates), batch.search_s,
        stats.build_s if stats is not None else math.nan, stats.run_s if stats is not None else math.nan,
        time.perf_counter() - t1))
    n = len(batch.candidates)
    errors = sum(1 for r in results if not r.ok)
    best = s.best_latency(i)
    cost = f" (builds {stats.build_s:.1f} s, timings {stats.run_s:.1f} s)" if stats is not None else ""
    get_run_logger().info(
        f"round {round_}: {task_.name} (task {i}) measured {n} ({errors} errors), best "
        f"{task_.flops / best / 1e9 if math.isfinite(best) else 0.0:.1f} GFLOP/s; network estimate "
        f"{_ms(s.estimate())}{cost}")
    return {"task": i, "measured": n, "errors": errors, "best_latency": best}


# ------------------------------------------------------------------ the loop

# a searched round: (task, its proposal, its label)
Searched = tuple[int, Proposal, str]


def tune_tasks(tasks: list[SearchTask], *, network: str, trials: int, records: str, measurer,
               per_round: int = 64, retrain_every: int = 1, model_warmup: int = WARMUP_PROGRAMS,
               strategy: str = "gradient",
               seed: int = 0, search: SearchOptions | dict[str, Any] | None = None, flow_run_id: str = "",
               latency_target_ms: float | None = None, early_stopping_task: int | None = None,
               objective: str | None = None, reference_ms: float | None = None,
               form_sets: Sequence[Sequence[int]] = (), retime: int = RETIME_PROGRAMS,
               train_programs: int = TASK_PROGRAMS) -> dict[str, Any]:
    """The rounds of one flow run (called inside a flow): returns the run's summary.

    retime: each resumed task's best stored programs timed again before the rounds (0: trust the stored
    timings, as TVM does; flows.tuning.retime_stored_bests).
    train_programs: the most programs of each of these tasks a retrain trains the cost model on (its best
    quarter, then its newest), a quarter as many of another network's task (0: every stored program;
    search.training_set).
    objective: what the task scheduler minimises, Ansor's f1 (weighted latency sum; the default), f2
    (max(latency, latency_target_ms): the default when a target is given) or f3 (geometric-mean speedup
    over reference_ms). latency_target_ms: the run stops once the estimate meets it, whatever the
    objective. early_stopping_task: a task that has not improved for this many trials gets no more.
    form_sets: sets of tasks that are alternative forms of one group (NetworkTasks.form_sets): one
    latency term, the fastest form's."""
    log = get_run_logger()
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    if retrain_every < 1:
        raise ValueError(f"retrain_every must be at least 1 round, got {retrain_every}")
    if latency_target_ms is not None and latency_target_ms <= 0:
        raise ValueError(f"latency_target_ms must be positive, got {latency_target_ms}")
    if retime < 0:
        raise ValueError(f"retime must be 0 or more programs, got {retime}")
    if train_programs < 0:
        raise ValueError(f"train_programs must be 0 (every program) or more, got {train_programs}")
    params = search_options(search).params(per_round)
    store = RecordStore(records)
    if objective is None:
        objective = "f2" if latency_target_ms is not None else "f1"
    goal = network_objective(objective, network, [t.weight for t in tasks],
                             latency_target_s=latency_target_ms / 1e3 if latency_target_ms is not None else None,
                             reference_s=reference_ms / 1e3 if reference_ms is not None else None)
    s = Session(tasks, network, store, measurer, params, strategy, seed, model_warmup, flow_run_id, trials,
                objective=goal, scheduler_options={"early_stopping_task": early_stopping_task},
                form_sets=form_sets, retime=retime, train_programs=train_programs)
    load_history(s)
    if retime:
        retime_stored_bests(s)
    retrain_cost_model(s, "start")
    before = list(s.before)
    target = s.target
    progress = artifacts.create_progress(network, target, trials)
    shown = artifacts.network_label(network)

    def search_next(i: int, in_flight: int = 0) -> Searched:
        label = f"r{s.rounds + (1 if in_flight else 0)}-t{i}-{tasks[i].name}"
        return i, search_round(s, i, label, in_flight), label

    def one(searched: Searched) -> Searched | None:
        """Measure a searched round and learn from it; returns the next round when it was searched (and
        its builds started) during this one's timings, which only a Prebuilder measurer with builders
        off the timing nodes allows (the embedded LocalCluster never does: one machine does it all)."""
        i, batch, label = searched
        if not batch.candidates:
            s.tuner.learn(i, batch, [])               # the scheduler marks the task exhausted
            log.info(f"{tasks[i].name} (task {i}): search space exhausted")
            return None
        ahead: Searched | None = None
        measurer_ = s.tuner.measurer
        if isinstance(measurer_, Prebuilder) and measurer_.prebuild_workers(tasks[i]):
            with ThreadPoolExecutor(1, thread_name_prefix="measure") as pool:
                running = pool.submit(s.tuner.measure, batch)
                try:
                    j = s.sched.choose_ahead(i)
                    if j is not None and s.done + len(batch.candidates) < trials:
                        ahead = search_next(j, in_flight=len(batch.candidates))
                        if ahead[1].candidates:
                            measurer_.prebuild(tasks[j], [c.steps_json for c in ahead[1].candidates])
                finally:
                    measure_batch(s, i, batch, label, running)     # this round's records, whatever happened
        else:
            measure_batch(s, i, batch, label)
        if s.rounds % retrain_every == 0:
            retrain_cost_model(s, f"r{s.rounds}")
        est = s.estimate()
        artifacts.update_progress(progress, s.done, trials,
                                  f"{shown} on {target}: {s.done}/{trials} trials, {s.rounds} rounds, estimated "
                                  + (f"{est * 1e3:.4f} ms" if math.isfinite(est) else "latency n/a yet"))
        return ahead

    stopped = ""
    ahead: Searched | None = None
    try:
        while s.done < trials:
            warmed_up = not s.sched.warmup_order()
            if warmed_up and latency_target_ms is not None and s.estimate() * 1e3 <= latency_target_ms:
                stopped = f"the estimate {_ms(s.estimate())} meets the target of {latency_target_ms} ms"
                break
            if ahead is None:
                i = s.sched.choose()
                if i is None:
                    stopped = "every task is exhausted or dead"
                    break
                ahead = search_next(i)
            ahead = one(ahead)
    finally:
        # a run that fails mid-way still shows what it measured (every batch is in the store already)
        rows = s.rows()
        artifacts.publish_task_table(network, target, rows)
        artifacts.publish_round_timeline(network, target, s.timeline)
        artifacts.publish_estimate(network, target, rows, before, store.location.url, s.model.version,
                                   s.form_sets)
    done = s.done
    if stopped:
        log.info(f"{stopped}: stopping after {done} of {trials} trials")
    artifacts.update_progress(progress, trials, trials, f"{shown} on {target}: done, {done} trials in "
                              f"{s.rounds} rounds" + (f" (stopped early: {stopped})" if stopped else ""))
    weights = [t.weight for t in tasks]
    summary: dict[str, Any] = {
               "network": network, "target": target, "flow_run_id": flow_run_id, "records": store.location.url,
               "trials": done, "rounds": s.rounds, "model_version": s.model.version,
               "estimate_default_s": artifacts.estimate(weights, s.tuner.default_latency, s.form_sets),
               "estimate_stored_s": artifacts.estimate(weights, s.stored, s.form_sets),
               "estimate_before_s": artifacts.estimate(weights, before, s.form_sets), "estimate_after_s": s.estimate(),
               "seconds": {k: round(v, 3) for k, v in s.seconds.items()},
               "round_median_s": artifacts.round_medians(s.timeline),
               "tasks": [r.as_dict() for r in rows]}
    stored, before = summary["estimate_stored_s"], summary["estimate_before_s"]
    as_stored = "" if stored == before or not math.isfinite(stored) else f" ({_ms(stored)} as stored)"
    log.info(f"done: {done} trials in {s.rounds} rounds; estimated latency "
             f"{_ms(before)} at the start{as_stored}, {_ms(summary['estimate_after_s'])} now "
             f"(runtime defaults {_ms(summary['estimate_default_s'])}); records in {store.location.url}")
    return summary


def _ms(x: float) -> str:
    return f"{x * 1e3:.4f} ms" if math.isfinite(x) else "n/a (a task has no valid program yet)"


def _cluster_address(cluster: str | None) -> str | None:
    """--cluster, else $TENSORTUNE_CLUSTER, else the Prefect Variable tensortune_cluster, else local."""
    if cluster is not None or os.environ.get(CLUSTER_ENV):
        return cluster
    from prefect.variables import Variable
    return Variable.get(CLUSTER_VARIABLE, default=None)


@task(name="measure-target", **_STEP)
def measure_target(client, target: str) -> MeasureTarget:
    """The target to tune for, from the measure workers (each reports its CPU and cores): a bare `llvm`
    is theirs, not this process's (flows.measure_targets)."""
    resolved = resolve_measure_target(target, measure_node_targets(client))
    workers = cluster_workers(client)
    get_run_logger().info(f"Dask scheduler {client.scheduler.address}, {len(workers)} workers; tuning for "
                          f"{parse_target(resolved.target)}, timed on "
                          f"{', '.join(resolved.workers) or 'the workers with the resource'}")
    return resolved


def _measurer(client, timing: TimingOptions | dict[str, Any] | None,
              workers: tuple[str, ...] = (), base: TimingConfig = NETWORK_TIMING) -> DaskMeasurer:
    # network tuning times kernels as the network runs them: its footprint streamed through the caches
    # first (codegen.timing.NETWORK_TIMING, flows.tuning.network_timing)
    options = timing_options(timing)
    return DaskMeasurer(client, timing=options.config(base), build_timeout=options.build_timeout,
                        run_timeout=options.run_timeout, workers=workers)


def _run_name() -> str:
    """'resnet-18-llvm-2026-11-23-0830': network, target kind and UTC start, readable in the runs list."""
    from prefect.runtime import flow_run
    p = flow_run.parameters
    name = artifacts.network_label(str(p.get("network") or p.get("workload") or "tune"))
    return f"{name}-{str(p.get('target', 'llvm')).split()[0]}-{datetime.now(timezone.utc):%Y-%m-%d-%H%M}"


def _flow_run_id() -> str:
    from prefect.runtime import flow_run
    return str(flow_run.get_id() or "")


@flow(name="tune-network", flow_run_name=_run_name, persist_result=False)
def tune_network_flow(network: str = "resnet-18", trials: int = 200, target: str = "llvm",
                      records: str = DEFAULT_ROOT, cluster: str | None = None, batch: int | None = None,
                      image_size: int | None = None, seq_len: int | None = None, layers: int | None = None,
                      input_shapes: list[str] | None = None, per_round: int = 64, retrain_every: int = 1,
                      model_warmup: int = WARMUP_PROGRAMS, strategy: str = "gradient", seed: int = 0,
                      search: SearchOptions | None = None, timing: TimingOptions | None = None,
                      local_workers: int = 1, latency_target_ms: float | None = None,
                      early_stopping_task: int | None = None, time_network: bool = True,
                      objective: str | None = None, reference_ms: float | None = None,
                      winograd_tiles: list[int] | None = None, retime: int = RETIME_PROGRAMS,
                      train_programs: int = TASK_PROGRAMS) -> dict[str, Any]:
    """Tune a network's tasks for `trials` measurements, resuming from the record store, then build the
    network from the store's best records, check it and time it (time_network=False leaves that out).

    network: a built-in network name or an .onnx path (input_shapes: NAME=D0,D1,... for its symbolic
    dimensions); records: folder or URL of the record store; cluster: tcp://HOST:8786 of a Dask
    scheduler (default: $TENSORTUNE_CLUSTER, the Prefect Variable tensortune_cluster, else a
    LocalCluster of `local_workers` workers); search: SearchOptions (SearchParams fields; a dict of them
    is taken too, as Prefect turns a run's JSON parameters into the model); timing: TimingOptions
    (TimingConfig fields plus build_timeout/run_timeout seconds); latency_target_ms: stop once the
    estimated latency meets it;
    early_stopping_task: trials without improvement after which a task gets no more; objective: f1, f2
    or f3 (see tune_tasks; f3 needs reference_ms, the latency to beat); winograd_tiles: also tune the
    Winograd form F(m x m, 3 x 3) of every eligible conv for these m (2, 4), the faster form is built;
    retime: each resumed task's best stored programs timed again first (0: trust the stored timings);
    train_programs: the most programs of a task each retrain trains on (0: every one; see tune_tasks).
    """
    options = {k: v for k, v in (("batch", batch), ("image_size", image_size), ("seq_len", seq_len),
                                 ("layers", layers), ("input_shapes", input_shapes)) if v is not None}
    with dask_client(_cluster_address(cluster), n_workers=local_workers,
                     resources=local_resources(parse_target(target).kind)) as client:
        where = measure_target(client, target)
        net, tasks = extract_network_tasks(network, where.target, options, tuple(winograd_tiles or ()))
        if not tasks:
            raise ValueError(f"{network} has no tuning tasks")
        summary = tune_tasks(tasks, network=network, trials=trials, records=records,
                             measurer=_measurer(client, timing, where.workers, network_timing(net)),
                             per_round=per_round, retrain_every=retrain_every,
                             model_warmup=model_warmup, strategy=strategy, seed=seed, search=search,
                             flow_run_id=_flow_run_id(), latency_target_ms=latency_target_ms,
                             early_stopping_task=early_stopping_task, objective=objective,
                             reference_ms=reference_ms, form_sets=net.form_sets(), retime=retime,
                             train_programs=train_programs)
        if time_network and tasks[0].target_kind == "llvm":
            measured = build_and_time_network(client, net, network, tasks[0].target, records,
                                              workers=where.workers)
            summary["network_timing"] = measured.as_dict()
            if not measured.passed:
                raise RuntimeError(f"{network}: the network built from the records gives wrong outputs "
                                   f"({measured.check}); the records are kept in {records}")
            summary["library"] = vars(compile_network_step(net, network, tasks[0].target, records))
        return summary


@flow(name="tune-op", flow_run_name=_run_name, persist_result=False)
def tune_op_flow(workload: str, args: list[Any], trials: int = 64, target: str = "llvm",
                 records: str = DEFAULT_ROOT, cluster: str | None = None, per_round: int = 64,
                 retrain_every: int = 1, model_warmup: int = WARMUP_PROGRAMS, seed: int = 0,
                 search: SearchOptions | None = None,
                 timing: TimingOptions | None = None, local_workers: int = 1,
                 retime: int = RETIME_PROGRAMS, train_programs: int = TASK_PROGRAMS) -> dict[str, Any]:
    """One operator (a registered workload with its arguments) tuned through the same rounds (retime,
    train_programs: as tune_network_flow's)."""
    from tensortune.codegen.target import make_task
    from tensortune.tasks.workload_registry import make_dag
    with dask_client(_cluster_address(cluster), n_workers=local_workers,
                     resources=local_resources(parse_target(target).kind)) as client:
        where = measure_target(client, target)
        task_ = make_task(make_dag(workload, *args), where.target)
        return tune_tasks([task_], network=workload, trials=trials, records=records,
                          measurer=_measurer(client, timing, where.workers), per_round=per_round,
                          retrain_every=retrain_every,
                          model_warmup=model_warmup, seed=seed, search=search, flow_run_id=_flow_run_id(),
                          retime=retime, train_programs=train_programs)


def _figure(x: object) -> str:
    """A training metric for a log line: three decimals (a metric may be missing or NaN)."""
    return f"{x:.3f}" if isinstance(x, float) else str(x)
