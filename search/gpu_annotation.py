"""GPU annotation: turn a GPU sketch into a complete program (TVM's InitThreadBind and InitUnroll).

A GPU kernel needs every root stage bound to the grid: multi-level tiled stages bind their first
three spatial tile levels to blockIdx, vthread and threadIdx; plain stages fuse their outer loops and
split them by the warp size; cross-thread reductions bind their outer loops to blockIdx; shared-memory
stages fetch cooperatively (fused, split by the consumer's thread count, bound to threadIdx.x, with a
vectorisable innermost piece). Candidates that break the target's limits (threads per block, vthread
extent, shared memory per block) are dropped here, before anyone builds them.
"""
from __future__ import annotations

import math
import random

from tensortune.schedule.stage import Split, Stage
from tensortune.schedule.state import State
from tensortune.search import utils
from tensortune.search.annotation import AUTO_UNROLL_GPU, InvalidSample, change_compute_location, fill_tile_sizes
from tensortune.search.params import SearchParams
from tensortune.search.sketch_rules import Sketch, has_cross_thread_reduction
from tensortune.tasks import te
from tensortune.tasks.arith import const_bounds
from tensortune.tasks.search_task import HardwareParams, SearchTask
from tensortune.tasks.te import DTYPE_BYTES

_THREAD_AXES = ("threadIdx.x", "threadIdx.y", "threadIdx.z")


def _is_shared_fetch(stage: Stage) -> bool:
    return stage.compute_at == "iter" and stage.scope == "shared" and stage.origin == "cache_read"


def _has_annotation(stage: Stage, annotation: str) -> bool:
    return any(it.annotation == annotation for it in stage.iters)


def spatial_split_step_ids(state: State, sid: int) -> list[int]:
    """The split steps that tiled the spatial root axes of stage `sid` (what a fetch follows)."""
    stage = state.stages[sid]
    spatial_roots = set(stage.op.axes)
    return [rel.step for rel in stage.relations
            if isinstance(rel, Split) and rel.parent in spatial_roots and rel.step >= 0]


def _fuse_group(state: State, sid: int, start: int, suffix: str, n_axes: int) -> tuple[State, int]:
    """Fuse the consecutive iterators from `start` whose names end with `suffix` (one tile level)."""
    stage = state.stages[sid]
    ids = []
    for i in range(start, min(start + n_axes, len(stage.iters))):
        if not stage.iters[i].name.endswith(suffix) or stage.iters[i].kind != "spatial":
            break
        ids.append(i)
    if not ids:
        raise InvalidSample(f"{stage.name} has no '{suffix}' tile level at iterator {start}")
    if len(ids) > 1:
        state = state.fuse(sid, ids)
    return state, start


def _bind_tiled_root(state: State, sid: int, tiled_root: bool, hw: HardwareParams) -> State:
    stage = state.stages[sid]
    if not tiled_root:
        state, _ = utils.fuse_all_outer_space_iters(state, sid)
        it = state.stages[sid].iters[0]
        if it.kind != "spatial" or it.annotation != "none":
            return state                       # nothing spatial outside: one thread runs it
        if it.known_extent <= hw.warp_size:
            return state.bind(sid, 0, "threadIdx.x")
        state = state.split(sid, 0, [hw.warp_size])
        return state.bind(sid, 0, "blockIdx.x").bind(sid, 1, "threadIdx.x")
    n_axes = len(stage.op.axes)
    space = 1
    for ax in stage.op.axes:
        space *= ax.extent
    if space <= hw.warp_size:
        state, _ = utils.fuse_all_outer_space_iters(state, sid)
        return state.bind(sid, 0, "threadIdx.x")
    check_min_threads = space > 2 * hw.warp_size
    state, i = _fuse_group(state, sid, 0, ".0", n_axes)
    state = state.bind(sid, i, "blockIdx.x")
    state, i = _fuse_group(state, sid, 1, ".1", n_axes)
    if state.stages[sid].iters[i].known_extent > hw.max_vthread_extent:
        raise InvalidSample("vthread extent exceeds the target's limit")
    state = state.bind(sid, i, "vthread")
    state, i = _fuse_group(state, sid, 2, ".2", n_axes)
    if check_min_threads and state.stages[sid].iters[i].known_extent < hw.warp_size:
        raise InvalidSample("fewer threads per block than a warp")
    return state.bind(sid, i, "threadIdx.x")


