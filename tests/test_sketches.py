"""Sketch generation: the structures the Ansor paper describes, and user rules."""
from __future__ import annotations

import pytest

from tensortune.codegen.target import make_task
from tensortune.schedule.state import State
from tensortune.schedule.steps import CacheWriteStep, ComputeAtStep, ComputeInlineStep, RfactorStep, SplitStep
from tensortune.search.params import SearchParams
from tensortune.search.sketch_rules import Condition, CustomRule, SketchContext, generate_sketches, register_sketch_rule
from tensortune.tasks.workload_registry import make_dag


def _sketches(name, *args):
    task = make_task(make_dag(name, *args))
    return task, generate_sketches(SketchContext(task))


def _codes(sketch) -> list[str]:
    return [s.code for s in sketch.state.steps]


def _unpacked(sketches):
    return [s for s in sketches if "CHR" not in _codes(s)]


def test_matmul_has_plain_and_cache_write_fused_sketches():
    _, sk = _sketches("matmul", 512, 512, 512)
    assert len(sk) == 6                                                # each with and without packing B
    sk = _unpacked(sk)
    assert len(sk) == 3
    plain = [s for s in sk if "CHW" not in _codes(s)]
    cached = [s for s in sk if "CHW" in _codes(s)]
    assert len(plain) == 1 and len(cached) == 2
    # SSRSRS: i and j split into 4 levels, k into 2, ordered S S R S R S
    c = plain[0].state.stage_by_name("C")
    assert [it.name for it in c.iters] == ["i.0", "j.0", "i.1", "j.1", "k.0", "i.2", "j.2", "k.1", "i.3", "j.3"]
    # the cache-write sketches compute C.local at the consumer's 1st or 2nd tile level
    levels = sorted(next(st for st in s.state.steps if isinstance(st, ComputeAtStep)).target_iter_id for s in cached)
    assert levels == [1, 3]
    for s in sk:
        assert all(None in st.lengths for i, st in enumerate(s.state.steps) if i in s.tunable)


def test_matmul_bias_relu_fuses_the_elementwise_tail():
    task, sk = _sketches("matmul_bias_relu", 256, 256, 256)
    assert len(sk) == 6
    sk = _unpacked(sk)
    assert len(sk) == 3
    for s in sk:
        st = s.state
        assert st.stage_by_name("T_add").compute_at == "inline"        # bias add is always inlined
        assert "CHW" not in _codes(s)                                  # the relu stage plays the cache
    fused = [s for s in sk if any(isinstance(x, ComputeAtStep) for x in s.state.steps)]
    assert len(fused) == 2
    assert all(s.state.stage_by_name("C").attach[0] == "T_relu" for s in fused)


def test_conv2d_relu_tiles_the_conv_and_leaves_padding_to_annotation():
    _, sk = _sketches("conv2d_relu", 1, 56, 56, 64, 64, 3, 3, 1, 1)
    assert len(sk) == 3
    for s in sk:
        conv = s.state.stage_by_name("conv2d_nchw")
        assert len(conv.iters) == 4 * 4 + 3 * 2                        # 4 spatial axes x 4, 3 reduce x 2
        assert s.state.stage_by_name("pad_temp").compute_at == "root"   # has a branch: not always-inlined


def test_cpu_packs_the_operand_the_reduction_walks_across_rows():
    """B[k, j] of matmul is packed per reduce tile of the tiled stage; A[i, k] is read along k and is not."""
    _, sk = _sketches("matmul", 512, 512, 512)
    packed = [s for s in sk if "CHR" in _codes(s)]
    assert len(packed) == 3
    for s in packed:
        st = s.state
        pack = st.stage_by_name("B.local")
        tiled = st.stage_by_name(pack.attach[0])
        assert pack.scope == "local" and tiled.op.reduce_axes
        assert tiled.iters[tiled.iter_index(pack.attach[1])].name == "k.0"     # the outermost reduce tile
        assert "A.local" not in [x.name for x in st.stages]
    # dense reads its weight W[j, k] along k, conv2d NCHW reads both operands with a reduce axis innermost
    for name, args in (("dense", (1, 512, 1000)), ("conv2d_relu", (1, 56, 56, 64, 64, 3, 3, 1, 1))):
        assert all("CHR" not in _codes(s) for s in _sketches(name, *args)[1])
    # NHWC conv reads kernel[ry, rx, rc, ff] along ff, the output's innermost axis
    _, sk = _sketches("conv2d", 1, 14, 14, 64, 64, 3, 3, 1, 1, 1, "NHWC")
    assert sum("kernel.local" in [x.name for x in s.state.stages] for s in sk) == 3


def test_cpu_packing_can_be_switched_off():
    task, packed = _sketches("matmul", 512, 512, 512)
    plain = generate_sketches(SketchContext(task, SearchParams(disable_cpu_packing=True)))
    assert [_codes(s) for s in plain] == [_codes(s) for s in _unpacked(packed)] and len(plain) == 3


