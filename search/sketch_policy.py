"""SketchPolicy: one task's search (Ansor §5, TVM's sketch_policy.cc).

Each round: sample an initial population from the sketches (plus the best measured programs), evolve
it under the cost model (mutation, crossover, selection by predicted fitness), and pick the programs
to measure — the best predicted, plus a few random ones (eps-greedy) — never one measured before.
The policy never builds or runs code: the caller measures and reports back through `update`. Nor
does it lower programs: where many step lists compile to one kernel, the caller may hand it a
`KernelIdentity` (flows pass codegen's), and a program whose kernel was measured, is in flight or is
picked already is passed over like a measured one.
"""
from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass

import numpy as np

from tensortune.schedule.state import State
from tensortune.search.candidate import Candidate, StepsKey
from tensortune.search.cost_model import CostModel, RandomModel
from tensortune.search.gpu_annotation import check_gpu_limits
from tensortune.search.identities import Identities, KernelIdentity
from tensortune.search.memory import paused_gc
from tensortune.search.mutation import (
    crossover,
    mutate_auto_unroll,
    mutate_compute_location,
    mutate_parallel,
    mutate_tile_size,
)
from tensortune.search.params import SearchParams
from tensortune.search.sampling import SHARES, SketchDraws
from tensortune.search.sketch_rules import Sketch, SketchContext, SketchRule, generate_sketches
from tensortune.tasks.search_task import SearchTask

log = logging.getLogger("tensortune.search")

# rounds of shares `sample` draws before it settles for fewer programs than asked (drawn programs can
# repeat each other or earlier ones; a small space runs out)
SAMPLE_WAVES = 4


@dataclass
class RoundTiming:
    sample_s: float = 0.0
    evolve_s: float = 0.0
    predict_s: float = 0.0
    n_init: int = 0
    n_evaluated: int = 0
    n_over_limits: int = 0          # GPU programs left out for exceeding the target's limits
    n_twins: int = 0                # programs passed over: their kernel was measured, in flight or picked
    identify_s: float = 0.0         # the kernel identity of the programs considered for the batch


