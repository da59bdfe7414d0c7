"""Queries and composite transforms the sketch, annotation and mutation rules share (TVM's
search_policy/utils): what a stage needs, where it may be computed, multi-level tiling itself."""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

from tensortune.schedule.stage import Stage
from tensortune.schedule.state import State
from tensortune.schedule.steps import SplitStep
from tensortune.tasks import te
from tensortune.tasks.search_task import SearchTask


def needs_multi_level_tiling(state: State, sid: int) -> bool:
    st = state.stages[sid]
    return not st.is_placeholder and state.analysis.needs_multi_level_tiling[st.op]


def is_output(state: State, sid: int) -> bool:
    return state.stages[sid].name in {t.name for t in state.dag.outputs}


def is_strictly_inlineable(state: State, sid: int) -> bool:
    st = state.stages[sid]
    return not st.is_placeholder and state.analysis.is_strictly_inlineable[st.op]


def has_reduce_iter(stage: Stage) -> bool:
    return any(it.kind != "spatial" for it in stage.iters)


def is_tiled(stage: Stage) -> bool:
    return len(stage.iters) != len(stage.op.axes) + len(stage.op.reduce_axes)


def attached_stages(state: State, sid: int, iter_id: int) -> list[int]:
    """Stage ids computed at iterator `iter_id` of stage `sid`."""
    name, var = state.stages[sid].name, state.stages[sid].iters[iter_id].var
    return [i for i, s in enumerate(state.stages) if s.compute_at == "iter" and s.attach is not None
            and s.attach[0] == name and s.attach[1] is var]


def has_attached(state: State, sid: int, iter_id: int) -> bool:
    return bool(attached_stages(state, sid, iter_id))


def attach_target(state: State, sid: int) -> tuple[int, int] | None:
    st = state.stages[sid]
    if st.compute_at != "iter" or st.attach is None:
        return None
    tid = state.stage_id(st.attach[0])
    return tid, state.stages[tid].iter_index(st.attach[1])


def consumer_ids(state: State, sid: int) -> list[int]:
    return sorted(state.stage_id(c.name) for c in state.consumers(sid))


def single_consumer_id(state: State, sid: int) -> int | None:
    """The only consumer, or the common root all consumers are computed in (TVM's GetSingleConsumerId)."""
    consumers = consumer_ids(state, sid)
    if not consumers:
        return None
    if len(consumers) == 1:
        return consumers[0]
    roots = set()
    for c in consumers:
        t = attach_target(state, c)
        roots.add(c if t is None else t[0])
    return roots.pop() if len(roots) == 1 else None


def elementwise_match(state: State, sid: int, target: int) -> bool:
    return state.analysis.elementwise_match(state.stages[sid].op, state.stages[target].op)


def single_elementwise_matched_consumer(state: State, sid: int) -> int | None:
    consumers = consumer_ids(state, sid)
    if len(consumers) != 1:
        return None
    target = consumers[0]
    if (elementwise_match(state, sid, target)
            and not (has_reduce_iter(state.stages[sid]) and has_reduce_iter(state.stages[target]))
            and not state.stages[target].name.endswith(".shared")):
        return target
    return None


def has_cache_write_stage(state: State, sid: int) -> bool:
    return state.stages[sid].origin == "cache_write"


def space_reduce_lengths(stage: Stage) -> tuple[int, int]:
    space = reduce = 1
    for it in stage.iters:
        if it.kind == "spatial":
            space *= it.known_extent
        else:
            reduce *= it.known_extent
    return space, reduce


def needs_rfactor(task: SearchTask, state: State, sid: int) -> bool:
    stage = state.stages[sid]
    if stage.is_placeholder:
        return False
    space, reduce = space_reduce_lengths(stage)
    if needs_multi_level_tiling(state, sid):
        return not (space > reduce or space > task.hardware.num_cores * 16)
    if reduce > 1:
        return reduce > task.hardware.num_cores
    return False


# ------------------------------------------------------------------------------------------ tiling

