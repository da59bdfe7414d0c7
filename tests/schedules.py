"""Hand-made non-trivial schedules for any DAG, so every op is tested beyond its naive loop nest.

`tiled_schedule` exercises most steps: compute_inline, cache_write, split (perfect and imperfect),
follow_split, reorder, fuse, parallel, vectorize, unroll, the auto-unroll pragma, compute_at (with
bound inference over overlapping windows) and rfactor.
"""
from __future__ import annotations

from tensortune.schedule.state import State
from tensortune.tasks.compute_dag import ComputeDAG


def _tile(extent: int, want: int) -> int:
    return max(1, min(extent, want))


def tiled_schedule(dag: ComputeDAG, tile: int = 4, vec: int = 8, parallel: bool = True, vectorize: bool = True,
                   cache: bool = True, inline: bool = True, rfactor: bool = True, attach_pad: bool = True) -> State:
    s = State(dag)
    an = dag.analysis
    outputs = {t.name for t in dag.outputs}
    if inline:
        for t in dag.tensors:
            if an.is_strictly_inlineable.get(t) and t.name not in outputs and not t.is_placeholder:
                s = s.compute_inline(t.name)
    for t in reversed(dag.tensors):
        if t.is_placeholder or s.stage_by_name(t.name).compute_at == "inline":
            continue
        name = t.name
        n_sp, n_red = len(t.axes), len(t.reduce_axes)
        if an.needs_multi_level_tiling[t] and cache:
            s = _multi_level_tile(s, name, n_sp, n_red, tile, vec, parallel, vectorize)
        elif n_red and rfactor and _prod(t.shape) < _prod(a.extent for a in t.reduce_axes):
            s = _rfactor(s, name, n_sp, n_red, tile)
        else:
            s = _elementwise(s, name, n_sp, n_red, vec, parallel, vectorize)
    if attach_pad:
        for t in dag.tensors:
            st = s.stage_by_name(t.name)
            if t.is_placeholder or st.compute_at != "root" or t.name in outputs:
                continue
            consumers = s.consumers(s.stage_id(t.name))
            if len(consumers) == 1 and not t.reduce_axes:
                c = consumers[0]
                # inside the consumer's first reduce loop when it has one, else its outermost loop
                red = [i for i, it in enumerate(c.iters) if it.kind == "reduce"]
                s = s.compute_at(t.name, c.name, red[0] if red else 0)
    return s


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _multi_level_tile(s: State, name: str, n_sp: int, n_red: int, tile: int, vec: int, parallel: bool,
                      vectorize: bool) -> State:
    s = s.cache_write(name, "local")
    local = name + ".local"
    split_steps = []
    for i in range(n_sp):
        it = s.stage_by_name(local).iters[2 * i]
        split_steps.append(len(s.steps))
        want = vec if i == n_sp - 1 else tile
        s = s.split(local, 2 * i, [_tile(it.extent, want)])
    for j in range(n_red):
        it = s.stage_by_name(local).iters[2 * n_sp + 2 * j]
        s = s.split(local, 2 * n_sp + 2 * j, [_tile(it.extent, 3)])
    order = [2 * i for i in range(n_sp)] + [2 * n_sp + 2 * j for j in range(n_red)] + \
            [2 * n_sp + 2 * j + 1 for j in range(n_red)] + [2 * i + 1 for i in range(n_sp)]
    s = s.reorder(local, order)
    n = len(order)
    if vectorize:
        s = s.vectorize(local, n - 1)
    if n_sp >= 2:
        s = s.unroll(local, n - 2)
    s = s.pragma(local, 0, "auto_unroll_max_step$16")
    # the output stage follows the local stage's spatial tiling
    for i in range(n_sp):
        s = s.follow_split(name, 2 * i, split_steps[i], 1)
    s = s.reorder(name, [2 * i for i in range(n_sp)] + [2 * i + 1 for i in range(n_sp)])
    if n_sp > 1:
        s = s.fuse(name, list(range(n_sp)))
    if parallel:
        s = s.parallel(name, 0)
    if vectorize:
        s = s.vectorize(name, len(s.stage_by_name(name).iters) - 1)
    return s.compute_at(local, name, 0)


def _rfactor(s: State, name: str, n_sp: int, n_red: int, tile: int) -> State:
    if n_red > 1:
        s = s.fuse(name, list(range(n_sp, n_sp + n_red)))
    red = s.stage_by_name(name).iters[n_sp]
    s = s.split(name, n_sp, [_tile(red.extent, tile * 2)])
    s = s.rfactor(name, n_sp + 1, n_sp)
    rf = name + ".rf"
    s = s.vectorize(rf, n_sp) if n_sp < len(s.stage_by_name(rf).iters) - 1 else s
    return s


def _elementwise(s: State, name: str, n_sp: int, n_red: int, vec: int, parallel: bool, vectorize: bool) -> State:
    last = s.stage_by_name(name).iters[n_sp - 1]
    s = s.split(name, n_sp - 1, [_tile(last.extent, vec)])
    # iters: sp_0 .. sp_{n-2}, last.0, last.1, red...
    if n_red:
        order = list(range(n_sp)) + list(range(n_sp + 1, n_sp + 1 + n_red)) + [n_sp]
        s = s.reorder(name, order)
        if vectorize:
            s = s.vectorize(name, len(order) - 1)
    elif vectorize:
        s = s.vectorize(name, n_sp)
    if n_sp > 1:
        s = s.fuse(name, list(range(n_sp)))
    if parallel:
        s = s.parallel(name, 0)
    return s
