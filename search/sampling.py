"""A round's initial population, drawn on every core (Ansor §5; TVM's SampleInitPopulation runs a
parallel_for over the population with one random generator per thread).

Drawing 2048 random programs from the sketches is a third of a search round in one Python process.
The draw is cut into SHARES shares, each with its own seed from the policy's generator, and share i is
drawn by helper i % (helpers + 1) (helper 0 being this process): the programs are the same whatever
the number of helpers (none inside a Dask worker), and the shares of a helper that died are drawn here.

A helper rebuilds the task's sketches once from their steps and keeps them. It sends back step tuples
(Step.__reduce__ keeps that cheap); the caller wraps them in Candidates that replay their loops only
if something needs them (a compute-location mutation, a new feature template, a build), which most
never do.
"""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Callable

from tensortune.schedule.stage import IllegalStep
from tensortune.schedule.state import State
from tensortune.schedule.steps import Step
from tensortune.search.annotation import InvalidSample, sample_state
from tensortune.search.gpu_annotation import sample_gpu_state
from tensortune.search.helper_pool import HelperPool, run_shares
from tensortune.search.memory import paused_gc
from tensortune.search.params import SearchParams
from tensortune.search.sketch_rules import Sketch
from tensortune.tasks.search_task import SearchTask

SHARES = 8
MIN_SHARED = 256        # smaller draws are not worth a round trip to a helper

Drawn = list[tuple[int, State | tuple[Step, ...]]]     # (sketch index, program or its steps)


@dataclass(frozen=True)
class SketchSpec:
    """A sketch as plain data: what a helper rebuilds it from."""
    steps: tuple[Step, ...]
    tunable: tuple[int, ...]
    vector_lanes: tuple[tuple[int, int], ...]
    register_tiles: tuple[tuple[int, ...], ...]
    vector_registers: int

    @staticmethod
    def of(sketch: Sketch) -> "SketchSpec":
        return SketchSpec(sketch.state.steps, sketch.tunable, tuple(sorted(sketch.vector_lanes.items())),
                          sketch.register_tiles, sketch.vector_registers)

    def sketch(self, task: SearchTask) -> Sketch:
        return Sketch(State.replay(task.dag, self.steps), self.tunable, dict(self.vector_lanes),
                      self.register_tiles, self.vector_registers)


def draw_share(task: SearchTask, sketches: list[Sketch], params: SearchParams, seed: int, count: int
               ) -> list[tuple[int, State]]:
    """Up to `count` random programs (sketch index, state) from one seed; a draw that breaks a rule or
    a limit is retried, twice as many tries as programs at most."""
    rng = random.Random(seed)
    sample = _sampler(task, params, rng)
    out: list[tuple[int, State]] = []
    tries = 0
    while len(out) < count and tries < 2 * count + 10:
        tries += 1
        k = rng.randrange(len(sketches))
        try:
            out.append((k, sample(sketches[k])))
        except (InvalidSample, IllegalStep):
            continue
    return out


def _sampler(task: SearchTask, params: SearchParams, rng: random.Random) -> Callable[[Sketch], State]:
    if task.target_kind == "cuda":
        return lambda sk: sample_gpu_state(sk, rng, task, params)
    return lambda sk: sample_state(sk, rng, task.hardware.num_cores, params)


class SketchDraws:
    """One task's sketches and the helpers its draws are dealt to."""

    def __init__(self, task: SearchTask, sketches: list[Sketch], params: SearchParams):
        self.task, self.sketches, self.params = task, sketches, params
        self._specs: tuple[SketchSpec, ...] | None = None
        self._specs_key = ""

    def draw(self, seeds: list[int], count: int, helpers: HelperPool | None) -> Drawn:
        """`count` programs per seed (fewer where draws keep failing), in seed order."""
        ways = helpers.processes + 1 if helpers is not None and count * len(seeds) >= MIN_SHARED else 1
        task_json, (specs, key) = (self.task.to_json(), self._shipped()) if ways > 1 else ("", ((), ""))

        def job(seed: int) -> tuple:
            return _draw_in_helper, (task_json, key, specs, self.params, seed, count)
        shares = run_shares(helpers, seeds, lambda i: i % ways - 1 if i % ways else None, job,
                            lambda seed: list(draw_share(self.task, self.sketches, self.params, seed, count)))
        return [x for share in shares for x in share]

    def _shipped(self) -> tuple[tuple[SketchSpec, ...], str]:
        if self._specs is None:
            self._specs = tuple(SketchSpec.of(s) for s in self.sketches)
            text = repr([(s.steps, s.tunable) for s in self._specs]) + self.task.to_json()
            self._specs_key = f"{self.task.workload_key}/{zlib.crc32(text.encode()):08x}"
        return self._specs, self._specs_key


_SKETCHES: dict[str, tuple[SearchTask, list[Sketch]]] = {}   # inside a helper: rebuilt sketches, per key


def _draw_in_helper(task_json: str, key: str, specs: tuple[SketchSpec, ...], params: SearchParams,
                    seed: int, count: int) -> list[tuple[int, tuple[Step, ...]]]:
    """A helper's share: the programs `draw_share` draws from this seed, as step tuples."""
    hit = _SKETCHES.get(key)
    if hit is None:
        task = SearchTask.from_json(task_json)
        hit = _SKETCHES[key] = (task, [s.sketch(task) for s in specs])
    task, sketches = hit
    with paused_gc():
        return [(k, st.steps) for k, st in draw_share(task, sketches, params, seed, count)]