def reuse_outer_order(state: State, sid: int) -> list[int]:
    """The order of a stage's spatial axes (positions among them) in the outermost tile level: the
    axes that index the tensor it reads most bytes of, and no other tensor it reads, first.

    Why: the outermost level is the one loop nest every tile of the others runs inside. When it
    iterates the output channels of an NHWC conv last (its natural axis order), every tile of rows
    and columns sweeps the whole weight (2.4 MB for a 256-channel 3x3 conv, more than L2), so the
    weight streams from L3 once per tile; with the channel blocks outermost, one block of weights
    stays in L2 while the tiles of rows and columns run past it. Measured on a 256-channel 14x14
    conv (one thread, AVX-512): the same tiles ran at 133 GFLOP/s in axis order, 169 channel-first.
    Applies only where one tensor dominates (at least twice the bytes of each other one); equal
    operands (a square matmul) keep the axis order."""
    stage = state.stages[sid]
    spatial = [it for it in stage.iters if it.kind == "spatial"]
    reads = state.analysis.read_from.get(stage.op, {})
    if len(reads) < 2:
        return list(range(len(spatial)))
    size = {t: math.prod(t.shape) * te.DTYPE_BYTES[t.dtype] for t in reads}
    largest = max(reads, key=lambda t: size[t])
    if any(size[largest] < 2 * size[t] for t in reads if t is not largest):
        return list(range(len(spatial)))

    def indexing(t) -> set:
        return {v for idx in reads[t] for e in idx for v in te.free_vars(e)}

    own = indexing(largest) - set().union(*(indexing(t) for t in reads if t is not largest))
    first = [i for i, it in enumerate(spatial) if it.var in own]
    return first + [i for i in range(len(spatial)) if i not in first]


def do_multi_level_tiling(state: State, sid: int, structure: str,
                          outer_order: Sequence[int] | None = None) -> tuple[State, list[int]]:
    """Split every spatial axis into the 'S' levels and every reduce axis into the 'R' levels of
    `structure` (e.g. "SSRSRS"), then reorder level by level; the outermost level's spatial axes in
    `outer_order` (positions among them; None: their order). Returns the state and the ids of the
    spatial split steps (what a fused consumer follows)."""
    n_space = structure.upper().count("S")
    n_reduce = structure.upper().count("R")
    space_levels: list[list] = [[] for _ in range(n_space)]
    reduce_levels: list[list] = [[] for _ in range(n_reduce)]
    spatial_split_ids: list[int] = []
    s = state
    for it in list(state.stages[sid].iters):
        levels, n = (space_levels, n_space) if it.kind == "spatial" else (reduce_levels, n_reduce)
        if n == 1:
            levels[0].append(it.var)
            continue
        i = s.stages[sid].iter_index(it.var)
        s = SplitStep(sid, i, it.extent, (None,) * (n - 1), True).apply(s)
        pieces = s.stages[sid].iters[i:i + n]
        for lvl, p in enumerate(pieces):
            levels[lvl].append(p.var)
        if it.kind == "spatial":
            spatial_split_ids.append(len(s.steps) - 1)
    if outer_order is not None:
        space_levels[0] = [space_levels[0][i] for i in outer_order]
    order_vars = []
    sc = rc = 0
    for c in structure.upper():
        if c == "S":
            order_vars += space_levels[sc]
            sc += 1
        else:
            order_vars += reduce_levels[rc]
            rc += 1
    stage = s.stages[sid]
    s = s.reorder(sid, [stage.iter_index(v) for v in order_vars])
    return s, spatial_split_ids


