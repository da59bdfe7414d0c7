"""Winograd conv2d (tasks/winograd.py) computes the direct convolution: its transform matrices, its
DAG's NumPy reference, its default schedule and programs the search samples, for every distinct 3x3
stride-1 convolution of ResNet-18 and ResNet-50 and both tile sizes.

Tolerance. Kernels run in float32 and are compared with the float64 reference of the *direct*
convolution: max |out - ref| <= TOL[m] * max |ref|, TOL = 5e-6 for F(2x2, 3x3) and 2e-5 for
F(4x4, 3x3). Why these: a float32 direct conv over CI * 9 terms already errs by ~1-2e-6 of the scale
on these shapes (measured: 0.8e-6 at CI 64 to 2.2e-6 at CI 512, default schedule). Winograd adds the
rounding of the transforms, whose coefficients grow with the tile: F(2, 3)'s are 0, +-1/2, +-1 (measured
0.4-0.9e-6, within the direct conv's own error), F(4, 3)'s points -2 and 1/2 give coefficients up to 4
in B and 1/3-scaled rows in G, the known accuracy loss of larger tiles (Barabasz et al. 2018; measured
2.2-6.3e-6, growing with CI). The bounds leave a margin of 3-5x over the worst measured error, and are
still 50x (m=2) to 12x (m=4) tighter than the generic kernel tolerance (1e-3 relative + 1e-4 of the
scale), so a wrong coefficient or a misplaced tile cannot pass. The float64 reference of the Winograd
DAG itself equals the direct conv to 1e-12 of the scale: the algebra is exact.
"""
from __future__ import annotations

import random
from functools import lru_cache

import numpy as np
import pytest

from tensortune.codegen.llvm_backend import LLVMKernel, build
from tensortune.codegen.llvm_codegen import generate_llvm_ir
from tensortune.codegen.lower import lower
from tensortune.codegen.target import make_task
from tensortune.schedule.default_schedule import default_schedule
from tensortune.schedule.state import State
from tensortune.search.mutation import crossover, mutate_auto_unroll, mutate_compute_location, mutate_tile_size
from tensortune.search.sketch_policy import SearchParams, SketchPolicy
from tensortune.tasks import winograd
from tensortune.tasks.models import resnet18, resnet50
from tensortune.tasks.reference import evaluate
from tensortune.tasks.search_task import SearchTask
from tensortune.tasks.workload_registry import make_dag
from tests.schedules import tiled_schedule

TOL = {2: 5e-6, 4: 2e-5}


@lru_cache(maxsize=None)
def resnet_shapes() -> tuple[tuple[int, int, int, int, int], ...]:
    """(CI, H, W, CO, pad) of every distinct Winograd-eligible conv of ResNet-18 and ResNet-50."""
    shapes = set()
    for g in (resnet18(), resnet50()):
        for n in g.nodes:
            if n.op != "conv2d":
                continue
            a, x, w = n.attrs, g.values[n.inputs[0]].shape, g.values[n.inputs[1]].shape
            if winograd.eligible(w, a["strides"], a["dilations"], a["groups"]):
                pt, pl, pb, pr = a["pads"]
                assert (pt, pl) == (pb, pr) == (1, 1)
                shapes.add((x[1], x[2], x[3], w[0], pt))
    return tuple(sorted(shapes))


# the ResNet shapes, written out so the parametrisation is visible; test_resnet_shapes_are_these checks them
SHAPES = [(64, 56, 56, 64, 1), (128, 28, 28, 128, 1), (256, 14, 14, 256, 1), (512, 7, 7, 512, 1)]


def test_resnet_shapes_are_these():
    assert list(resnet_shapes()) == SHAPES


def _inputs(n: int, ci: int, h: int, w: int, co: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, ci, h, w)).astype(np.float32)
    g = (rng.standard_normal((co, ci, 3, 3)) / np.sqrt(ci * 9)).astype(np.float32)
    return x, g


@lru_cache(maxsize=8)
def _direct(n: int, ci: int, h: int, w: int, co: int, pad: int, relu: bool, seed: int) -> np.ndarray:
    """The direct conv's NumPy reference (float64) on the inputs of `seed`."""
    x, g = _inputs(n, ci, h, w, co, seed)
    dag = make_dag("conv2d", n, h, w, ci, co, 3, 3, 1, pad)
    out = evaluate(dag, [x, g], keep_all=True)[dag.outputs[0].name]
    return np.maximum(out, 0.0) if relu else out


