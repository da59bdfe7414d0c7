"""CUDA C generation, everywhere nvcc exists: sampled GPU programs of every library op compile for
sm_90, the generated code has the GPU structure (shared memory, barriers, vthreads, all-reduce), and
programs over the target's limits are rejected before nvcc runs."""
from __future__ import annotations

import functools
import random
import re

import pytest

from tensortune.codegen.cuda_backend import build, check_limits, compile_cubin, find_nvcc, generate
from tensortune.codegen.lower import LoweringError
from tensortune.codegen.target import make_task
from tensortune.schedule.stage import IllegalStep
from tensortune.schedule.state import State
from tensortune.search.annotation import InvalidSample
from tensortune.search.gpu_annotation import check_gpu_limits, sample_gpu_state
from tensortune.search.params import SearchParams
from tensortune.search.sketch_rules import SketchContext, generate_sketches
from tensortune.tasks.search_task import SearchTask
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import GPU_WORKLOADS, small_dag

TARGET = "cuda -arch=sm_90"
needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")


def gpu_task(key: str) -> SearchTask:
    return make_task(small_dag(key), TARGET)


@functools.lru_cache(maxsize=None)
def gpu_programs(key: str, n: int | None = None, seed: int = 0) -> tuple[State, ...]:
    """n sampled GPU programs of a small workload (by default two, and at least one of each sketch),
    taking its sketches in turn."""
    task = gpu_task(key)
    sketches = generate_sketches(SketchContext(task))
    n = max(2, len(sketches)) if n is None else n
    rng = random.Random(seed)
    out: list[State] = []
    for _ in range(4000):
        try:
            out.append(sample_gpu_state(sketches[len(out) % len(sketches)], rng, task))
        except (InvalidSample, IllegalStep):
            continue
        if len(out) == n:
            break
    assert len(out) == n, f"only {len(out)} of {n} GPU programs could be sampled for {key}"
    return tuple(out)


def _kernel_name(key: str, i: int) -> str:
    return re.sub(r"\W", "_", f"{key}_{i}")


@functools.lru_cache(maxsize=1)
def _all_sources() -> dict[str, str]:
    return {key: "\n".join(generate(s, _kernel_name(key, i)).source for i, s in enumerate(gpu_programs(key)))
            for key in sorted(GPU_WORKLOADS)}


# Ops whose sampled programs take nvcc long enough for the slow suite only: the F(4x4) Winograd
# transforms unroll into 0.96 MB of CUDA C, 16 of the 22 s one nvcc call took for every op (its CUDA C
# is still generated and checked against the limits below, and run in the simulator: test_cuda_simulate).
SLOW_NVCC = {"conv2d_winograd_f4"}


@functools.lru_cache(maxsize=1)
def _compile_all() -> str | None:
    """One nvcc call for the programs of every op but SLOW_NVCC's (nvcc costs about a second per call);
    None when it passes."""
    try:
        compile_cubin("\n".join(src for key, src in _all_sources().items() if key not in SLOW_NVCC))
        return None
    except Exception as err:  # noqa: BLE001 - reported per op below
        return str(err)


@needs_nvcc
@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_NVCC else k
                                 for k in sorted(GPU_WORKLOADS)])
def test_sampled_programs_compile_for_sm90(key):
    src = _all_sources()[key]
    assert "__global__" in src
    if key in SLOW_NVCC or _compile_all() is not None:
        compile_cubin(src)          # alone: a slow op, or the batch failed and this shows the op's own error


def test_every_program_generates_and_respects_the_limits():
    for key in sorted(GPU_WORKLOADS):
        task = gpu_task(key)
        for s in gpu_programs(key):
            assert check_gpu_limits(s, task.hardware) is None
            check_limits(generate(s), task.hardware)


def _matmul_program(n=64, tile=(2, 8, 2, 1), k_tile=(4, 2), unroll=64) -> State:
    """A hand-filled matmul sketch (per axis: vthread, threads, two inner levels; reduce: two inner
    levels): by default 2x2 vthreads, 8x8 threads, a 2x1 register tile, shared tiles of A and B."""
    task = make_task(make_dag("matmul", n, n, n), TARGET)
    sketch = generate_sketches(SketchContext(task))[0]
    steps = list(sketch.state.steps)
    from dataclasses import replace
    for i in sketch.tunable:
        st = steps[i]
        steps[i] = replace(st, lengths=tile if len(st.lengths) == 4 else k_tile)
    from tensortune.search.gpu_annotation import init_thread_bind
    state = init_thread_bind(State.replay(task.dag, steps), task.hardware)
    return state.pragma("C.local", 0, f"auto_unroll_max_step${unroll}")


def test_matmul_kernel_has_shared_tiles_barriers_and_vthread_copies():
    mod = generate(_matmul_program())
    (k,) = mod.kernels
    src = mod.source
    assert k.grid == (4, 1, 1) and k.block == (64, 1, 1) and k.vthreads == 4
    assert src.count("__syncthreads();") == 2
    assert re.search(r"__shared__ float A_shared\[\d+\];", src) and "__shared__ float B_shared" in src
    # 4 virtual threads x a 2x1 register tile per axis: one local array of 16 accumulators
    assert "float C_local[16];" in src
    # the shared tiles cover the whole block (32 rows or columns x the 8-long reduce tile), not one
    # thread's or one virtual thread's share
    assert k.shared_bytes == 4 * (32 * 8 + 8 * 32)


