"""Sketch generation by derivation rules (Ansor Table 1).

Starting from the naive state at the last stage, each rule may apply to the current stage; a rule
returns (new state, next stage id) pairs, so one state can fork into several sketches. Rules are
objects with `meet_condition` and `apply`; the rule list is per target kind and users can register
their own (`register_sketch_rule`), which run before the built-in ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from tensortune.schedule.state import State
from tensortune.schedule.steps import RfactorStep, SplitStep
from tensortune.search import utils
from tensortune.search.params import SearchParams
from tensortune.tasks.search_task import SearchTask
from tensortune.tasks.te import DTYPE_BYTES


class Condition(Enum):
    PASS = 0                  # does not apply; try the next rule
    APPLY = 1                 # apply, and also try the following rules
    APPLY_AND_SKIP_REST = 2   # apply, and stop here


@dataclass
class SketchContext:
    """What rules may look at besides the state: the task and the policy parameters."""
    task: SearchTask
    params: SearchParams = field(default_factory=SearchParams)

    @property
    def is_gpu(self) -> bool:
        return self.task.target_kind == "cuda"

    def structure(self) -> str:
        p = self.params
        return p.gpu_multi_level_tiling_structure if self.is_gpu else p.cpu_multi_level_tiling_structure


class SketchRule:
    name = "rule"

    def meet_condition(self, ctx: SketchContext, state: State, sid: int) -> Condition:
        raise NotImplementedError

    def apply(self, ctx: SketchContext, state: State, sid: int) -> list[tuple[State, int]]:
        raise NotImplementedError


def should_always_inline(ctx: SketchContext, state: State, sid: int) -> bool:
    stage = state.stages[sid]
    if stage.is_placeholder or utils.is_output(state, sid) or utils.has_reduce_iter(stage):
        return False
    if ctx.is_gpu:
        return True
    return utils.is_strictly_inlineable(state, sid)


class SkipStage(SketchRule):
    name = "skip"

    def meet_condition(self, ctx, state, sid):
        return Condition.APPLY

    def apply(self, ctx, state, sid):
        return [(state, sid - 1)]


class AlwaysInline(SketchRule):
    name = "always_inline"

    def meet_condition(self, ctx, state, sid):
        return Condition.APPLY_AND_SKIP_REST if should_always_inline(ctx, state, sid) else Condition.PASS

    def apply(self, ctx, state, sid):
        return [(state.compute_inline(sid), sid - 1)]


class MultiLevelTiling(SketchRule):
    name = "multi_level_tiling"

    def meet_condition(self, ctx, state, sid):
        return Condition.APPLY_AND_SKIP_REST if utils.needs_multi_level_tiling(state, sid) else Condition.PASS

    def apply(self, ctx, state, sid):
        s, _ = utils.do_multi_level_tiling(state, sid, ctx.structure(), _outer_order(ctx, state, sid))
        return [(s, sid - 1)]


def _outer_order(ctx: SketchContext, state: State, sid: int) -> list[int] | None:
    """CPU: the reuse order of the outermost tile level (utils.reuse_outer_order). GPU: the axis order
    (its outermost level becomes the grid, where the order does not decide what stays cached)."""
    return None if ctx.is_gpu else utils.reuse_outer_order(state, sid)


class MultiLevelTilingWithFusion(SketchRule):
    """Tile a stage and compute it inside its single elementwise consumer at level 1 or 2 (GPU: 3)."""
    name = "multi_level_tiling_with_fusion"

    def meet_condition(self, ctx, state, sid):
        if utils.needs_multi_level_tiling(state, sid) and \
                utils.single_elementwise_matched_consumer(state, sid) is not None:
            if utils.has_cache_write_stage(state, sid) or ctx.is_gpu:
                return Condition.APPLY_AND_SKIP_REST
            return Condition.APPLY
        return Condition.PASS

    def apply(self, ctx, state, sid):
        target = utils.single_elementwise_matched_consumer(state, sid)
        structure = ctx.structure()
        order = _outer_order(ctx, state, sid)
        base, split_ids = utils.do_multi_level_tiling(state, sid, structure, order)
        out = []
        for level in ([3] if ctx.is_gpu else [1, 2]):
            if structure[level - 1].upper() != "S":
                continue
            s = utils.follow_tiling(base, target, split_ids, level, order)
            s = s.compute_at(sid, target, level * len(split_ids) - 1)
            out.append((s, sid - 1))
        return out


class AddCacheWrite(SketchRule):
    """Accumulate in a local buffer when there is no elementwise consumer to fuse into."""
    name = "add_cache_write"

    def meet_condition(self, ctx, state, sid):
        if utils.needs_multi_level_tiling(state, sid) and \
                utils.single_elementwise_matched_consumer(state, sid) is None:
            return Condition.APPLY_AND_SKIP_REST if ctx.is_gpu else Condition.APPLY
        return Condition.PASS

    def apply(self, ctx, state, sid):
        return [(state.cache_write(sid, "local"), sid)]


class SimplifyComputeWithConstTensor(SketchRule):
    """A stage indexed into constant transform matrices (Winograd's data_pack and inverse carry
    `simplify_const_tensor_indices`): unroll those axes innermost so every select on them folds to one
    branch, and tile the other spatial axes in two levels (Ansor's RuleSimplifyComputeWithConstTensor).
    **(changed)** A second sketch keeps the last spatial axis's inner tile inside the unrolled axes,
    so annotation can vectorise it (TVM's form leaves an unrolled loop innermost: never vectorised).

    **GPU (changed).** TVM writes these stages as reductions, so on a GPU each becomes a kernel of its
    own (one thread per tile, the unrolled transform inside) and is never inlined. Ours are not
    reductions, and AlwaysInline would fold them into their readers: data_pack into bgemm's
    shared-memory fetch (each block transforming the tiles it reads, again for every block of output
    channels), inverse into the output. Both are worth having, and which wins depends on the layer,
    so on a GPU this rule forks: its own kernel here (the other axes stay whole; thread binding fuses
    them anyway), inlined by the rules after it."""
    name = "simplify_compute_with_const_tensor"

    def meet_condition(self, ctx, state, sid):
        st = state.stages[sid]
        if st.is_placeholder or st.compute_at == "inline" or not const_tensor_axes(st.op.attrs):
            return Condition.PASS
        if ctx.is_gpu and should_always_inline(ctx, state, sid):
            return Condition.APPLY
        return Condition.APPLY_AND_SKIP_REST

    def apply(self, ctx, state, sid):
        const = const_tensor_axes(state.stages[sid].op.attrs)
        if ctx.is_gpu:
            iters = state.stages[sid].iters
            order = [i for i, it in enumerate(iters) if it.name not in const]
            s = state.reorder(sid, order + [i for i, it in enumerate(iters) if it.name in const])
            for i in range(len(order), len(iters)):
                s = s.unroll(sid, i)
            return [(s, sid - 1)]
        s = state
        unrolled, tiled = [], []
        for it in list(state.stages[sid].iters):
            i = s.stages[sid].iter_index(it.var)
            if it.name in const:
                s = s.unroll(sid, i)
                unrolled.append(s.stages[sid].iters[i].var)
            else:
                s = SplitStep(sid, i, it.extent, (None,), True).apply(s)
                tiled.append((s.stages[sid].iters[i].var, s.stages[sid].iters[i + 1].var))
        if not tiled:
            return [(s, sid - 1)]
        outer, inner = [o for o, _ in tiled], [n for _, n in tiled]
        out = []
        for order in (outer + inner + unrolled, outer + inner[:-1] + unrolled + inner[-1:]):
            stage = s.stages[sid]
            out.append((s.reorder(sid, [stage.iter_index(v) for v in order]), sid - 1))
        return out


def const_tensor_axes(attrs: dict) -> set[str]:
    """The axes a compute names in `simplify_const_tensor_indices` (a comma-separated string)."""
    return {n for n in str(attrs.get("simplify_const_tensor_indices", "")).split(",") if n}


class AddRfactor(SketchRule):
    """Factor a reduction that has too little spatial parallelism (two sketches: factor ko or ki)."""
    name = "add_rfactor"

    def meet_condition(self, ctx, state, sid):
        if utils.needs_rfactor(ctx.task, state, sid) and not utils.has_cache_write_stage(state, sid):
            return Condition.APPLY
        return Condition.PASS

    def apply(self, ctx, state, sid):
        base, red_id, n_space = utils.fuse_all_reduction_iters(state, sid)
        base = base.split(sid, red_id, [1])
        out = []
        for which in (red_id, red_id + 1):
            s = base.rfactor(sid, which, n_space)
            if which == red_id + 1:
                # the factored axis innermost, for vectorization
                n = len(s.stages[sid].iters)
                s = s.reorder(sid, [i for i in range(n) if i != n_space] + [n_space])
            out.append((s, sid - 1))
        return out


class AddCacheRead(SketchRule):
    """GPU: stage a producer of a tiled consumer in shared memory at the outermost reduce tile."""
    name = "add_cache_read"

    def meet_condition(self, ctx, state, sid):
        consumers = utils.consumer_ids(state, sid)
        if not consumers:
            return Condition.PASS
        target = consumers[0]
        if not utils.needs_multi_level_tiling(state, target):
            return Condition.PASS
        if has_cross_thread_reduction(state, target):
            return Condition.PASS
        if state.stages[sid].name not in {p.name for p in state.analysis.producers(state.stages[target].op)}:
            return Condition.PASS
        return Condition.APPLY_AND_SKIP_REST

    def apply(self, ctx, state, sid):
        s = state
        for orig_target in utils.consumer_ids(state, sid):
            target_name = state.stages[orig_target].name
            s = s.cache_read(sid, "shared", [target_name])
            added = sid + 1
            target = s.stage_id(target_name)
            pos = utils.last_reduce_iter_in_outermost_reduce_tile(s.stages[target])
            s = s.compute_at(added, target, pos)
        return [(s, sid)]


class AddCacheReadPack(SketchRule):
    """CPU: pack an operand that the tiled consumer walks across rows into a local buffer at the
    consumer's outermost reduce tile (not in Ansor: BLAS-style packing; see utils.strided_operand_consumer).
    The unpacked sketch is kept too, so the search decides. A constant weight the task rewrites
    (`SearchTask.layout_rewrite`) is stored in its tiled read order when the network is built, packed
    once instead of on every call, so it gets no packing stage."""
    name = "add_cache_read_pack"

    def meet_condition(self, ctx, state, sid):
        if ctx.is_gpu or ctx.params.disable_cpu_packing or state.stages[sid].name in ctx.task.layout_rewrite:
            return Condition.PASS
        return Condition.PASS if utils.strided_operand_consumer(state, sid) is None else Condition.APPLY

    def apply(self, ctx, state, sid):
        target = state.stages[utils.strided_operand_consumer(state, sid)].name
        s = state.cache_read(sid, "local", [target])
        tid = s.stage_id(target)
        return [(s.compute_at(sid + 1, tid, utils.last_reduce_iter_in_outermost_reduce_tile(s.stages[tid])), sid)]


def has_cross_thread_reduction(state: State, sid: int) -> bool:
    def check(stage) -> bool:
        return any(it.annotation == "threadIdx.x" and it.kind == "reduce" for it in stage.iters)
    if check(state.stages[sid]):
        return True
    return any(check(state.stages[a]) for i in range(len(state.stages[sid].iters))
               for a in utils.attached_stages(state, sid, i))


class CrossThreadReduction(SketchRule):
    """GPU: bind a long reduction to threadIdx.x (a warp-level reduction)."""
    name = "cross_thread_reduction"

    def meet_condition(self, ctx, state, sid):
        if utils.has_cache_write_stage(state, sid) or state.stages[sid].is_placeholder:
            return Condition.PASS
        space, reduce = utils.space_reduce_lengths(state.stages[sid])
        hw = ctx.task.hardware
        if utils.needs_multi_level_tiling(state, sid):
            if space > hw.max_threads_per_block:
                return Condition.PASS
            return Condition.APPLY if space < reduce else Condition.PASS
        if reduce > 1:
            return Condition.APPLY if reduce > hw.warp_size else Condition.PASS
        return Condition.PASS

    def apply(self, ctx, state, sid):
        warp = ctx.task.hardware.warp_size
        s, red_id, _ = utils.fuse_all_reduction_iters(state, sid)
        target = utils.single_consumer_id(s, sid)
        fusible, n_common = False, -1
        if target is not None:
            n_common = s.analysis.num_common_outer_iterators(s.stages[sid].op, s.stages[target].op)
            fusible = n_common > 0 and not utils.needs_multi_level_tiling(state, target)
            # the consumer gets split by the warp size below: it must be at least that long
            fusible = fusible and (any(isinstance(st, SplitStep) and st.stage_id == target for st in s.steps)
                                   or (s.stages[target].iters[-1].extent or 0) >= warp)
        if fusible:
            split_ids = [i for i, st in enumerate(s.steps) if isinstance(st, SplitStep) and st.stage_id == target]
            if not split_ids:
                last = len(s.stages[target].iters) - 1
                s = s.split(target, last, [warp]).bind(target, last + 1, "threadIdx.x")
                split_ids = [len(s.steps) - 2]
            red_id = next(i for i, it in enumerate(s.stages[sid].iters) if it.kind == "reduce")
            s = s.follow_split(sid, red_id, split_ids[0], 1)
            s = s.bind(sid, red_id + 1, "threadIdx.x")
            s = s.compute_at(sid, target, n_common - 1)
        else:
            s = s.split(sid, red_id, [warp]).bind(sid, red_id + 1, "threadIdx.x")
        return [(s, sid - 1)]


class SpecialComputeLocationGPU(SketchRule):
    """GPU: compute an always-inlined stage before its consumer's unrolled const-tensor loops."""
    name = "special_compute_location_gpu"

    def meet_condition(self, ctx, state, sid):
        if not state.producers(sid) or not should_always_inline(ctx, state, sid):
            return Condition.PASS
        consumers = utils.consumer_ids(state, sid)
        if len(consumers) == 1 and state.stages[consumers[0]].op.attrs.get("simplify_const_tensor_indices"):
            return Condition.APPLY_AND_SKIP_REST
        return Condition.PASS

    def apply(self, ctx, state, sid):
        target = utils.consumer_ids(state, sid)[0]
        for i, it in enumerate(state.stages[target].iters):
            if it.annotation == "unroll":
                return [(state.compute_at(sid, target, i - 1), sid - 1)]
        return [(state, sid - 1)]


class CustomRule(SketchRule):
    """A user rule from two callables: meet_condition(ctx, state, sid) -> Condition and
    apply(ctx, state, sid) -> [(state, next_sid)]."""

    def __init__(self, name: str, meet: Callable, fn: Callable):
        self.name, self.meet, self.fn = name, meet, fn

    def meet_condition(self, ctx, state, sid):
        return self.meet(ctx, state, sid)

    def apply(self, ctx, state, sid):
        return self.fn(ctx, state, sid)


_CUSTOM_RULES: dict[str, list[SketchRule]] = {"llvm": [], "cuda": []}


def register_sketch_rule(rule: SketchRule, target_kind: str = "llvm") -> None:
    """Add a user rule; it runs before the built-in rules for that target kind."""
    _CUSTOM_RULES.setdefault(target_kind, []).append(rule)


def default_rules(target_kind: str) -> list[SketchRule]:
    custom = list(_CUSTOM_RULES.get(target_kind, []))
    if target_kind == "cuda":
        return custom + [AddCacheRead(), SpecialComputeLocationGPU(), SimplifyComputeWithConstTensor(),
                         AlwaysInline(), CrossThreadReduction(),
                         AddCacheWrite(), MultiLevelTilingWithFusion(), MultiLevelTiling(), SkipStage()]
    return custom + [AlwaysInline(), SimplifyComputeWithConstTensor(), AddRfactor(), AddCacheWrite(),
                     MultiLevelTilingWithFusion(), MultiLevelTiling(), AddCacheReadPack(), SkipStage()]


@dataclass
class Sketch:
    """A state whose tile sizes are still open. `tunable` lists the split steps to sample;
    `vector_lanes` maps those that split a stage's innermost output axis (the one its output is
    contiguous in, and which multi-level tiling leaves innermost) to the vector lanes of its dtype:
    a tile there that fills whole vectors is what annotation can vectorise (CPU only).
    `register_tiles` groups, per reduction stage, the tunable splits of its spatial axes: their
    innermost lengths multiply to the block of accumulators the reduction keeps in registers, and
    `vector_registers` is how many vector registers the target has to hold them (CPU only)."""
    state: State
    tunable: tuple[int, ...]
    vector_lanes: dict[int, int] = field(default_factory=dict)
    register_tiles: tuple[tuple[int, ...], ...] = ()
    vector_registers: int = 0


def vector_registers(vector_unit_bytes: int) -> int:
    """Vector registers of an x86 core by its vector width: 32 zmm with AVX-512, else 16 (ymm, xmm)."""
    return 32 if vector_unit_bytes >= 64 else 16


# A reduction at least this long (the product of its reduce extents) keeps its accumulators in registers
# long enough for their count to matter (Sketch.register_tiles). A depthwise conv sums 9 products per
# output: loads, not FMA chains, bound it, and 96 programs drawn to fit the registers had a top tenth of
# 115 GFLOP/s against 137 drawn freely (a 3x3 conv over 64 or 512 channels, 576-4608 terms: 246 against
# 182, 179 against 163; Zen 5).
REGISTER_TILE_MIN_REDUCTION = 64


def split_roles(state: State, tunable: tuple[int, ...],
                vector_unit_bytes: int) -> tuple[dict[int, int], tuple[tuple[int, ...], ...]]:
    """What each tunable split of `state` tiles, from one replay of its steps: the splits on a stage's
    last spatial axis -> the vector lanes of that stage's dtype (Sketch.vector_lanes), and per stage
    with a tunable reduce split, a reduction of at least REGISTER_TILE_MIN_REDUCTION terms and a split of
    its vectorised axis, its tunable spatial splits (Sketch.register_tiles)."""
    lanes = {}
    spatial: dict[int, list[int]] = {}
    reduces: set[int] = set()
    before = State(state.dag)                  # the state each step applies to, replayed once
    for i, step in enumerate(state.steps[:max(tunable, default=-1) + 1]):
        if i in tunable:
            assert isinstance(step, SplitStep)
            stage = before.stages[step.stage_id]
            it = stage.iters[step.iter_id]
            if stage.op.axes and it.var is stage.op.axes[-1]:
                lanes[i] = max(1, vector_unit_bytes // DTYPE_BYTES[stage.op.dtype])
            if it.kind != "reduce":
                spatial.setdefault(step.stage_id, []).append(i)
            elif math.prod(a.extent for a in stage.op.reduce_axes) >= REGISTER_TILE_MIN_REDUCTION:
                reduces.add(step.stage_id)
        before = step.apply(before)
    # a block is counted in vectors along the vectorised axis: a stage without that split has none
    return lanes, tuple(tuple(splits) for sid, splits in spatial.items()
                        if sid in reduces and any(i in lanes for i in splits))


def generate_sketches(ctx: SketchContext, rules: list[SketchRule] | None = None) -> list[Sketch]:
    rules = rules if rules is not None else default_rules(ctx.task.target_kind)
    init = State(ctx.task.dag)
    frontier = [(init, len(init.stages) - 1)]
    done: list[State] = []
    while frontier:
        nxt = []
        for state, sid in frontier:
            if sid < 0:
                done.append(state)
                continue
            for rule in rules:
                cond = rule.meet_condition(ctx, state, sid)
                if cond == Condition.PASS:
                    continue
                nxt.extend(rule.apply(ctx, state, sid))
                if cond == Condition.APPLY_AND_SKIP_REST:
                    break
        frontier = nxt
    out = []
    for s in done:
        tunable = [i for i, st in enumerate(s.steps) if isinstance(st, SplitStep) and None in st.lengths]
        # the split before an rfactor carries a placeholder length of 1: sample it too (as TVM does)
        tunable += [i - 1 for i, st in enumerate(s.steps) if isinstance(st, RfactorStep)]
        if ctx.is_gpu:
            out.append(Sketch(s, tuple(sorted(tunable))))
            continue
        vector_bytes = ctx.task.hardware.vector_unit_bytes
        lanes, register_tiles = split_roles(s, tuple(tunable), vector_bytes)
        out.append(Sketch(s, tuple(sorted(tunable)), lanes, register_tiles, vector_registers(vector_bytes)))
    return out