def _check_kernel(state: State, n: int, ci: int, h: int, w: int, co: int, pad: int, m: int, relu: bool,
                  seed: int) -> None:
    x, g = _inputs(n, ci, h, w, co, seed)
    ref = _direct(n, ci, h, w, co, pad, relu, seed)
    out = np.full(ref.shape, np.nan, np.float32)
    LLVMKernel(build(state))(x, winograd.transform_weight(g, m), out)
    err = float(np.max(np.abs(out - ref)))
    scale = float(np.max(np.abs(ref)))
    assert np.all(np.isfinite(out)), f"non-finite output\nsteps: {state.steps_json()}"
    assert err <= TOL[m] * scale, f"max error {err:.3g} > {TOL[m]} * {scale:.3g}\nsteps: {state.steps_json()}"


# ---------------------------------------------------------------------------------- the algebra

@pytest.mark.parametrize("m", winograd.TILE_SIZES)
def test_matrices_compute_a_1d_correlation(m):
    mats = winograd.winograd_matrices(m)
    assert mats.A_T.shape == (m, m + 2) and mats.B_T.shape == (m + 2, m + 2) and mats.G.shape == (m + 2, 3)
    rng = np.random.default_rng(m)
    for _ in range(5):
        d, g = rng.standard_normal(m + 2), rng.standard_normal(3)
        y = mats.A_T @ ((mats.G @ g) * (mats.B_T @ d))
        np.testing.assert_allclose(y, np.correlate(d, g, "valid"), rtol=0, atol=1e-12)


def test_transform_weight_is_g_g_gt_per_channel_pair():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 2, 3, 3))
    u = winograd.transform_weight(w, 4)
    G = winograd.winograd_matrices(4).G
    assert u.shape == (6, 6, 3, 2) and u.dtype == w.dtype
    for o in range(3):
        for i in range(2):
            np.testing.assert_allclose(u[:, :, o, i], G @ w[o, i] @ G.T, rtol=1e-12)
    with pytest.raises(ValueError, match="3, 3"):
        winograd.transform_weight(rng.standard_normal((3, 2, 5, 5)), 2)


@pytest.mark.parametrize("m", winograd.TILE_SIZES)
@pytest.mark.parametrize("shape", SHAPES + [(4, 7, 9, 8, 1), (3, 6, 5, 2, 0)])
def test_dag_reference_equals_direct_conv(shape, m):
    """The Winograd DAG evaluated by the NumPy reference (float64, U in float64) is the direct conv."""
    ci, h, w, co, pad = shape
    x, g = _inputs(1, ci, h, w, co, 0)
    dag = make_dag("conv2d_winograd", 1, h, w, ci, co, pad, m)
    out = evaluate(dag, [x, winograd.transform_weight(g.astype(np.float64), m)], keep_all=True)[dag.outputs[0].name]
    ref = _direct(1, ci, h, w, co, pad, False, 0)
    assert out.shape == ref.shape
    assert float(np.max(np.abs(out - ref))) <= 1e-12 * float(np.max(np.abs(ref)))


@pytest.mark.parametrize("m", winograd.TILE_SIZES)
@pytest.mark.parametrize("shape", SHAPES + [(4, 7, 9, 8, 1), (3, 6, 5, 2, 0)])
def test_nhwc_dag_reference_equals_direct_conv(shape, m):
    """The NHWC form (channels innermost in every stage, U from the HWIO weight) is the same conv."""
    ci, h, w, co, pad = shape
    x, g = _inputs(1, ci, h, w, co, 0)
    dag = make_dag("conv2d_winograd", 1, h, w, ci, co, pad, m, layout="NHWC")
    u = winograd.transform_weight_hwio(g.astype(np.float64).transpose(2, 3, 1, 0), m)
    np.testing.assert_array_equal(u, winograd.transform_weight(g.astype(np.float64), m).transpose(0, 1, 3, 2))
    out = evaluate(dag, [x.transpose(0, 2, 3, 1), u], keep_all=True)[dag.outputs[0].name]
    ref = _direct(1, ci, h, w, co, pad, False, 0).transpose(0, 2, 3, 1)
    assert out.shape == ref.shape
    assert float(np.max(np.abs(out - ref))) <= 1e-12 * float(np.max(np.abs(ref)))