def test_norm_gets_rfactor_sketches():
    _, sk = _sketches("norm", 1, 256, 256)
    rf = [s for s in sk if any(isinstance(x, RfactorStep) for x in s.state.steps)]
    assert len(rf) == 2                                                 # factor the outer or the inner part
    for s in rf:
        names = [st.name for st in s.state.stages]
        assert "T_sum_sq.rf" in names
        i = next(k for k, x in enumerate(s.state.steps) if isinstance(x, RfactorStep))
        assert i - 1 in s.tunable and isinstance(s.state.steps[i - 1], SplitStep)


def test_softmax_sketches_rfactor_its_reductions_and_stay_few():
    _, sk = _sketches("softmax", 4, 1024)
    assert 1 < len(sk) < 10
    assert any(any(isinstance(x, RfactorStep) for x in s.state.steps) for s in sk)


def test_gpu_winograd_transforms_are_kernels_of_their_own_or_folded_into_their_readers():
    """On a GPU, data_pack and inverse each fork: a kernel of its own (TVM's form: at the root, the
    transform's constant axes unrolled innermost, data_pad computed per tile just outside them) or
    inlined into its reader (data_pack into bgemm's shared-memory fetch, inverse into the output)."""
    task = make_task(make_dag("conv2d_winograd", 1, 28, 28, 128, 128, 1, 4), "cuda -arch=sm_90")
    sketches = generate_sketches(SketchContext(task))
    forms = set()
    for sk in sketches:
        st = sk.state
        pack, inverse = st.stage_by_name("data_pack"), st.stage_by_name("inverse")
        forms.add((pack.compute_at, inverse.compute_at))
        for stage, const in ((pack, ["eps", "nu"]), (inverse, ["vh", "vw"])):
            if stage.compute_at == "root":
                assert [it.name for it in stage.iters[-2:]] == const
                assert [it.annotation for it in stage.iters] == ["none", "none", "unroll", "unroll"]
        pad = st.stage_by_name("data_pad")
        if pack.compute_at == "root":
            assert pad.compute_at == "iter" and pad.attach[0] == "data_pack" and pad.attach[1] is pack.iters[1].var
        else:
            assert pad.compute_at == "inline"
        assert st.stage_by_name("bgemm").compute_at == "root"
    assert forms == {("root", "root"), ("root", "inline"), ("inline", "root"), ("inline", "inline")}
    assert len(sketches) == 4
    # on a CPU the transforms stay stages of their own, once
    cpu = generate_sketches(SketchContext(make_task(make_dag("conv2d_winograd", 1, 28, 28, 128, 128, 1, 4))))
    assert all(sk.state.stage_by_name("data_pack").compute_at != "inline" for sk in cpu)


def test_user_rule_runs_before_builtin_rules():
    calls = []

    def meet(ctx, state, sid):
        calls.append(state.stages[sid].name)
        return Condition.PASS

    rule = CustomRule("spy", meet, lambda ctx, s, sid: [(s, sid - 1)])
    register_sketch_rule(rule, "llvm")
    try:
        _sketches("matmul", 64, 64, 64)
    finally:
        from tensortune.search import sketch_rules
        sketch_rules._CUSTOM_RULES["llvm"].remove(rule)
    assert "C" in calls


def test_inlined_stages_and_cache_write_steps_are_recorded():
    _, sk = _sketches("matmul_bias_relu", 64, 64, 64)
    assert all(any(isinstance(x, ComputeInlineStep) for x in s.state.steps) for s in sk)
    _, sk = _sketches("matmul", 64, 64, 64)
    assert any(any(isinstance(x, CacheWriteStep) for x in s.state.steps) for s in sk)


def test_outer_tile_level_iterates_the_dominant_operands_own_axes_first():
    """An NHWC conv's weight is 9x its data here: the output channels (which only the weight's index
    uses) lead the outermost level, in the conv and in the consumer it is fused into."""
    _, sk = _sketches("conv2d", 1, 14, 14, 256, 256, 3, 3, 1, 1, 1, "NHWC")
    for s in sk:
        conv = s.state.stage_by_name("conv2d_nhwc.local" if "CHW" in _codes(s) else "conv2d_nhwc")
        assert [it.name for it in conv.iters[:4]] == ["f.0", "b.0", "y.0", "x.0"]
        if "CHW" in _codes(s):
            out = s.state.stage_by_name("conv2d_nhwc")
            assert [it.name for it in out.iters[:4]] == ["f.0", "b.0", "y.0", "x.0"]
    # a square matmul has no dominant operand: the axis order stays
    _, sk = _sketches("matmul", 512, 512, 512)
    assert all([it.name for it in s.state.stage_by_name("C").iters[:2]] == ["i.0", "j.0"] for s in _unpacked(sk))
    # a 2048x256 weight against 64x2048 data: the weight's j leads
    _, sk = _sketches("matmul", 64, 256, 2048)
    assert all([it.name for it in s.state.stage_by_name("C").iters[:2]] == ["j.0", "i.0"] for s in _unpacked(sk))