def _cooperative_fetch(state: State, sid: int) -> State:
    """Fuse the shared stage's loops, split off a vector piece, and share the rest among the threads
    of the consumer's block (FollowFusedSplit on the consumer's thread level)."""
    target = utils.attach_target(state, sid)
    if target is None:
        return state
    split_ids = spatial_split_step_ids(state, target[0])
    if not split_ids:
        return state
    n = len(state.stages[sid].iters)
    if n > 1:
        state = state.fuse(sid, list(range(n)))
    state = state.split(sid, 0, [1]).vectorize(sid, 1)
    state = state.follow_fused_split(sid, 0, split_ids, 1, True)
    return state.bind(sid, 1, "threadIdx.x")


def _attached_to(stage: Stage) -> str:
    """The op a stage computed at a loop (compute_at == "iter") is attached to."""
    if stage.attach is None:
        raise ValueError(f"{stage.name} is not attached to a loop")
    return stage.attach[0]


def init_thread_bind(state: State, hw: HardwareParams) -> State:
    """TVM's InitThreadBind."""
    tiled_roots = set()
    for sid, stage in enumerate(state.stages):
        if stage.compute_at == "iter" and utils.needs_multi_level_tiling(state, sid):
            tiled_roots.add(_attached_to(stage))
    for sid in range(len(state.stages) - 1, -1, -1):
        stage = state.stages[sid]
        if stage.is_placeholder or stage.compute_at == "inline":
            continue
        if has_cross_thread_reduction(state, sid):
            if stage.compute_at == "root":
                state, _ = utils.fuse_all_outer_space_iters(state, sid)
                it = state.stages[sid].iters[0]
                if it.kind == "spatial" and it.annotation == "none":
                    state = state.bind(sid, 0, "blockIdx.x")
            continue
        if _has_annotation(stage, "threadIdx.x"):
            continue
        if stage.compute_at == "root":
            state = _bind_tiled_root(state, sid, stage.name in tiled_roots, hw)
        elif _is_shared_fetch(stage):
            state = _cooperative_fetch(state, sid)
    return state


def init_unroll(state: State, rng: random.Random) -> State:
    """TVM's InitUnroll for GPU: an auto-unroll depth on every stage with a reduction."""
    for sid, stage in enumerate(state.stages):
        if stage.is_placeholder or stage.compute_at == "inline":
            continue
        if utils.has_reduce_iter(stage):
            state = state.pragma(sid, 0, f"auto_unroll_max_step${rng.choice(AUTO_UNROLL_GPU)}")
    return state


def _thread_extents(state: State, sid: int, acc: dict[str, int]) -> None:
    stage = state.stages[sid]
    for i, it in enumerate(stage.iters):
        if it.annotation in _THREAD_AXES or it.annotation == "vthread":
            acc[it.annotation] = max(acc.get(it.annotation, 1), it.extent or 1)
        for a in utils.attached_stages(state, sid, i):
            _thread_extents(state, a, acc)




def _block_tile(stage: Stage) -> dict[te.Var, tuple[int, int]]:
    """Per root axis of a multi-level tiled stage, the range one block covers inside the outermost
    tile level (every split level but the first: the block's threads and vthreads together)."""
    ranges: dict[te.Var, tuple[int, int]] = {ax: (0, ax.extent - 1) for ax in stage.op.axes + stage.op.reduce_axes}
    for rel in stage.relations:
        known = [e for e in rel.extents if e is not None] if isinstance(rel, Split) else []
        if isinstance(rel, Split) and rel.parent in ranges and len(known) == len(rel.extents) \
                and rel.parent_extent is not None:       # an open split length leaves the axis whole
            tile = 1
            for e in known[1:]:
                tile *= e
            ranges[rel.parent] = (0, min(tile, rel.parent_extent) - 1)
    return ranges


def shared_bytes(state: State, root: str) -> int:
    """Shared memory of the kernel of root stage `root`: each cooperatively fetched stage holds what
    its reader reads in one block tile (the bounds of the read indices over that tile)."""
    total = 0
    for stage in state.stages:
        if stage.scope != "shared" or stage.compute_at != "iter":
            continue
        reader = state.stage_by_name(_attached_to(stage))
        top = reader
        while top.compute_at == "iter":
            top = state.stage_by_name(_attached_to(top))
        if top.name != root:
            continue
        ranges = _block_tile(reader)
        extent = list(stage.op.shape)
        body = reader.op.body
        assert body is not None                       # a stage something is attached to is a compute
        for load in (n for n in te.walk(body) if isinstance(n, te.Load) and n.tensor is stage.op):
            for d, idx in enumerate(load.indices):
                lo, hi = const_bounds(idx, ranges)
                if lo != -math.inf and hi != math.inf:
                    extent[d] = min(extent[d], int(hi - lo) + 1)
            break
        n = 1
        for e in extent:
            n *= e
        total += n * DTYPE_BYTES.get(stage.op.dtype, 1)
    return total