@pytest.mark.parametrize("m", winograd.TILE_SIZES)
@pytest.mark.parametrize("shape", SHAPES)
def test_nhwc_default_schedule_and_sampled_programs_match_direct_conv(shape, m):
    """Compiled NHWC Winograd kernels on random inputs: the default schedule and two programs the
    search samples, against the float64 direct conv (same tolerances as the NCHW form)."""
    ci, h, w, co, pad = shape
    x, g = _inputs(1, ci, h, w, co, 2)
    ref = _direct(1, ci, h, w, co, pad, False, 2).transpose(0, 2, 3, 1)
    dag = make_dag("conv2d_winograd", 1, h, w, ci, co, pad, m, layout="NHWC")
    policy = _policy(dag)
    policy.rng = random.Random(m * 100 + ci)
    states = [default_schedule(dag)] + [c.state for c in policy.sample(2)]
    u = winograd.transform_weight_hwio(g.transpose(2, 3, 1, 0), m)
    for state in states:
        out = np.full(ref.shape, np.nan, np.float32)
        LLVMKernel(build(state))(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), u, out)
        err, scale = float(np.max(np.abs(out - ref))), float(np.max(np.abs(ref)))
        assert np.all(np.isfinite(out)) and err <= TOL[m] * scale, f"error {err:.3g}\nsteps: {state.steps_json()}"


@pytest.mark.parametrize("m", winograd.TILE_SIZES)
@pytest.mark.parametrize("n,h,w,ci,co,relu", [(1, 56, 56, 64, 64, True), (1, 14, 14, 256, 256, True),
                                             (2, 9, 7, 16, 32, False), (1, 13, 11, 32, 16, True),
                                             (1, 2, 2, 32, 32, True), (1, 1, 1, 16, 16, False)])