def follow_tiling(state: State, sid: int, split_step_ids: list[int], n_split: int,
                  outer_order: Sequence[int] | None = None) -> State:
    """Tile the (elementwise) consumer like the producer's first `n_split` spatial levels, its
    outermost level in the producer's `outer_order` (see do_multi_level_tiling)."""
    s = state
    spaces: list[list] = [[] for _ in range(n_split + 1)]
    ct = 0
    for it in list(state.stages[sid].iters):
        if it.kind != "spatial":
            raise ValueError(f"follow_tiling: {state.stages[sid].name} has a reduce iterator {it.name}")
        i = s.stages[sid].iter_index(it.var)
        ann = it.annotation
        s = s.follow_split(sid, i, split_step_ids[ct], n_split)
        pieces = list(s.stages[sid].iters[i:i + n_split + 1])
        if ann == "unroll":
            s = s.unroll(sid, i + n_split)
        elif ann == "vectorize":
            s = s.vectorize(sid, i + n_split)
        elif ann == "parallel":
            s = s.parallel(sid, i)
        for lvl, p in enumerate(pieces):
            spaces[lvl].append(p.var)
        ct += 1
    if outer_order is not None:
        spaces[0] = [spaces[0][i] for i in outer_order]
    stage = s.stages[sid]
    return s.reorder(sid, [stage.iter_index(v) for lvl in spaces for v in lvl])


def fuse_all_reduction_iters(state: State, sid: int) -> tuple[State, int, int]:
    """Returns (state, id of the fused reduce iterator, number of spatial iterators)."""
    stage = state.stages[sid]
    red = [i for i, it in enumerate(stage.iters) if it.kind == "reduce"]
    n_space = sum(1 for it in stage.iters if it.kind == "spatial")
    if len(red) > 1:
        state = state.fuse(sid, red)
    return state, red[0], n_space


def fuse_all_outer_space_iters(state: State, sid: int) -> tuple[State, int]:
    stage = state.stages[sid]
    n = 0
    for i, it in enumerate(stage.iters):
        if it.kind == "reduce" or it.annotation != "none":
            break
        if i > 0 and has_attached(state, sid, i - 1):
            break
        n += 1
    if n > 1:
        state = state.fuse(sid, list(range(n)))
    return state, 0


def original_names(name: str) -> set[str]:
    """'i.0@j.1@' -> {'i', 'j'}: the axes an iterator came from (TVM's ExtractOriginalIterators)."""
    out, cur = set(), ""
    for ch in name + "@":
        if ch in "@.":
            if cur and not cur[0].isdigit():
                out.add(cur)
            cur = ""
        else:
            cur += ch
    return out


def last_reduce_iter_in_outermost_reduce_tile(stage: Stage) -> int:
    n_red = len(stage.op.reduce_axes)
    names: set[str] = set()
    for i, it in enumerate(stage.iters):
        if it.kind == "reduce":
            names |= original_names(it.name)
            if len(names) == n_red:
                return i
    return next(i for i, it in enumerate(stage.iters) if it.kind == "reduce")


def strided_operand_consumer(state: State, sid: int) -> int | None:
    """The multi-level tiled consumer that walks this operand across rows, if any: it reads the operand's
    last dimension with its own innermost spatial axis and a reduction axis indexes an earlier dimension
    (B in C[i, j] += A[i, k] * B[k, j]). Its reduce loop then touches one cache line per row, all a row
    stride apart, and a power-of-two stride maps them onto a few cache sets; a packed copy per reduce
    tile (what BLAS libraries do) makes those rows contiguous."""
    from tensortune.tasks import te
    consumers = consumer_ids(state, sid)
    if len(consumers) != 1 or state.stages[sid].compute_at == "inline":
        return None
    target = consumers[0]
    tstage = state.stages[target]
    if not needs_multi_level_tiling(state, target) or not is_tiled(tstage) or not tstage.op.axes:
        return None
    inner, reduce = tstage.op.axes[-1], set(tstage.op.reduce_axes)
    body = state.effective_bodies()[tstage.name]
    loads = [n for n in te.walk(body) if isinstance(n, te.Load) and n.tensor.name == state.stages[sid].name]
    if not loads:
        return None
    for load in loads:
        last = te.free_vars(load.indices[-1])
        earlier = set().union(*(te.free_vars(i) for i in load.indices[:-1])) if len(load.indices) > 1 else set()
        if inner not in last or last & reduce or not earlier & reduce:
            return None
    return target


