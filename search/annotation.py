"""Random annotation: turn a sketch into a complete program (Ansor §4.2, TVM's init population rules).

Fill the open tile sizes with a random factorisation, pick compute locations, fuse and parallelise the
outer loops, vectorise the inner ones, choose an auto-unroll depth. Every rule keeps the program valid
(tile sizes always multiply to the extent), so sampling never wastes work on broken programs.
"""
from __future__ import annotations

import functools
import random
from dataclasses import replace as dc_replace

from tensortune.schedule.stage import IllegalStep
from tensortune.schedule.state import State
from tensortune.schedule.steps import SplitStep
from tensortune.search import utils
from tensortune.search.params import SearchParams
from tensortune.search.sketch_rules import Sketch

AUTO_UNROLL_CPU = (0, 16, 64, 512)
AUTO_UNROLL_GPU = (0, 16, 64, 512, 1024)


class InvalidSample(Exception):
    """The rule could not produce a valid program for this sample (it is dropped)."""


# How often a split of a stage's contiguous output axis is drawn from the factorisations whose innermost
# tile fills whole vectors (where there are any). TVM draws every factorisation alike, so the innermost
# tile of the axis that annotation vectorises is 1 or 3 as often as 16: a MobileNet-V2 depthwise conv
# (NHWC, 96 channels) still had f.3 = 1 after 128 trials, its channels unvectorised. Half, not all:
# narrow tiles still win where the axis is short or the vector runs along another loop.
VECTOR_TILE_BIAS = 0.5


# How often the spatial tiles of a reduction are redrawn until their innermost block of accumulators fills
# between a quarter and three quarters of the vector registers (Sketch.register_tiles): enough
# independent FMA chains to hide the FMA latency, and registers left for the operands. TVM draws each
# split alone, so the block is as often 1 vector (every FMA waits on the one before) or 64 (spilled to
# the stack) as the 8-24 that run: on a Zen 5 (32 zmm), a 1024^3 matmul whose 8 x 32 float block holds
# 16 accumulators ran 453 GFLOP/s where 16 x 32 (32 of them) ran 248. Of 128 programs drawn from the
# same sketches, the fastest tenth averaged 295 GFLOP/s with the rule always on, 212 with it off (the
# ResNet-18 56x56 conv: 246 against 182). Three in four, not all: the rest are drawn as TVM draws them,
# so a tile the range misjudges is still in the first population.
REGISTER_TILE_BIAS = 0.75
REGISTER_TILE_TRIES = 32


def fill_tile_sizes(sketch: Sketch, rng: random.Random, max_innermost: int) -> list:
    """The sketch's steps with every open split filled by a random factorisation of its extent.
    The redraws below pick length tuples only; each split step is made once at the end (a dataclass
    `replace` per redraw was a sixth of drawing a program)."""
    steps = list(sketch.state.steps)
    lengths: dict[int, tuple[int, ...]] = {}

    def draw(i: int) -> tuple[int, ...]:
        st = sketch.state.steps[i]
        assert isinstance(st, SplitStep)
        lanes = sketch.vector_lanes.get(i)
        if lanes and rng.random() < VECTOR_TILE_BIAS:
            return rng.choice(_schemes_ending_in_lanes(st.extent, len(st.lengths), max_innermost, lanes))
        return rng.choice(utils.factorization_schemes(st.extent, len(st.lengths), max_innermost))

    for i in sketch.tunable:
        lengths[i] = draw(i)
    low, high = sketch.vector_registers // 4, sketch.vector_registers * 3 // 4
    for group in sketch.register_tiles:
        if rng.random() >= REGISTER_TILE_BIAS:
            continue
        for _ in range(REGISTER_TILE_TRIES):
            if low <= accumulator_vectors(sketch, lengths, group) <= high:
                break
            for i in group:
                lengths[i] = draw(i)
    for i, ls in lengths.items():
        st = steps[i]
        assert isinstance(st, SplitStep)
        steps[i] = dc_replace(st, lengths=ls)
    return steps


@functools.lru_cache(maxsize=4096)
def _schemes_ending_in_lanes(extent: int, n_lengths: int, max_innermost: int, lanes: int
                             ) -> tuple[tuple[int, ...], ...]:
    """The factorisations whose innermost tile is whole vectors (all of them where none is)."""
    schemes = utils.factorization_schemes(extent, n_lengths, max_innermost)
    return tuple(s for s in schemes if s[-1] % lanes == 0) or schemes


