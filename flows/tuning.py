"""Tuning one task as a library call: the policy proposes, the measurer builds and times, records land.

`tune_task` wires a SketchPolicy (search) to a ProgramMeasurer (codegen) and an optional RecordStore
(storage). It resumes from the store: programs measured before are never measured again and start the
search. `apply_best` rebuilds the fastest recorded program as a callable kernel.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Callable, Sequence

import pandas as pd

from tensortune.codegen.confirmation import CONFIRM_TIMINGS, RETIME_PROGRAMS, confirm_new_bests, time_again
from tensortune.codegen.kernel_identity import PREFIX as KERNEL_PREFIX
from tensortune.codegen.kernel_identity import KernelIdentity
from tensortune.codegen.measure import BuildsAhead, LocalRunner, Measurer, MeasureResult, ProgramMeasurer
from tensortune.codegen.network_runtime import touched_bytes
from tensortune.codegen.target import make_task
from tensortune.codegen.timing import NETWORK_TIMING, TimingConfig
from tensortune.flows.stored_features import StoredFeatures
from tensortune.schedule.stage import IllegalStep
from tensortune.schedule.state import State
from tensortune.search.candidate import Candidate
from tensortune.search.cost_model import (
    DEFAULT_MODEL,
    MODEL_OBJECTIVES,
    WARMUP_PROGRAMS,
    CostModel,
    RandomModel,
    XGBModel,
)
from tensortune.search.sketch_policy import SearchParams, SketchPolicy
from tensortune.search.task_scheduler import INF_COST, Objective, TaskScheduler, effective_costs
from tensortune.storage.feature_cache import Key
from tensortune.storage.queries import competing_mask, fastest_programs
from tensortune.storage.records import MeasureRecord, RecordStore
from tensortune.storage.tasks import TaskStore
from tensortune.tasks.extract import NetworkTasks, extract_tasks
from tensortune.tasks.graph import Graph
from tensortune.tasks.models import make_network
from tensortune.tasks.search_task import SearchTask


@dataclass
class RoundLog:
    round: int
    trials: int
    best_gflops: float
    search_s: float
    measure_s: float
    train_s: float
    errors: int
    model_accuracy: float = math.nan     # the cost model's held-out pairwise accuracy after this round
    model_recall: float = math.nan       # ... and its held-out recall@k


FASTEST_KEPT = 10


@dataclass
class TuneResult:
    task: SearchTask
    best_steps: str | None
    best_latency: float                 # seconds (inf when nothing ran)
    trials: int
    rounds: list[RoundLog] = field(default_factory=list)
    curve: list[tuple[int, float]] = field(default_factory=list)   # (trials, best GFLOP/s so far)
    # the FASTEST_KEPT fastest programs of this run, (seconds, steps), fastest first: one timing each,
    # so on a noisy machine the first may be a lucky one; re-time a few before trusting the order
    fastest: list[tuple[float, str]] = field(default_factory=list)

    @property
    def best_gflops(self) -> float:
        return self.task.flops / self.best_latency / 1e9 if math.isfinite(self.best_latency) else 0.0

    @property
    def search_seconds(self) -> float:
        return sum(r.search_s + r.train_s for r in self.rounds)

    @property
    def measure_seconds(self) -> float:
        return sum(r.measure_s for r in self.rounds)


def make_model(kind: str | CostModel, seed: int = 0, warmup: int = WARMUP_PROGRAMS) -> CostModel:
    """A cost model by name (a model passes through); warmup: XGBModel.num_warmup_sample."""
    if isinstance(kind, CostModel):
        return kind
    if kind in MODEL_OBJECTIVES:
        return XGBModel(seed=seed, objective=MODEL_OBJECTIVES[kind], num_warmup_sample=warmup)
    if kind == "random":
        return RandomModel(seed)
    raise ValueError(f"unknown cost model {kind!r}; use {', '.join(map(repr, MODEL_OBJECTIVES))} or 'random'")


def to_records(task: SearchTask, cands: list[Candidate], results: list[MeasureResult], *, round_: int,
               flow_run_id: str = "", network: str = "", model_version: str = "",
               scores: list[float] | None = None, kernels: list[str] | None = None,
               retiming: bool = False) -> list[MeasureRecord]:
    """kernels: which kernel each program compiled to (SketchPolicy.kernel_of; "" not known). retiming:
    stored programs timed again (retime_stored_bests), all stamped with one time."""
    out = []
    for i, (c, r) in enumerate(zip(cands, results)):
        out.append(MeasureRecord(
            workload_key=task.workload_key, target=task.target, steps=c.steps_json,
            kernel=kernels[i] if kernels is not None else "", flow_run_id=flow_run_id,
            round=round_, task_name=task.name, task_label=task.label, network=network, latencies=list(r.costs),
            mean_latency=r.latency, error_code=int(r.error_code), error_msg=r.error_msg[:2000],
            build_seconds=r.build_seconds, run_seconds=r.run_seconds, model_version=model_version,
            predicted_score=float(scores[i]) if scores is not None else math.nan, flops=task.flops, host=r.host,
            num_threads=task.hardware.num_cores if task.target_kind == "llvm" else 0))
    if retiming:
        now = datetime.now(timezone.utc)
        for record in out:
            record.retiming, record.timestamp = True, now
    return out


def resume_policy(policy: SketchPolicy, frame: pd.DataFrame, features: StoredFeatures) -> int:
    """Feed the stored history of this task (`frame`: its records on the policy's target,
    RecordStore.records_of) into the policy and its cost model; returns the number of programs in it (a
    program timed again counts once). Every stored program counts as measured and trains the model;
    the best is the fastest of the records since the task's newest re-timing
    (storage.queries.competing_mask), as the best-record query has it. The caller reads the frame, so
    that what else a resumed run needs of it (incumbents, the default schedule's timing) comes from the
    same read, and refits the model once its tasks are all read (refitted per task, ResNet-50's 36
    fits, each on all the programs read so far, took 40 s of resuming a 6000-program store; 17 s with one).

    features: the store's (flows.stored_features). A program whose features it holds is parsed, not
    replayed, and an XGBModel takes its features from it; another model learns through its `add`."""
    if frame.empty:
        return 0
    task = policy.task
    task_digest = features.task_digest(task)
    competing = competing_mask(frame, ["workload_key"])
    parts: dict[bool, tuple[list[Candidate], list[float], list[str], list[Key]]] = {
        False: ([], [], [], []), True: ([], [], [], [])}
    for steps, latency, code, kernel, counts in zip(frame["steps"], frame["mean_latency"], frame["error_code"],
                                                    frame["kernel"], competing):
        at = features.key(task_digest, steps)
        try:
            cand = features.program(task, at, steps)
        except IllegalStep:
            continue                       # a record from an older rule set: keep it, skip it here
        cands, costs, kernels, keys = parts[bool(counts)]
        cands.append(cand)
        costs.append(float(latency) if code == 0 else math.inf)
        # a kernel named by an older identity rule is lowered again (the policy does it)
        kernels.append(kernel if kernel.startswith(KERNEL_PREFIX) else "")
        keys.append(at)
    older, newer = parts[False], parts[True]
    policy.preload(*older[:3])
    policy.forget_best()                   # the older records' figures are another night's
    policy.preload(*newer[:3])
    cands, costs, keys = older[0] + newer[0], older[1] + newer[1], older[3] + newer[3]
    if isinstance(policy.model, XGBModel):
        policy.model.add_features(task, features.matrices(policy.model, task, keys, cands), costs, cands)
    else:
        policy.model.add(task, cands, costs)
    return len({c.key for c in cands})


@dataclass(frozen=True)
class Incumbent:
    """A stored program a resumed run times again: its steps as stored, the kernel its records name, and
    the program replayed under today's rules."""
    steps: str
    kernel: str
    candidate: Candidate


def incumbents(policy: SketchPolicy, frame: pd.DataFrame, k: int) -> list[Incumbent]:
    """The task's `k` fastest competing stored programs (frame: its records) that replay under today's
    rules, fastest first: what a resumed run times again. A program an older rule set stored and
    IllegalStep now refuses is passed over for the next, so a stale figure is not kept for want of a
    program to time (resume_policy passed over the same ones)."""
    out: list[Incumbent] = []
    if k < 1:
        return out
    for steps, kernel in fastest_programs(frame):
        if len(out) >= k:
            break
        try:
            out.append(Incumbent(steps, kernel, Candidate.of(State.from_json(policy.task.dag, steps))))
        except IllegalStep:
            continue
    return out


@dataclass(frozen=True)
class Retiming:
    """A resumed task's best stored programs timed again: how many, the best figure stored before and
    timed now (seconds; inf where none ran; the stored one where the measuring lost them all), each
    program's figure now (steps -> seconds; inf: failed or lost), and how many the measuring lost."""
    programs: int
    stored: float
    now: float
    timed: dict[str, float] = field(default_factory=dict)
    lost: int = 0


def retime_stored_bests(policy: SketchPolicy, measurer: Measurer, records: RecordStore,
                        programs: Sequence[Incumbent], *, timings: int = CONFIRM_TIMINGS, round_: int = 0,
                        flow_run_id: str = "", network: str = "") -> Retiming | None:
    """Time the task's fastest stored `programs` (`incumbents`) again
    (each 1 + `timings` times, as a best is confirmed) before a resumed run measures anything of it,
    append them as re-timing records, and make the fastest of them the policy's best; None when there
    is none to time.

    Without it a night compares its programs with figures from other nights. On the shared 2-vCPU VM
    these tune on, the same kernels ran 1.5-1.9 times slower in one evening hour than in the afternoon:
    a best stored in a fast hour then stays below everything a slow night measures, the scheduler sees
    no task improve, the measured network runs far above the estimate (+59-115 % in three resumed
    ResNet-50 runs; docs/performance.md), and the network is built from whichever night was luckier
    rather than from the fastest program tonight.
    The re-timings are new records (nothing stored is rewritten); from them on the task's older records
    are history, not its best (storage.queries.competing_mask), for every reader of the store.

    A program that fails when timed again (it crashes, answers wrongly, no longer builds) is evidence
    against it, and so a re-timing. One the measuring lost (MeasureResult.lost: a worker or the cluster
    gone) is not: its record is stored as an ordinary failed measurement, not a re-timing, so a night
    whose cluster lost every re-timing leaves the task's stored best standing for the next night and for
    the best-record query (had it cut the history off, the deployed network would lose its tuned
    kernels to a broken cluster), and this run goes on from the stored figures."""
    if not programs:
        return None
    cands, steps = [p.candidate for p in programs], [p.steps for p in programs]
    stored = policy.best_cost
    results = time_again(measurer, policy.task, steps, timings)
    stamped = to_records(policy.task, cands, results, round_=round_, flow_run_id=flow_run_id, network=network,
                         model_version=policy.model.version, kernels=[p.kernel for p in programs], retiming=True)
    for record, result in zip(stamped, results):
        record.retiming = not result.lost
    records.append(stamped)
    remember_task(records, policy.task)
    ran = [(c, r.latency) for c, r in zip(cands, results) if not r.lost]
    if ran:
        policy.forget_best()
        policy.preload([c for c, _ in ran], [t for _, t in ran])   # their programs are in the model's data already
    return Retiming(len(cands), stored, policy.best_cost, {s: r.latency if r.ok else math.inf
                                                           for s, r in zip(steps, results)},
                    lost=len(cands) - len(ran))


def propose(policy: SketchPolicy, n: int) -> tuple[list[Candidate], list[float] | None]:
    """Up to n programs never measured before, with the cost model's scores (None while it is random).
    The search scored them already: `policy.predict` reads those scores back (featurising the batch
    again cost a search round up to a tenth more: its parts' feature templates are dealt to the helper
    process, but a batch of 64 is featurised in this process alone, so their templates were made twice)."""
    batch = policy.next_batch(n)
    scores = [float(x) for x in policy.predict(batch)] if batch and not policy.model.is_random else None
    return batch, scores


def learn(policy: SketchPolicy, batch: list[Candidate], results: list[MeasureResult], scores: list[float] | None,
          *, records: RecordStore | None = None, round_: int = 0, flow_run_id: str = "", network: str = "") -> None:
    """Store the measurements first (learning may fail; a record must not be lost), then update."""
    if not batch:
        return
    if records is not None:
        records.append(to_records(policy.task, batch, results, round_=round_, flow_run_id=flow_run_id,
                                  network=network, model_version=policy.model.version, scores=scores,
                                  kernels=[policy.kernel_of(c) for c in batch]))
        remember_task(records, policy.task)
    policy.update(batch, [r.latency for r in results])


_REMEMBERED: set[tuple[str, str]] = set()       # (store URL, workload key) this process has stored


def remember_task(records: RecordStore, task: SearchTask) -> None:
    """Store the task beside its records (storage.tasks), once: a model that trains on the records of
    every task of the target rebuilds the programs of other networks' tasks from it (flows.retrain,
    transfer)."""
    key = (records.location.url, task.workload_key)
    if key not in _REMEMBERED:
        TaskStore(records.location.url).add(task.workload_key, task.to_json(), task.name, task.label)
        _REMEMBERED.add(key)


def round_log(policy: SketchPolicy, round_: int, batch: list[Candidate], results: list[MeasureResult],
              search_s: float, measure_s: float, train_s: float) -> RoundLog:
    """The log line of one round of the policy's task, with its cost model's latest metrics."""
    best = policy.best[0] if policy.best else 0.0
    log = RoundLog(round_, len(batch), best, search_s, measure_s, train_s, sum(1 for r in results if not r.ok))
    metrics = policy.model.metrics
    if metrics is not None:
        log.model_accuracy, log.model_recall = metrics.pairwise_accuracy, metrics.recall_at_k
    return log


def run_round(policy: SketchPolicy, measurer: Measurer, n: int, *, records: RecordStore | None = None,
              round_: int = 0, flow_run_id: str = "", network: str = "",
              confirm: int = CONFIRM_TIMINGS) -> tuple[list[Candidate], list[MeasureResult], RoundLog]:
    """One search round of one task: propose n programs, measure them (a would-be best `confirm` times
    more: codegen.confirmation), record, learn."""
    t0 = time.perf_counter()
    batch, scores = propose(policy, n)
    t1 = time.perf_counter()
    results = measure_batch(measurer, policy, batch, confirm)
    t2 = time.perf_counter()
    learn(policy, batch, results, scores, records=records, round_=round_, flow_run_id=flow_run_id,
          network=network)
    return batch, results, round_log(policy, round_, batch, results, t1 - t0, t2 - t1, time.perf_counter() - t2)


def measure_batch(measurer: Measurer, policy: SketchPolicy, batch: list[Candidate],
                  confirm: int = CONFIRM_TIMINGS) -> list[MeasureResult]:
    """The batch's results, a program that would beat the policy's best timed `confirm` times more."""
    if not batch:
        return []
    steps = [c.steps_json for c in batch]
    results = measurer.measure(policy.task, steps)
    return confirm_new_bests(measurer, policy.task, steps, results, policy.best_cost, timings=confirm)


def default_programs(task: SearchTask) -> list[State]:
    """The network runtime's default schedule, measured first so a tuned task is never worse."""
    if task.target_kind != "llvm":
        return []
    from tensortune.schedule.default_schedule import default_schedule
    try:
        return [default_schedule(task.dag)]
    except (IllegalStep, ValueError):
        return []


def tune_task(task: SearchTask, trials: int, *, measurer: Measurer | None = None,
              model: str | CostModel = DEFAULT_MODEL, params: SearchParams | None = None,
              records: RecordStore | None = None, seed: int = 0, flow_run_id: str = "", network: str = "",
              progress: Callable[[RoundLog, TuneResult], None] | None = None,
              measure_default: bool = False, confirm: int = CONFIRM_TIMINGS,
              retime: int = RETIME_PROGRAMS) -> TuneResult:
    """Measure `trials` new programs for `task` and return the best (including earlier records).
    measure_default: also measure the network runtime's default schedule (first round). confirm: timings
    added to a program before it becomes the best (codegen.confirmation; 0: none). retime: stored
    programs timed again first, when `records` has some (retime_stored_bests; 0: none)."""
    params = params or SearchParams()
    policy = SketchPolicy(task, make_model(model, seed), params, seed=seed,
                          initial_programs=default_programs(task) if measure_default else None,
                          kernel_identity=KernelIdentity(task))
    own = measurer is None
    measurer = measurer or ProgramMeasurer()
    result = TuneResult(task, None, math.inf, 0)
    try:
        if records is not None:
            stored = records.records_of(task.workload_key, target=task.target)
            features = StoredFeatures(records)
            read = resume_policy(policy, stored, features)
            features.done()
            if read:
                policy.model.refit()
                if retime:
                    retime_stored_bests(policy, measurer, records, incumbents(policy, stored, retime),
                                        timings=confirm, flow_run_id=flow_run_id, network=network)
        if policy.best is not None:
            result.best_steps, result.best_latency = policy.best[1].steps_json, policy.best_cost
        rnd = 0
        while result.trials < trials:
            n = min(params.num_measures_per_round, trials - result.trials)
            batch, results, log = run_round(policy, measurer, n, records=records, round_=rnd,
                                            flow_run_id=flow_run_id, network=network, confirm=confirm)
            if not batch:
                break                         # the space is exhausted
            for c, r in zip(batch, results):
                result.trials += 1
                if r.ok and r.latency < result.best_latency:
                    result.best_latency, result.best_steps = r.latency, c.steps_json
                if r.ok:
                    result.fastest.append((r.latency, c.steps_json))
                result.curve.append((result.trials, result.best_gflops))
            result.fastest = sorted(result.fastest)[:FASTEST_KEPT]
            log.trials, log.best_gflops = result.trials, result.best_gflops
            result.rounds.append(log)
            if progress is not None:
                progress(log, result)
            rnd += 1
    finally:
        if own:
            measurer.close()
    return result


@dataclass
class NetworkTuneResult:
    tasks: list[SearchTask]
    best_costs: list[float]                   # seconds per task (inf: none valid)
    best_steps: list[str | None]
    trials: int
    curve: list[tuple[int, float]] = field(default_factory=list)   # (trials, objective = est. latency)
    decisions: list[tuple[int, str]] = field(default_factory=list)
    form_sets: list[tuple[int, ...]] = field(default_factory=list)   # alternative forms: one term, the min

    @property
    def estimated_latency(self) -> float:
        """Weighted sum of the task bests, the fastest form of each group with alternatives; inf while a
        term has no valid program (the scheduler counts those as INF_COST seconds, which no reader
        should see as a latency)."""
        costs = effective_costs(self.best_costs, self.form_sets)
        if any(c >= INF_COST for c in costs):
            return math.inf
        return float(sum(t.weight * c for t, c in zip(self.tasks, costs)))


def network_tasks(network: str | Graph, target: str = "llvm", winograd_tiles: Sequence[int] = (),
                  **options) -> tuple[NetworkTasks, list[SearchTask]]:
    """A network (a builder name with its options, e.g. image_size=32, or a Graph such as an imported
    ONNX model) split into its tuning tasks for `target`; `winograd_tiles` adds the Winograd forms of
    eligible convs as tasks (tune them with `form_sets=net.form_sets()`)."""
    graph = make_network(network, **options) if isinstance(network, str) else network
    net = extract_tasks(graph, winograd_tiles)
    # network tasks opt in to layout rewrite: tuning times each kernel with its constant weights stored
    # as build_network stores them
    return net, [make_task(t.dag, target, t.name, t.weight, t.layout_free) for t in net.tasks]


@dataclass
class Proposal:
    """One round's programs for task `task`, as `NetworkTuner.propose` hands them out to be measured."""
    task: int
    candidates: list[Candidate]
    scores: list[float] | None              # the cost model's, None while it ranks at random
    search_s: float = math.nan              # wall seconds the policy took to propose it


class NetworkTuner:
    """`tune_network` one round at a time, and the one round body of every network loop: `propose(i)` asks
    task i's policy for a batch, `measure` times it, `learn(i, batch, results)` stores the records and
    tells the policy and the scheduler. `step()` runs the round the scheduler chooses, so a caller can
    stop between rounds or let two schedulers take turns on one machine (the benchmark does, so that
    the machine's drift hits both alike); the flow runs the three parts as steps of its own.

    With `records`, the stored history of every task is read first (`resume()`), and with a measurer each
    task's `retime` best stored programs are timed again (`retime_stored_bests()`; resume=False leaves both
    to the caller): programs measured before are never measured again, and the scheduler starts from
    each task's stored best as timed now."""

    def __init__(self, tasks: list[SearchTask], trials: int, measurer: Measurer | None, *,
                 model: str | CostModel = DEFAULT_MODEL, params: SearchParams | None = None,
                 records: RecordStore | None = None, strategy: str = "gradient", objective: Objective | None = None,
                 seed: int = 0, flow_run_id: str = "", network_name: str = "", scheduler_options: dict | None = None,
                 progress: Callable[[int, RoundLog, "NetworkTuneResult"], None] | None = None,
                 resume: bool = True, form_sets: Sequence[Sequence[int]] = (), confirm: int = CONFIRM_TIMINGS,
                 first_round: int | None = None, retime: int = RETIME_PROGRAMS, cache_features: bool = True):
        self.trials, self.measurer, self.records, self.progress = trials, measurer, records, progress
        self.cache_features = cache_features      # resume() through the store's feature cache
        self.retime = retime              # stored programs of a resumed task timed again (0: none)
        self.confirm = confirm            # timings added to a would-be best (codegen.confirmation)
        self.flow_run_id, self.network_name = flow_run_id, network_name
        self.params = params = params or SearchParams()
        self.model = make_model(model, seed)
        initial = [default_programs(t) for t in tasks]
        # the runtime's default schedule of each task (None: it has none), measured in its first round
        self.default_steps = [p[0].steps_json() if p else None for p in initial]
        self.policies = [SketchPolicy(t, self.model, params, seed=seed + i, initial_programs=p,
                                      kernel_identity=KernelIdentity(t))
                         for i, (t, p) in enumerate(zip(tasks, initial))]
        self.sched = TaskScheduler(tasks, objective=objective, strategy=strategy, seed=seed,
                                   form_sets=form_sets, **(scheduler_options or {}))
        self.per_round = max(1, min(params.num_measures_per_round, trials // len(tasks)))
        # programs in a task's first round (at most per_round; None: per_round, TVM's warm-up). A short
        # first round leaves the gradient more of the budget (ResNet-50 with Winograd forms: 36 tasks, so
        # 3000 trials in rounds of 64 leave it 700 after the warm-up); tried at 16 against 64 on the Xeon,
        # the estimate ended 1.6-3.6 % lower at equal trials in four of four runs, but the measured networks
        # did not follow beyond their noise and the runs took up to 28 % longer (more rounds), so the
        # default stays TVM's (`python -m bench first_round`; docs/performance.md, "A short first round")
        self.first_round = first_round
        self.history = [0] * len(tasks)           # programs of each task read from the records
        # what resume() kept of each task's records: its fastest stored programs, for retime_stored_bests
        self.incumbents: list[list[Incumbent]] = [[] for _ in tasks]
        # the default schedule's newest timing (seconds; nan: none): stored, timed again, or measured in a
        # round of this tuner, what "speedup vs default" counts from
        self.default_latency = [math.nan] * len(tasks)
        self.trials_run = [0] * len(tasks)        # ... and measured by this tuner
        self.result = NetworkTuneResult(tasks, [], [], 0, form_sets=[tuple(f) for f in form_sets])
        self._sync_result()
        self.rounds = 0
        if resume and records is not None:
            self.resume()
            if measurer is not None:
                self.retime_stored_bests()

    def resume(self) -> list[int]:
        """Read each task's stored history into its policy, the cost model and the scheduler (one read of
        the store per target); returns the number of programs read per task. Through the store's feature
        cache (flows.stored_features; cache_features=False: without): the programs it holds are neither
        replayed nor featurised, and the features computed are saved to it."""
        if self.records is None:
            return list(self.history)
        features = StoredFeatures(self.records, enabled=self.cache_features)
        for i, (p, stored) in enumerate(zip(self.policies, self._stored_frames())):
            n = self.history[i] = resume_policy(p, stored, features)
            self.incumbents[i] = incumbents(p, stored, self.retime)
            default = self.default_steps[i]
            if n and default is not None:
                ran = stored[(stored["steps"] == default) & (stored["error_code"] == 0)]
                if not ran.empty:
                    self.default_latency[i] = float(ran["mean_latency"].iloc[-1])     # its newest timing
            if n and p.best is not None:
                self._restore(i)
        features.done()
        if any(self.history):
            self.model.refit()
        self._sync_result()
        return list(self.history)

    def _stored_frames(self) -> list[pd.DataFrame]:
        """Each task's records on its target (RecordStore.records_of), from one read of the store per
        target: a read per task scanned the store's files once per task (36 times for ResNet-50)."""
        assert self.records is not None
        tasks = [p.task for p in self.policies]
        frames: dict[tuple[str, str], pd.DataFrame] = {}
        empty = pd.DataFrame()
        for target in dict.fromkeys(t.target for t in tasks):
            frame = self.records.read(target=target, workload_key=sorted({t.workload_key for t in tasks
                                                                          if t.target == target}))
            empty = frame.iloc[0:0]
            for key, rows in frame.groupby("workload_key", sort=False, observed=True):
                frames[(target, str(key))] = rows.reset_index(drop=True)
        return [frames.get((t.target, t.workload_key), empty) for t in tasks]

    def retime_stored_bests(self, on_task: Callable[[int, Retiming], None] | None = None
                            ) -> list[Retiming | None]:
        """Time each resumed task's `retime` best stored programs again and restart the scheduler from
        those figures (flows.tuning.retime_stored_bests); a task none of whose re-timings ran goes back
        to the warm-up, one whose re-timings the measuring lost keeps its stored best. `on_task(i, retiming)`
        after each task (progress). None for a task not timed again."""
        out: list[Retiming | None] = [None] * len(self.policies)
        if self.records is None or self.measurer is None or self.retime < 1:
            return out
        if isinstance(self.measurer, BuildsAhead):      # every task's programs in one go, then the timings
            self.measurer.build_ahead([(p.task, [inc.steps for inc in self.incumbents[i]])
                                       for i, p in enumerate(self.policies) if self.history[i]])
        for i, p in enumerate(self.policies):
            if not self.history[i]:
                continue
            done = out[i] = retime_stored_bests(p, self.measurer, self.records, self.incumbents[i],
                                                timings=self.confirm, round_=self.rounds,
                                                flow_run_id=self.flow_run_id, network=self.network_name)
            if done is None:
                continue
            now = done.timed.get(self.default_steps[i] or "", math.inf)
            if math.isfinite(now):                  # a failed re-timing replaces nothing
                self.default_latency[i] = now
            self._restore(i)
            if on_task is not None:
                on_task(i, done)
        self._sync_result()
        return out

    def _restore(self, i: int) -> None:
        """Start the scheduler's task i from its stored history: a round per round's worth of programs, and
        its policy's best; a task left with no best goes back to the warm-up."""
        p = self.policies[i]
        if p.best is not None:
            self.sched.restore(i, max(1, self.history[i] // self.params.num_measures_per_round), p.best_cost)
        else:
            self.sched.restore(i, 0, INF_COST)

    def _sync_result(self) -> None:
        self.result.best_costs = list(self.sched.best_costs)
        self.result.best_steps = [p.best[1].steps_json if p.best else None for p in self.policies]

    def propose(self, i: int, in_flight: int = 0) -> Proposal:
        """Task i's next batch: up to a round's share of the remaining budget, never measured before.
        in_flight: trials proposed and not yet learned (a round still being measured) count as spent."""
        n = min(self.round_size(i), self.trials - self.result.trials - in_flight)
        t0 = time.perf_counter()
        batch, scores = propose(self.policies[i], n)
        return Proposal(i, batch, scores, time.perf_counter() - t0)

    def round_size(self, i: int) -> int:
        """Programs in task i's next round: `first_round` while the scheduler has given it none (a resumed
        task has had its rounds), `per_round` after."""
        if self.first_round is not None and self.sched.task_rounds[i] == 0:
            return max(1, min(self.first_round, self.per_round))
        return self.per_round

    def measure(self, batch: Proposal) -> list[MeasureResult]:
        """Time the batch; a program that would beat its task's best is timed again first."""
        if not batch.candidates:
            return []
        if self.measurer is None:
            raise ValueError("this tuner has no measurer: measure the batch and pass the results to learn()")
        return measure_batch(self.measurer, self.policies[batch.task], batch.candidates, self.confirm)

    def learn(self, i: int, batch: Proposal, results: list[MeasureResult]) -> None:
        """Append the batch's records (first: learning may fail, a record must not be lost), then update
        task i's policy and the scheduler. An empty batch marks the task exhausted and is no round."""
        policy, result = self.policies[i], self.result
        learn(policy, batch.candidates, results, batch.scores, records=self.records, round_=self.rounds,
              flow_run_id=self.flow_run_id, network=self.network_name)
        self.sched.record(i, [r.latency for r in results], exhausted=not batch.candidates)
        for c, r in zip(batch.candidates, results):
            if c.steps_json == self.default_steps[i] and r.ok:
                self.default_latency[i] = r.latency
        result.best_costs = list(self.sched.best_costs)
        result.best_steps[i] = policy.best[1].steps_json if policy.best else None
        result.decisions = list(self.sched.decisions)
        result.curve.append((result.trials + len(batch.candidates), self.sched.score()))
        if batch.candidates:
            self.trials_run[i] += len(batch.candidates)
            result.trials += len(batch.candidates)
            self.rounds += 1

    def step(self) -> bool:
        """Tune the next task for one round; False (and nothing done) once the budget is spent or every
        task is dead."""
        if self.result.trials >= self.trials:
            return False
        i = self.sched.choose()
        if i is None:
            return False
        t0 = time.perf_counter()
        batch = self.propose(i)
        t1 = time.perf_counter()
        results = self.measure(batch)
        t2 = time.perf_counter()
        round_ = self.rounds
        self.learn(i, batch, results)
        if self.progress is not None:
            self.progress(i, round_log(self.policies[i], round_, batch.candidates, results,
                                       t1 - t0, t2 - t1, time.perf_counter() - t2), self.result)
        return True


def network_measurer(net: NetworkTasks | None = None) -> ProgramMeasurer:
    """The local measurer network tuning uses: kernels timed as the network runs them, the network's
    footprint streamed through the caches first (codegen.timing.NETWORK_TIMING; without `net`, every
    cache flushed); the flow's Dask measurer uses the same configuration."""
    return ProgramMeasurer(runner=LocalRunner(config=network_timing(net)))


def network_timing(net: NetworkTasks | None) -> TimingConfig:
    """NETWORK_TIMING with `net`'s footprint as the bytes flushed before each cold run."""
    return NETWORK_TIMING if net is None else replace(NETWORK_TIMING, flush_bytes=touched_bytes(net))


def tune_network(network: list[SearchTask] | str | Graph, trials: int, *, measurer: Measurer | None = None,
                 model: str | CostModel = DEFAULT_MODEL, params: SearchParams | None = None,
                 records: RecordStore | None = None, strategy: str = "gradient", objective: Objective | None = None,
                 seed: int = 0, flow_run_id: str = "", network_name: str = "", target: str = "llvm",
                 network_options: dict | None = None, scheduler_options: dict | None = None,
                 progress: Callable[[int, RoundLog, "NetworkTuneResult"], None] | None = None,
                 winograd_tiles: Sequence[int] = (), form_sets: Sequence[Sequence[int]] = ()) -> NetworkTuneResult:
    """Spend `trials` measurements over a network's tasks, where the objective gains most.

    `network`: its tasks (with `form_sets`, the sets of alternative forms among them), or a builder
    name / Graph (then split with `network_tasks(network, target, winograd_tiles, **network_options)`);
    records are labelled with `network_name` (default: the graph's name)."""
    net = None
    if isinstance(network, list):
        tasks = network
    else:
        net, tasks = network_tasks(network, target, winograd_tiles, **(network_options or {}))
        network_name = network_name or net.source.name
        form_sets = net.form_sets()
    own = measurer is None
    measurer = measurer or network_measurer(net)
    try:
        tuner = NetworkTuner(tasks, trials, measurer, model=model, params=params, records=records,
                             strategy=strategy, objective=objective, seed=seed, flow_run_id=flow_run_id,
                             network_name=network_name, scheduler_options=scheduler_options, progress=progress,
                             form_sets=form_sets)
        while tuner.step():
            pass
    finally:
        if own:
            measurer.close()
    return tuner.result


def best_steps(task: SearchTask, records: RecordStore) -> str | None:
    frame = records.best_per_task(target=task.target)
    row = frame[frame["workload_key"] == task.workload_key]
    return None if row.empty else str(row["steps"].iloc[0])


def apply_best(task: SearchTask, source: TuneResult | RecordStore):
    """The fastest measured program of the task, rebuilt and loaded: call it with numpy arrays."""
    steps = source.best_steps if isinstance(source, TuneResult) else best_steps(task, source)
    if steps is None:
        raise LookupError(f"no successful measurement of {task} yet; tune it first")
    state = State.from_json(task.dag, steps)
    if task.target_kind == "cuda":
        from tensortune.codegen.cuda_backend import CUDAKernel
        from tensortune.codegen.cuda_backend import build as build_cuda
        return CUDAKernel(build_cuda(state, task.target, hardware=task.hardware))
    from tensortune.codegen.llvm_backend import LLVMKernel, build
    return LLVMKernel(build(state, task.target))