def test_the_contiguous_axis_split_is_drawn_toward_whole_vectors():
    """The split of j (C's contiguous output axis, innermost after SSRSRS) is marked with the float32
    lanes of the target's vector unit, and annotation draws its innermost tile as a multiple of them
    about half the time more than a uniform draw does; the other splits are drawn as before."""
    import random

    from tensortune.search import annotation
    from tensortune.search.annotation import fill_tile_sizes
    task, sk = _sketches("matmul", 512, 512, 512)
    plain = [s for s in _unpacked(sk) if "CHW" not in _codes(s)][0]
    lanes = task.hardware.vector_unit_bytes // 4
    (j_split,) = plain.vector_lanes
    step = plain.state.steps[j_split]
    assert plain.vector_lanes[j_split] == lanes and step.extent == 512
    before = State.replay(plain.state.dag, plain.state.steps[:j_split])
    assert before.stages[step.stage_id].iters[step.iter_id].name == "j"      # the axis itself, not a tile of it
    i_split = next(i for i in plain.tunable if i != j_split)

    def aligned(bias: float, split: int) -> float:
        old = annotation.VECTOR_TILE_BIAS, annotation.REGISTER_TILE_BIAS
        # the register-tile rule redraws i with j: off here, so i's draws show this rule alone
        annotation.VECTOR_TILE_BIAS, annotation.REGISTER_TILE_BIAS = bias, 0.0
        try:
            rng = random.Random(0)
            draws = [fill_tile_sizes(plain, rng, 64)[split].lengths[-1] for _ in range(400)]
        finally:
            annotation.VECTOR_TILE_BIAS, annotation.REGISTER_TILE_BIAS = old
        return sum(d % lanes == 0 for d in draws) / len(draws)

    uniform, biased = aligned(0.0, j_split), aligned(annotation.VECTOR_TILE_BIAS, j_split)
    assert biased > uniform + 0.3 and biased > 0.5
    assert abs(aligned(annotation.VECTOR_TILE_BIAS, i_split) - aligned(0.0, i_split)) < 0.1
    # a GPU task's sketches carry no lanes (its innermost tiles map to threads, not vectors)
    gpu = make_task(make_dag("matmul", 512, 512, 512), "cuda -arch=sm_80")
    assert all(not s.vector_lanes for s in generate_sketches(SketchContext(gpu)))


@pytest.mark.parametrize("target, registers", [("llvm -mcpu=znver4 -mattr=+avx512f", 32),
                                               ("llvm -mcpu=znver3 -mattr=+avx2", 16)])
def test_register_tiles_are_drawn_to_fit_the_vector_registers(target, registers):
    """A reduction's spatial splits form one register tile (matmul: i and j of the stage that
    accumulates, not k); with REGISTER_TILE_BIAS they are redrawn until the innermost block of
    accumulators (i's tile times j's in whole vectors) holds between a quarter and three quarters of
    the target's vector registers: 32 with AVX-512, 16 with AVX2. Without the rule, far fewer draws do."""
    import random

    from tensortune.search import annotation
    from tensortune.search.annotation import accumulator_vectors, fill_tile_sizes
    task = make_task(make_dag("matmul", 512, 512, 512), target)
    sketches = generate_sketches(SketchContext(task))
    for sk in sketches:
        (group,) = sk.register_tiles
        (j_split,) = sk.vector_lanes
        assert sk.vector_registers == registers and j_split in group and len(group) == 2
        k = next(i for i in sk.tunable if i not in group)
        before = State.replay(sk.state.dag, sk.state.steps[:k])
        assert before.stages[sk.state.steps[k].stage_id].iters[sk.state.steps[k].iter_id].kind == "reduce"
    # a depthwise conv's 9-term reduction forms none (REGISTER_TILE_MIN_REDUCTION)
    depthwise = make_task(make_dag("depthwise_conv2d", 1, 112, 112, 32, 3, 1, 1), target)
    assert all(not s.register_tiles for s in generate_sketches(SketchContext(depthwise)))
    sk = sketches[0]
    (group,) = sk.register_tiles
    lanes = task.hardware.vector_unit_bytes // 4

    def fitting(bias: float) -> float:
        old, annotation.REGISTER_TILE_BIAS = annotation.REGISTER_TILE_BIAS, bias
        try:
            rng = random.Random(0)
            draws = [fill_tile_sizes(sk, rng, 64) for _ in range(400)]
        finally:
            annotation.REGISTER_TILE_BIAS = old
        blocks = [accumulator_vectors(sk, {i: d[i].lengths for i in group}, group) for d in draws]
        # the count by hand: i's innermost tile times j's, rounded up to whole vectors
        (i_split,) = set(group) - set(sk.vector_lanes)
        (j_split,) = sk.vector_lanes
        assert blocks == [d[i_split].lengths[-1] * -(-d[j_split].lengths[-1] // lanes) for d in draws]
        return sum(registers // 4 <= b <= registers * 3 // 4 for b in blocks) / len(blocks)

    assert fitting(annotation.REGISTER_TILE_BIAS) > fitting(0.0) + 0.2
    assert fitting(1.0) > 0.9