def accumulator_vectors(sketch: Sketch, lengths: dict[int, tuple[int, ...]], group: tuple[int, ...]) -> int:
    """Vector registers the innermost tiles of `group`'s splits hold (`lengths`: step index -> the split's
    lengths): their product, the vectorised axis's tile in whole vectors."""
    n = 1
    for i in group:
        inner = lengths[i][-1]
        lanes = sketch.vector_lanes.get(i)
        n *= -(-inner // lanes) if lanes else inner
    return n


def is_packing(stage) -> bool:
    """A CPU cache-read copy (sketch rule add_cache_read_pack)."""
    return stage.origin == "cache_read" and stage.scope == "local"


def change_compute_location(state: State, rng: random.Random) -> State:
    for sid in range(len(state.stages) - 1, -1, -1):
        stage = state.stages[sid]
        if stage.is_placeholder or stage.compute_at == "inline":
            continue
        if utils.is_tiled(stage) or utils.needs_multi_level_tiling(state, sid) or is_packing(stage):
            continue                    # a packed copy stays where its sketch put it (mutation moves it)
        candidates = utils.compute_location_candidates(state, sid)
        choice = rng.randrange(len(candidates) + 2)
        try:
            if choice == 0:
                if not utils.has_reduce_iter(stage) and not utils.is_output(state, sid):
                    state = state.compute_inline(sid)
            elif choice == 1:
                state = state.compute_root(sid)
            else:
                target, it = candidates[choice - 2]
                state = state.compute_at(sid, target, it)
        except IllegalStep:
            continue
    return state


def annotate_parallel(state: State, num_cores: int) -> State:
    for name in [st.name for st in state.stages if st.compute_at == "root" and not st.is_placeholder]:
        state = _annotate_parallel(state, state.stage_id(name), 0, num_cores)
    return state


def _annotate_parallel(s: State, sid: int, offset: int, num_cores: int) -> State:
    """Fuse and parallelise the outer spatial loops of a stage from `offset`, up to 16 tasks per core;
    an outer loop of extent 1 with stages computed in it hands the job to those stages."""
    stage = s.stages[sid]
    to_fuse, degree = [], 1
    i = offset
    while i < len(stage.iters):
        it = stage.iters[i]
        if it.kind == "reduce" or it.annotation != "none":
            break
        to_fuse.append(i)
        degree *= it.known_extent
        if degree > num_cores * 16 or utils.has_attached(s, sid, i):
            break
        i += 1
    if degree == 1 and i < len(stage.iters):
        attached = utils.attached_stages(s, sid, i)
        if attached:
            names = [s.stages[a].name for a in attached]
            for n in names:
                s = _annotate_parallel(s, s.stage_id(n), 0, num_cores)
            s = _annotate_parallel(s, sid, i + 1, num_cores)
    if to_fuse:
        if len(to_fuse) > 1:
            s = s.fuse(sid, to_fuse)
        s = s.parallel(sid, to_fuse[0])
    return s


def annotate_unroll(state: State, rng: random.Random, configs=AUTO_UNROLL_CPU) -> State:
    for sid, stage in enumerate(state.stages):
        if stage.is_placeholder or stage.compute_at == "inline":
            continue
        if utils.has_reduce_iter(stage):
            state = state.pragma(sid, 0, f"auto_unroll_max_step${rng.choice(configs)}")
    return state


def annotate_vectorization(state: State, rng: random.Random, max_vectorize: int) -> State:
    for sid in range(len(state.stages)):
        stage = state.stages[sid]
        if stage.is_placeholder or stage.compute_at == "inline":
            continue
        n = len(stage.iters)
        if is_packing(stage):
            # its loops cover the consumer's tile, not the extents the state shows: copy whole rows
            state = state.vectorize(sid, n - 1)
            continue
        num, prod = 0, 1
        tiled = utils.is_tiled(stage)
        while num < n:
            i = n - 1 - num
            it = stage.iters[i]
            if utils.has_attached(state, sid, i) or it.kind == "reduce" or it.annotation != "none":
                break
            if tiled and num != 0:
                break
            prod *= it.known_extent
            if prod > max_vectorize:
                break
            num += 1
        if num > 1:
            num = 1 + rng.randrange(num - 1)
        if num == 1:
            state = state.vectorize(sid, n - 1)
        elif num > 1:
            state = state.fuse(sid, list(range(n - num, n))).vectorize(sid, n - num)
    return state


def sample_state(sketch: Sketch, rng: random.Random, num_cores: int, params: SearchParams | None = None) -> State:
    """One random complete program from a sketch (CPU rules)."""
    params = params or SearchParams()
    steps = fill_tile_sizes(sketch, rng, params.max_innermost_split_factor)
    state = State.replay(sketch.state.dag, steps)
    if not params.disable_change_compute_location:
        state = change_compute_location(state, rng)
    state = annotate_parallel(state, num_cores)
    state = annotate_unroll(state, rng)
    state = annotate_vectorization(state, rng, params.max_vectorize_size)
    if utils.has_nested_parallel(state):
        raise InvalidSample("nested parallel loops")
    return state