def test_nhwc_default_schedule_fuses_the_transforms_per_block(n, h, w, ci, co, relu, m):
    """The NHWC default (schedule.winograd_schedule): the input transform computed inside the batched
    product's block, the product inside the inverse's, the inverse inside the output's parallel
    loop; a block is a row of tiles where there are as many tiles as output channels, else all tiles
    and a slice of the channels. Correct on random inputs against the float64 direct conv, ragged
    tiles, batch 2 and images of one tile (the padding inlined there too) included."""
    from tensortune.schedule.winograd_schedule import winograd_nhwc_schedule
    dag = make_dag("conv2d_winograd", n, h, w, ci, co, 1, m, relu, "NHWC")
    state = default_schedule(dag)
    assert state.steps_json() == winograd_nhwc_schedule(dag).steps_json()
    out = dag.outputs[0].name
    attach = {st.name: (st.compute_at, st.attach[0] if st.attach else None) for st in state.stages}
    assert attach["data_pack"] == ("iter", "bgemm") and attach["bgemm"] == ("iter", "inverse")
    assert attach["inverse"] == ("iter", out) and attach["data_pad"][0] == "inline"
    nh, nw, tiles = winograd.output_tiles(n, h, w, m)
    parallel = state.stage_by_name(out).iters[0]
    assert parallel.annotation == "parallel"
    kt = 32 if co % 32 == 0 else 16          # the register tile's channels: two vectors where they fit
    assert parallel.known_extent == (n * nh if tiles >= co else n * (co // max(kt, co // 8)))
    x, g = _inputs(n, ci, h, w, co, 3)
    ref = _direct(n, ci, h, w, co, 1, relu, 3).transpose(0, 2, 3, 1)
    got = np.full(ref.shape, np.nan, np.float32)
    LLVMKernel(build(state))(np.ascontiguousarray(x.transpose(0, 2, 3, 1)),
                             winograd.transform_weight_hwio(g.transpose(2, 3, 1, 0), m), got)
    assert float(np.max(np.abs(got - ref))) <= TOL[m] * float(np.max(np.abs(ref)))


def test_the_nchw_form_and_fractional_vectors_keep_the_generic_default():
    from tensortune.schedule.winograd_schedule import winograd_nhwc_schedule
    assert winograd_nhwc_schedule(make_dag("conv2d_winograd", 1, 14, 14, 32, 32, 1, 2)) is None
    assert winograd_nhwc_schedule(make_dag("conv2d_winograd", 1, 14, 14, 24, 32, 1, 2, False, "NHWC")) is None
    assert winograd_nhwc_schedule(make_dag("conv2d", 1, 14, 14, 32, 32, 3, 3, 1, 1)) is None


def test_batch_two_and_ragged_tiles():
    """Batch > 1 (tile index p runs over images) and outputs not divisible by m (the last tile is cut)."""
    for m in winograd.TILE_SIZES:
        x, g = _inputs(2, 3, 9, 7, 5, 1)
        dag = make_dag("conv2d_winograd", 2, 9, 7, 3, 5, 1, m)
        out = evaluate(dag, [x, winograd.transform_weight(g.astype(np.float64), m)], keep_all=True)[dag.outputs[0].name]
        ref = _direct(2, 3, 9, 7, 5, 1, False, 1)
        assert float(np.max(np.abs(out - ref))) <= 1e-12 * float(np.max(np.abs(ref)))


def test_flops_count_the_transforms_sparsely():
    """FLOPs: bgemm's 2 alpha^2 CO CI P plus the transforms' nonzero terms only (fewer than the direct
    conv's, which is the point)."""
    for m, ratio in ((2, 0.75), (4, 0.45)):
        wino = make_dag("conv2d_winograd", 1, 56, 56, 64, 64, 1, m).flop_ct
        direct = make_dag("conv2d", 1, 56, 56, 64, 64, 3, 3, 1, 1).flop_ct
        alpha, P = m + 2, (56 // m) ** 2
        assert 2 * alpha ** 2 * 64 * 64 * P < wino < ratio * direct


# ---------------------------------------------------------------------------------- compiled

@pytest.mark.parametrize("m", winograd.TILE_SIZES)
@pytest.mark.parametrize("shape", SHAPES)
def test_default_schedule_matches_direct_conv(shape, m):
    ci, h, w, co, pad = shape
    dag = make_dag("conv2d_winograd", 1, h, w, ci, co, pad, m)
    _check_kernel(default_schedule(dag), 1, ci, h, w, co, pad, m, False, 0)


@pytest.mark.parametrize("m", winograd.TILE_SIZES)
def test_default_schedule_unrolls_the_constant_indices(m):
    """data_pack and inverse: their select chains fold only where eps/nu (vh/vw) are unrolled."""
    s = default_schedule(make_dag("conv2d_winograd", 1, 14, 14, 16, 16, 1, m))
    for name, axes in (("data_pack", {"eps", "nu"}), ("inverse", {"vh", "vw"})):
        stage = s.stage_by_name(name)
        assert {it.name for it in stage.iters if it.annotation == "unroll"} == axes
        assert stage.iters[-1].annotation == "vectorize"


@pytest.mark.parametrize("m", winograd.TILE_SIZES)
def test_tiled_schedules_match_direct_conv(m):
    """Hand-made schedules (tests/schedules.py: imperfect splits, compute_at, no inlining)."""
    dag = make_dag("conv2d_winograd", 2, 9, 7, 3, 5, 1, m, True)
    for variant in (dict(), dict(tile=3, vec=5), dict(cache=False, attach_pad=False, inline=False)):
        _check_kernel(tiled_schedule(dag, **variant), 2, 3, 9, 7, 5, 1, m, True, 1)


# ---------------------------------------------------------------------------------- search

def _policy(dag) -> SketchPolicy:
    return SketchPolicy(make_task(dag), params=SearchParams(), seed=0)


@pytest.mark.parametrize("m", winograd.TILE_SIZES)
def test_sketches_tile_bgemm_and_unroll_the_transforms(m):
    """As Ansor's: bgemm multi-level tiled (SSRSRS; in a local stage or not, one sketch each), data_pack and
    inverse with their constant indices unrolled and the rest tiled in two levels; one sketch of the
    two keeps the last spatial tile innermost, where annotation vectorises it."""
    pol = _policy(make_dag("conv2d_winograd", 1, 14, 14, 16, 16, 1, m, True))
    assert pol.sketches
    innermost, cached = set(), set()
    for sk in pol.sketches:
        s = sk.state
        names = {st.name for st in s.stages}
        cached.add("bgemm.local" in names)
        local = s.stage_by_name("bgemm.local" if "bgemm.local" in names else "bgemm")
        assert [it.kind for it in local.iters] == ["spatial"] * 8 + ["reduce"] + ["spatial"] * 4 + ["reduce"] + \
            ["spatial"] * 4
        for name, axes in (("data_pack", {"eps", "nu"}), ("inverse", {"vh", "vw"})):
            stage = s.stage_by_name(name)
            assert {it.name for it in stage.iters if it.annotation == "unroll"} == axes
            assert len(stage.iters) == 2 * 2 + 2          # two other axes in two levels, two unrolled
            innermost.add((name, stage.iters[-1].annotation))
    assert cached == {True, False}
    assert innermost == {("data_pack", "unroll"), ("data_pack", "none"), ("inverse", "unroll"), ("inverse", "none")}


# F(4, 3) on the ResNet-sized shape is slow (8 s) and its code is the small shape's: -m slow.
@pytest.mark.parametrize("shape,relu,m", [
    ((256, 14, 14, 256, 1), False, 2),
    pytest.param((256, 14, 14, 256, 1), False, 4, marks=pytest.mark.slow),
    ((4, 7, 9, 8, 1), True, 2), ((4, 7, 9, 8, 1), True, 4)],
    ids=["256ch-f2", "256ch-f4", "small-relu-f2", "small-relu-f4"])
def test_sampled_and_mutated_programs_match_direct_conv(shape, relu, m):
    ci, h, w, co, pad = shape
    pol = _policy(make_dag("conv2d_winograd", 1, h, w, ci, co, pad, m, relu))
    pol.rng = random.Random(m)
    rng = random.Random(m)
    progs = pol.sample(4)
    assert progs
    children = [mutate_tile_size(progs[0], rng, 64), mutate_auto_unroll(progs[1 % len(progs)], rng),
                mutate_compute_location(progs[-1], rng)]
    pairs = [(a, b) for i, a in enumerate(progs) for b in progs[i + 1:] if a.sketch == b.sketch]
    for a, b in pairs:
        child = crossover(a, b, len(pol.sketches[a.sketch].state.steps), rng)
        if child is not None:
            children.append(child)
            break
    for c in progs + [c for c in children if c is not None]:
        _check_kernel(c.state, 1, ci, h, w, co, pad, m, relu, 2)


def test_default_vector_tiles_split_exactly_where_they_can():
    """An imperfect vector tile masks every step of a register tile (7-17x slower, see tile_size): the
    default schedule takes the largest divisor up to 16 unless it is below 4."""
    from tensortune.schedule.default_schedule import tile_size
    from tensortune.schedule.steps import SplitStep
    assert [tile_size(e, 16) for e in (7, 16, 28, 49, 56, 196, 53, 784)] == [7, 16, 14, 7, 14, 14, 16, 16]
    s = default_schedule(make_dag("conv2d_winograd", 1, 14, 14, 8, 8, 1, 2))      # P = 7 x 7 = 49 tiles
    splits = [st for st in s.steps if isinstance(st, SplitStep) and st.extent == 49]
    assert splits and all(49 % st.lengths[-1] == 0 for st in splits)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_a_task_read_back_from_json_compiles_to_the_same_code(layout):
    """The flow builds its tasks and compiles the deployed network from them, its measuring workers
    read them back from JSON: the kernel timed must be the kernel run. The code generator emits an
    expression object once per statement, so a body's sharing is part of the code; every body is shared
    the same way wherever it comes from (`te.shared`). Before that, the default schedule of an F(4)
    task gave the two different LLVM IR. The same IR for the default schedule and sampled programs."""
    task = make_task(make_dag("conv2d_winograd", 1, 14, 14, 16, 16, 1, 4, True, layout=layout))
    back = SearchTask.from_json(task.to_json())
    pol = SketchPolicy(task, params=SearchParams(), seed=0)
    pol.rng = random.Random(4)
    states = [default_schedule(task.dag)] + [c.state for c in pol.sample(4)]
    assert len(states) == 5
    for state in states:
        again = State.from_json(back.dag, state.steps_json())
        assert generate_llvm_ir(lower(state), "x86-64", "") == generate_llvm_ir(lower(again), "x86-64", ""), \
            state.steps_json()