@needs_nvcc
def test_the_unroll_pragma_reaches_loops_under_the_thread_bindings():
    """A GPU program's loops sit under its block, thread and vthread loops and tile loops of extent 1;
    TVM counts none of them, so the search's auto-unroll choice changes the kernel (before, every value
    gave one source: the unroll depth was counted from the root)."""
    sources = {u: generate(_matmul_program(unroll=u)).source for u in (0, 16, 512)}
    assert "#pragma unroll" not in sources[0] and "#pragma unroll" in sources[512]
    assert len(set(sources.values())) == 3
    compile_cubin(sources[512])


def test_limits_are_checked_before_nvcc():
    state = _matmul_program(n=256, tile=(1, 32, 1, 1))         # 32 x 32 = 1024 threads: fits
    check_limits(generate(state), make_task(state.dag, TARGET).hardware)
    small = make_task(state.dag, "cuda -arch=sm_90 -max-threads=512").hardware
    with pytest.raises(LoweringError, match="threads per block"):
        check_limits(generate(state), small)
    assert "threads per block" in check_gpu_limits(state, small)
    tiny_smem = make_task(state.dag, "cuda -arch=sm_90 -max-shared-memory=1024").hardware
    with pytest.raises(LoweringError, match="shared memory"):
        check_limits(generate(state), tiny_smem)
    with pytest.raises(LoweringError, match="threads per block"):
        build(state, "cuda -arch=sm_90 -max-threads=512")      # rejected without compiling


def test_cross_thread_reduction_becomes_a_block_allreduce():
    task = make_task(make_dag("norm", 2, 64, 48), TARGET)
    sketches = generate_sketches(SketchContext(task))
    cross = [s for s in sketches if any(it.annotation == "threadIdx.x" and it.kind == "reduce"
                                        for st in s.state.stages for it in st.iters)]
    assert cross, "the norm task should get a cross-thread-reduction sketch"
    state = sample_gpu_state(cross[0], random.Random(0), task)
    src = generate(state).source
    assert "__shfl_down_sync" in src


@needs_nvcc
def test_build_returns_a_cubin_with_its_launch_plan():
    art = build(_matmul_program(), TARGET, keep_source=True)
    kernels, temps = art.launch
    assert art.kind == "cuda" and art.binary[:4] == b"\x7fELF"
    assert kernels[0][1] == (4, 1, 1) and kernels[0][2] == (64, 1, 1) and kernels[0][5] == ("C",)
    assert temps == () and "__global__" in art.source
    assert [a[0] for a in art.args] == ["A", "B", "C"]


def test_multi_stage_programs_split_into_kernels_with_global_temporaries():
    task = make_task(make_dag("softmax", 4, 100), TARGET)
    naive = [s for s in generate_sketches(SketchContext(task)) if len(s.state.steps) == 1][0]
    state = sample_gpu_state(naive, random.Random(0), task, SearchParams(disable_change_compute_location=True))
    mod = generate(state)
    assert len(mod.kernels) == 3
    assert {t[0] for t in mod.temps} == {"T_softmax_maxelem", "T_softmax_expsum"}
    assert mod.kernels[0].writes == ("T_softmax_maxelem",)


def test_programs_over_the_gpu_limits_are_never_proposed():
    # Tile-size mutations of valid programs often cross a tight thread limit; next_batch leaves them out
    # (they would only cost a trial each as build errors).
    from tensortune.search.gpu_annotation import check_gpu_limits
    from tensortune.search.sketch_policy import SearchParams, SketchPolicy
    task = make_task(make_dag("matmul", 256, 256, 256), "cuda -arch=sm_90 -max-threads=128")
    policy = SketchPolicy(task, params=SearchParams(population=256, sample_init_population=128, num_iters=2),
                          seed=0)
    batch = policy.next_batch(32)
    assert batch
    assert all(check_gpu_limits(c.state, task.hardware) is None for c in batch)
    assert policy.timing.n_over_limits > 0, "no mutant crossed the limit: the test shows nothing"


def test_gpu_features_match_the_launch_configuration():
    # The GPU part of the 164 features (is_gpu, blockIdx/threadIdx/vthread lengths) of the output
    # stage's row equals what the CUDA generator makes of the same program: its kernel's grid and block.
    import math

    from tensortune.codegen.cuda_backend import generate
    from tensortune.search.feature import FeatureExtractor
    from tensortune.search.feature_layout import feature_names
    from tensortune.search.sketch_policy import SketchPolicy
    names = feature_names()
    task = make_task(make_dag("matmul", 256, 256, 256), TARGET)
    programs = SketchPolicy(task, seed=5).sample(6)
    assert programs
    for program, rows in zip(programs, FeatureExtractor(task)(programs)):
        state = program.state
        out_row = rows[[s.name for s in state.stages if not s.is_placeholder
                        and s.compute_at != "inline"].index("C")]
        (kernel,) = [k for k in generate(state).kernels if "C" in k.writes]
        assert out_row[names.index("is_gpu")] == 1.0
        for axis, size in (("blockIdx_x_len", kernel.grid[0]), ("threadIdx_x_len", kernel.block[0]),
                           ("blockIdx_y_len", kernel.grid[1]), ("threadIdx_y_len", kernel.block[1])):
            assert out_row[names.index(axis)] == pytest.approx(math.log2(1 + size)), (axis, state.steps_json())
        assert out_row[names.index("vthread_len")] == pytest.approx(math.log2(1 + kernel.vthreads))