def check_gpu_limits(state: State, hw: HardwareParams) -> str | None:
    """Why this program cannot run on the target (threads per block, vthread extent, shared memory
    per block), or None.

    Works on the state's nominal extents, which bound the lowered ones from above; the backend checks
    the exact launch and shared-memory sizes again on the lowered kernels."""
    for sid, stage in enumerate(state.stages):
        if stage.is_placeholder or stage.compute_at != "root":
            continue
        if hw.max_shared_memory_per_block:
            smem = shared_bytes(state, stage.name)
            if smem > hw.max_shared_memory_per_block:
                return f"{stage.name}: {smem} bytes of shared memory > {hw.max_shared_memory_per_block}"
        ext: dict[str, int] = {}
        _thread_extents(state, sid, ext)
        threads = 1
        for ax in _THREAD_AXES:
            threads *= ext.get(ax, 1)
        if hw.max_threads_per_block and threads > hw.max_threads_per_block:
            return f"{stage.name}: {threads} threads per block > {hw.max_threads_per_block}"
        if hw.max_vthread_extent and ext.get("vthread", 1) > hw.max_vthread_extent:
            return f"{stage.name}: vthread extent {ext['vthread']} > {hw.max_vthread_extent}"
    return None


_TILED_GROUPS: dict[int, tuple[State, list[tuple[list[int], int]]]] = {}


def _tiled_groups(sketch: Sketch) -> list[tuple[list[int], int]]:
    """(spatial split step ids, spatial extent) of each multi-level tiled stage of a sketch."""
    hit = _TILED_GROUPS.get(id(sketch))
    if hit is not None and hit[0] is sketch.state:
        return hit[1]
    state, groups = sketch.state, []
    for sid, stage in enumerate(state.stages):
        if stage.compute_at == "iter" and utils.needs_multi_level_tiling(state, sid):
            ids = [i for i in spatial_split_step_ids(state, sid) if i in sketch.tunable]
            space = 1
            for ax in stage.op.axes:
                space *= ax.extent
            if ids:
                groups.append((ids, space))
    _TILED_GROUPS[id(sketch)] = (sketch.state, groups)
    return groups


def _plausible_tiles(sketch: Sketch, steps: list, hw: HardwareParams) -> bool:
    """The thread-binding checks on the raw tile sizes (level 1 is the vthread, level 2 the thread
    level), so most invalid samples are dropped before the costly replay."""
    for ids, space in _tiled_groups(sketch):
        lengths = [steps[i].lengths for i in ids]
        if any(len(ln) < 2 for ln in lengths) or space <= hw.warp_size:
            continue
        vthread = threads = 1
        for ln in lengths:
            vthread *= ln[0]
            threads *= ln[1]
        if vthread > hw.max_vthread_extent or (hw.max_threads_per_block and threads > hw.max_threads_per_block):
            return False
        if space > 2 * hw.warp_size and threads < hw.warp_size:
            return False
    return True


def sample_gpu_state(sketch: Sketch, rng: random.Random, task: SearchTask,
                     params: SearchParams | None = None) -> State:
    """One random complete GPU program from a sketch: tile sizes, compute locations, thread binding,
    auto-unroll; raises InvalidSample when the result breaks the target's limits."""
    params = params or SearchParams()
    hw = task.hardware
    steps = fill_tile_sizes(sketch, rng, params.max_innermost_split_factor)
    if not _plausible_tiles(sketch, steps, hw):
        raise InvalidSample("tile sizes break the thread-binding limits")
    state = State.replay(sketch.state.dag, steps)
    if not params.disable_change_compute_location:
        state = _change_compute_location_gpu(state, rng)
    state = init_thread_bind(state, hw)
    state = init_unroll(state, rng)
    why = check_gpu_limits(state, hw)
    if why is not None:
        raise InvalidSample(why)
    return state


def _change_compute_location_gpu(state: State, rng: random.Random) -> State:
    """The CPU rule, but leaving shared-memory fetches and cross-thread reductions where the sketch
    put them (moving them breaks cooperative fetching and the block-level reduction)."""
    frozen = [(s.name, s.compute_at, s.attach) for i, s in enumerate(state.stages)
              if _is_shared_fetch(s) or (not s.is_placeholder and has_cross_thread_reduction(state, i))]
    moved = change_compute_location(state, rng)
    for name, at, attach in frozen:
        st = moved.stage_by_name(name)
        if (st.compute_at, st.attach) != (at, attach):
            return state
    return moved