def compute_location_candidates(state: State, sid: int) -> list[tuple[int, int]]:
    """(stage, iterator) pairs where stage `sid` may be computed (TVM's GetComputeLocationCandidates)."""
    target = single_consumer_id(state, sid)
    if target is None:
        return []
    tstage = state.stages[target]
    out = []
    target_attached = tstage.compute_at == "iter"
    tiled = is_tiled(tstage)
    visited_reduce = False
    for i, it in enumerate(tstage.iters):
        if it.kind == "reduce":
            visited_reduce = True
            if not tiled:
                break
        elif visited_reduce:
            break
        if it.annotation == "unroll":
            break
        if it.extent == 1:
            continue
        if target_attached and it.kind == "spatial" and it.name.endswith(".0"):
            continue
        out.append((target, i))
        if has_attached(state, target, i):
            break
    at = attach_target(state, target)
    if target_attached and at is not None:
        tt = at[0]
        for i, it in enumerate(state.stages[tt].iters):
            if it.kind == "reduce" or has_attached(state, tt, i) or it.annotation == "unroll":
                break
            if it.extent == 1:
                continue
            out.append((tt, i))
    return out


def stage_read_outside_its_loop(state: State) -> str | None:
    """A stage computed inside a loop that one of its consumers reads outside of, or None.

    Each compute-at step is legal where it stands, but crossover and compute-location mutation can
    put a producer inside one consumer's loop while another consumer stays outside it (softmax's max
    inside the normalisation, its exp-sum at root): such a program cannot be lowered."""
    for sid, st in enumerate(state.stages):
        if st.compute_at == "iter" and not all(state.computed_within(c.name, st.name)
                                               for c in state.consumers(sid)):
            return st.name
    return None


def has_nested_parallel(state: State) -> bool:
    attached: dict[tuple[str, int], list[int]] = {}      # (stage, id of its loop variable) -> stages in it
    for i, s in enumerate(state.stages):
        if s.compute_at == "iter" and s.attach is not None:
            attached.setdefault((s.attach[0], id(s.attach[1])), []).append(i)
    return any(_parallel_loops(state, i, attached) >= 2 for i, s in enumerate(state.stages)
               if s.compute_at == "root" and not s.is_placeholder)


def _parallel_loops(state: State, sid: int, attached: dict[tuple[str, int], list[int]]) -> int:
    """Parallel loops in a stage and the stages computed inside it (`attached`: the stages computed at
    each loop, found once per state; asking `attached_stages` per loop scanned every stage each time)."""
    st = state.stages[sid]
    if st.compute_at == "inline":
        return 0
    n = 0
    for it in st.iters:
        n += it.annotation == "parallel"
        n += sum(_parallel_loops(state, a, attached) for a in attached.get((st.name, id(it.var)), ()))
    return n


# ------------------------------------------------------------------------------------------ tile sizes

@lru_cache(maxsize=None)
def factors(n: int) -> tuple[int, ...]:
    out: set[int] = set()
    for i in range(1, math.isqrt(n) + 1):
        if n % i == 0:
            out.update((i, n // i))
    return tuple(sorted(out))


@lru_cache(maxsize=4096)
def factorization_schemes(extent: int, n_lengths: int, max_innermost: int) -> tuple[tuple[int, ...], ...]:
    """Every way to write `extent` = outer * l0 * ... * l_{n-1} with l_{n-1} <= max_innermost
    (TVM's SplitFactorizationMemo); each scheme lists (l0 .. l_{n-1})."""
    out: list[tuple[int, ...]] = []

    def dfs(prefix: tuple[int, ...], remaining: int) -> None:
        if len(prefix) == n_lengths:
            if prefix[-1] <= max_innermost:
                out.append(prefix)
            return
        for f in factors(remaining):
            dfs(prefix + (f,), remaining // f)

    dfs((), extent)
    return tuple(out)