class SketchPolicy:
    def __init__(self, task: SearchTask, cost_model: CostModel | None = None, params: SearchParams | None = None,
                 seed: int = 0, rules: list[SketchRule] | None = None,
                 initial_programs: list[State] | None = None, kernel_identity: KernelIdentity | None = None):
        self.task = task
        self.model = cost_model or RandomModel(seed)
        self.params = params or SearchParams()
        self.rng = random.Random(seed)
        self.ctx = SketchContext(task, self.params)
        self.sketches: list[Sketch] = generate_sketches(self.ctx, rules)
        if not self.sketches:
            raise ValueError(f"no sketch could be generated for {task}")
        self.draws = SketchDraws(task, self.sketches, self.params)
        self.measured: dict[StepsKey, float] = {}        # program key -> throughput (GFLOP/s), 0 if failed
        self.measured_cands: dict[StepsKey, Candidate] = {}
        # proposed and not yet measured, with their kernels ("" not known, for their records): a round
        # searched while the last one is still being timed (the flow's overlapped rounds) must not
        # propose them again
        self.in_flight: dict[StepsKey, str] = {}
        self.best: tuple[float, Candidate] | None = None     # (GFLOP/s, program) of the fastest measured
        self.best_cost = math.inf                              # ... and its seconds per run, as measured
        self.identities = Identities(kernel_identity) if kernel_identity is not None else None
        self.kernels: set[str] = set()          # the kernels of programs measured, in flight or picked
        self.twins: set[StepsKey] = set()        # programs found to repeat one of those kernels
        self.timing = RoundTiming()
        # programs to measure first (e.g. a runtime's default schedule), so tuning never ends worse
        self.initial_programs = [Candidate.of(s) for s in initial_programs or []]
        self._scores: dict[StepsKey, float] = {}
        self._score_version: tuple | None = None

    @property
    def is_gpu(self) -> bool:
        return self.task.target_kind == "cuda"

    # ------------------------------------------------------------------ sampling

    def sample(self, n: int) -> list[Candidate]:
        """n random complete programs, unique and not measured before (fewer if the space is small).
        Drawn in SHARES seeded shares on the model's helper processes (`sampling`): the same programs
        with or without helpers."""
        out: dict[StepsKey, Candidate] = {}
        for _ in range(SAMPLE_WAVES):
            need = n - len(out)
            if need <= 0:
                break
            seeds = [self.rng.randrange(1 << 31) for _ in range(SHARES)]
            before = len(out)
            for k, program in self.draws.draw(seeds, -(-need // SHARES), self.model.helpers):
                c = Candidate.of(program, k) if isinstance(program, State) else \
                    Candidate(self.task.dag, program, k)
                if not self._taken(c.key) and c.key not in out:
                    out[c.key] = c
            if len(out) == before:
                break                       # the space is (nearly) exhausted
        return list(out.values())[:n]

    # ------------------------------------------------------------------ evolution

    def predict(self, cands: list[Candidate]) -> np.ndarray:
        """Predicted scores; a program scored earlier under the same model is not featurised again."""
        t0 = time.perf_counter()
        version = (id(self.model), self.model.version, self.model.is_random)
        if self._score_version != version:
            self._scores, self._score_version = {}, version
        todo = list({c.key: c for c in cands if c.key not in self._scores}.values())
        if todo:
            for c, s in zip(todo, self.model.predict(self.task, todo)):
                self._scores[c.key] = float(s)
        self.timing.predict_s += time.perf_counter() - t0
        self.timing.n_evaluated += len(todo)
        return np.array([self._scores[c.key] for c in cands], dtype=np.float64)

    def _mutate(self, c: Candidate) -> Candidate | None:
        w = self.params.mutation_weights
        rule = self.rng.choices(list(w), weights=list(w.values()))[0]
        if rule == "tile_size":
            return mutate_tile_size(c, self.rng, self.params.max_innermost_split_factor)
        if rule == "auto_unroll":
            return mutate_auto_unroll(c, self.rng, self.is_gpu)
        if rule == "compute_location" and not self.params.disable_change_compute_location:
            return mutate_compute_location(c, self.rng)
        if rule == "parallel":
            return mutate_parallel(c, self.rng)
        return None

    def evolve(self, population: list[Candidate], out_size: int) -> list[Candidate]:
        """Evolutionary search; returns up to out_size best-predicted unmeasured programs."""
        p = self.params
        iters = p.num_iters if not self.model.is_random else min(p.num_iters, 2)
        best: dict[StepsKey, tuple[float, Candidate]] = {}
        pop = population
        for k in range(iters + 1):
            if not pop:
                break
            scores = self.predict(pop)
            for c, s in zip(pop, scores):
                if self._taken(c.key) or c.key in best:
                    continue
                best[c.key] = (float(s), c)
            if len(best) > out_size:
                best = dict(sorted(best.items(), key=lambda kv: -kv[1][0])[:out_size])
            if k == iters:
                break
            t0 = time.perf_counter()
            weights = np.maximum(scores - scores.min(), 0) + 1e-9 if len(scores) else scores
            probs = weights / weights.sum()
            parents = np.random.default_rng(self.rng.randrange(1 << 30)).choice(len(pop), size=p.population,
                                                                                 p=probs)
            nxt = []
            for idx in parents:
                parent = pop[idx]
                r = self.rng.random()
                child = None
                if r < p.crossover_prob:
                    other = pop[self.rng.choice(parents)]
                    child = crossover(parent, other, len(self.sketches[parent.sketch].state.steps), self.rng) \
                        if parent.sketch >= 0 else None
                elif r < p.crossover_prob + p.mutation_prob:
                    child = self._mutate(parent)
                else:
                    child = parent
                if child is not None:
                    nxt.append(child)
            pop = nxt
            self.timing.evolve_s += time.perf_counter() - t0
        return [c for _, c in sorted(best.values(), key=lambda x: -x[0])][:out_size]

    # ------------------------------------------------------------------ one round

    def next_batch(self, n: int | None = None) -> list[Candidate]:
        """The programs to measure next: evolved best plus eps-greedy random ones, none measured before."""
        with paused_gc():
            return self._next_batch(n)

    def _next_batch(self, n: int | None) -> list[Candidate]:
        n = n or self.params.num_measures_per_round
        self.timing = RoundTiming()
        t0 = time.perf_counter()
        init = self.sample(self.params.sample_init_population)
        n_measured = min(len(self.measured_cands), int(self.params.sample_init_use_measured_ratio *
                                                       self.params.population))
        good = sorted(self.measured_cands.values(), key=lambda c: -self.measured[c.key])[:n_measured]
        self.timing.sample_s = time.perf_counter() - t0
        self.timing.n_init = len(init)
        n_random = int(self.params.eps_greedy * n)
        best = self.evolve(init + good, 2 * n)
        randoms = [c for c in init if not self._taken(c.key)]
        self.rng.shuffle(randoms)
        picked: dict[StepsKey, tuple[Candidate, str]] = {}
        for c in self.initial_programs:         # measured whatever their kernel: the runtime's own schedule
            if not self._taken(c.key) and len(picked) < n:
                picked.setdefault(c.key, (c, self._take_kernel(c)))
        self.initial_programs = []
        self._pick(picked, best, n - n_random)
        self._pick(picked, randoms + best, n)
        self.in_flight.update((key, kernel) for key, (_, kernel) in picked.items())
        # keep the batch's scores (the caller reads them back) and drop the round's ~10 000 others: the next
        # round's model is a new one, and kept until then they were the bulk of what the cyclic collector
        # scanned when the round ended (33 of its 55 ms in a 32² round, `paused_gc`)
        self._scores = {k: self._scores[k] for k in picked if k in self._scores}
        return [c for c, _ in picked.values()]

    def _pick(self, picked: dict[StepsKey, tuple[Candidate, str]], cands: list[Candidate], size: int) -> None:
        """Take programs from `cands`, in order, into `picked` (with their kernels) until it holds `size`;
        pass over those taken already, over the target's limits, or twins of a kernel measured, in flight
        or picked (remembered in `twins`). The programs a pick will consider are known ahead: the next
        `size - len(picked)` eligible ones are each picked or found a twin, so their kernels are asked for
        together (`Identities` lowers them on the helpers too), chunk after chunk while twins leave room."""
        rest = iter(cands)
        while len(picked) < size:
            chunk: dict[StepsKey, Candidate] = {}
            for c in rest:
                if c.key not in picked and c.key not in chunk and not self._taken(c.key) and self._runnable(c):
                    chunk[c.key] = c
                    if len(chunk) == size - len(picked):
                        break
            if not chunk:
                return
            for c, kernel in zip(chunk.values(), self._kernels(list(chunk.values()))):
                if kernel is not None and kernel in self.kernels:
                    self.twins.add(c.key)
                    self.timing.n_twins += 1
                    continue
                if kernel is not None:
                    self.kernels.add(kernel)
                picked[c.key] = (c, kernel or "")

    def _taken(self, key: StepsKey) -> bool:
        """Measured, proposed and still being measured, or a known twin of either: never proposed (again)."""
        return key in self.measured or key in self.in_flight or key in self.twins

    def _runnable(self, c: Candidate) -> bool:
        """False for a GPU program over the target's limits (threads, vthreads, shared memory): tile-size
        mutations and crossover can cross them, and measuring it would only waste a trial."""
        if not self.is_gpu:
            return True
        why = check_gpu_limits(c.state, self.task.hardware)
        if why is not None:
            self.timing.n_over_limits += 1
        return why is None

    def _take_kernel(self, c: Candidate, kernel: str = "") -> str:
        """c's kernel (as stored with its record, else by the identity) counts as measured: no later pick
        repeats it. Returns it ("" not known)."""
        kernel = kernel or self._kernels([c])[0] or ""
        if kernel:
            self.kernels.add(kernel)
        return kernel

    def kernel_of(self, c: Candidate) -> str:
        """The kernel of a program in flight, for its record ("" not known)."""
        return self.in_flight.get(c.key, "")

    def _kernels(self, cands: list[Candidate]) -> list[str | None]:
        if self.identities is None:
            return [None] * len(cands)
        t0 = time.perf_counter()
        kernels = self.identities(cands, self.model.helpers)
        self.timing.identify_s += time.perf_counter() - t0
        return kernels

    def update(self, cands: list[Candidate], costs: list[float]) -> None:
        """Record measurements (seconds per run; inf for failures) and retrain the cost model."""
        for c, cost in zip(cands, costs):
            self._note(c, cost)
        with paused_gc():
            self.model.update(self.task, list(cands), list(costs))

    def preload(self, cands: list[Candidate], costs: list[float], kernels: list[str] | None = None) -> None:
        """Resume: measurements from the history count as measured (and seed the population); `kernels`:
        their records' kernels ("" where a record names none, as in stores written before records kept
        them: lowered in one call, so on the helpers too, if the policy has an identity)."""
        kernels = list(kernels or [""] * len(cands))
        unnamed = [i for i, k in enumerate(kernels) if not k and self._kernel_untaken(cands[i])]
        if unnamed and self.identities is not None:
            for i, kernel in zip(unnamed, self._kernels([cands[i] for i in unnamed])):
                kernels[i] = kernel or ""
        for c, cost, kernel in zip(cands, costs, kernels):
            self._note(c, cost, kernel)

    def forget_best(self) -> None:
        """No measured program is the best any more (they stay measured, with their figures): a resumed
        task's best is what its stored programs time now (flows.tuning.retime_stored_bests)."""
        self.best, self.best_cost = None, math.inf

    def _kernel_untaken(self, c: Candidate) -> bool:
        """c was neither picked here (its kernel taken then) nor measured before: a stored record
        (resume) or a program the caller chose, whose kernel `_note` takes."""
        return c.key not in self.in_flight and c.key not in self.measured

    def _note(self, c: Candidate, cost: float, kernel: str = "") -> None:
        if self._kernel_untaken(c):
            self._take_kernel(c, kernel)
        self.in_flight.pop(c.key, None)
        # a task without FLOPs (a transpose, a copy) counts one operation per run, so its programs rank
        # by time like any other's: counted as 0 GFLOP/s, none was ever its best, and the network ran its
        # default schedule whatever the search had measured
        ok = bool(cost) and math.isfinite(cost) and cost > 0
        gflops = max(self.task.flops, 1.0) / cost / 1e9 if ok else 0.0
        self.measured[c.key] = gflops
        self.measured_cands[c.key] = c
        if gflops > 0 and (self.best is None or gflops > self.best[0]):
            self.best, self.best_cost = (gflops, c), cost
