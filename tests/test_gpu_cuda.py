"""On a GPU: the sampled programs of every library op run and match the NumPy reference; the
runner checks and times with CUDA events; a faulting kernel costs one record; the limits come from
the device; a short tuning run finds a correct kernel. Skipped cleanly without pycuda or a GPU."""
from __future__ import annotations

import functools
import math
import random

import numpy as np
import pytest

from tensortune.codegen.artifact import Artifact
from tensortune.codegen.cuda_backend import (
    CUDAKernel,
    build,
    compile_cubin,
    device_target,
    generate,
    gpu_available,
    run_artifact,
)
from tensortune.codegen.gpu_device import device_hardware_params
from tensortune.codegen.target import make_task
from tensortune.codegen.timing import ErrorCode, TimingConfig
from tensortune.schedule.state import State
from tensortune.search.gpu_annotation import sample_gpu_state
from tensortune.search.sketch_rules import SketchContext, generate_sketches
from tensortune.tasks.reference import evaluate, mismatch
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import GPU_WORKLOADS
from tests.test_cuda_codegen import TARGET, gpu_programs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs pycuda and an NVIDIA GPU")]


def _artifact(state: State, binary: bytes, name: str) -> Artifact:
    mod = generate(state, name)
    kernels = tuple((k.name, k.grid, k.block, 0, k.params, k.writes) for k in mod.kernels)
    return Artifact("cuda", name, binary, tuple((t.name, t.shape, t.dtype) for t in state.dag.args),
                    launch=(kernels, mod.temps))


@functools.lru_cache(maxsize=1)
def _all_artifacts() -> dict[str, list[Artifact]]:
    """Every op's sampled programs in one cubin (one nvcc call), one launch plan per program."""
    names = {key: [f"{key}_{i}" for i in range(len(gpu_programs(key)))] for key in GPU_WORKLOADS}
    source = "\n".join(generate(s, n).source for key in GPU_WORKLOADS
                       for s, n in zip(gpu_programs(key), names[key]))
    binary = compile_cubin(source, device_hardware_params()[0])
    return {key: [_artifact(s, binary, n) for s, n in zip(gpu_programs(key), names[key])] for key in GPU_WORKLOADS}


def _check(kernel: CUDAKernel, dag, seed: int) -> None:
    inputs = dag.random_inputs(seed)
    outs = [np.full(t.shape, np.nan, dtype=t.dtype) for t in dag.outputs]
    kernel(*inputs, *outs)
    for t, out, ref in zip(dag.outputs, outs, evaluate(dag, inputs)):
        bad = mismatch(out, ref)
        assert bad is None, f"{t.name}: {bad}"


@pytest.mark.parametrize("key", sorted(GPU_WORKLOADS))
def test_sampled_programs_match_the_reference_on_the_gpu(key):
    for i, art in enumerate(_all_artifacts()[key]):
        _check(CUDAKernel(art), gpu_programs(key)[i].dag, seed=11 + i)


@pytest.mark.parametrize("threads", [80, 256])
def test_block_allreduce_over_several_warps(threads):
    """A cross-thread reduction whose reduce loop spans partial and several warps."""
    task = make_task(make_dag("norm", 3, 40, 50), TARGET)
    state = State(task.dag)
    sid = state.stage_id("T_sum_sq")
    state = state.fuse(sid, [1, 2]).split(sid, 1, [threads]).bind(sid, 2, "threadIdx.x").bind(sid, 0, "blockIdx.x")
    out = state.stage_id("T_norm")
    state = state.split(out, 0, [3]).bind(out, 1, "threadIdx.x")
    art = build(state, TARGET)
    assert art.launch[0][0][2] == (threads, 1, 1)
    _check(CUDAKernel(art), task.dag, seed=3)


def _matmul_state(n: int = 128) -> State:
    task = make_task(make_dag("matmul", n, n, n), TARGET)
    sketches = generate_sketches(SketchContext(task))
    rng = random.Random(0)
    while True:
        try:
            return sample_gpu_state(sketches[0], rng, task)
        except Exception:  # noqa: BLE001 - rejected samples: draw again
            continue


def test_run_artifact_checks_and_times_with_events():
    state = _matmul_state()
    task = make_task(state.dag, TARGET)
    costs, code, msg = run_artifact(task, build(state, TARGET), TimingConfig(number=5, repeat=3, min_repeat_ms=20))
    assert code == ErrorCode.NO_ERROR, msg
    assert len(costs) == 3 and all(0 < c < 1 for c in costs)


_BAD_SOURCES = {
    "wrong": 'extern "C" __global__ void bad(const float* A, const float* B, float* C) '
             '{ C[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f; }',
    "fault": 'extern "C" __global__ void bad(const float* A, const float* B, float* C) '
             '{ C[(blockIdx.x * blockDim.x + threadIdx.x) * 100000000LL] = 1.0f; }',
}


def _bad_artifact(kind: str, n: int, task) -> Artifact:
    binary = compile_cubin(_BAD_SOURCES[kind], device_hardware_params()[0])
    return Artifact("cuda", "bad", binary, tuple((t.name, t.shape, t.dtype) for t in task.dag.args),
                    launch=((("bad", (n, 1, 1), (n, 1, 1), 0, ("A", "B", "C"), ("C",)),), ()))


def test_a_wrong_kernel_is_a_wrong_answer():
    task = make_task(make_dag("matmul", 64, 64, 64), TARGET)
    _, code, msg = run_artifact(task, _bad_artifact("wrong", 64, task), TimingConfig(number=1, min_repeat_ms=1))
    assert code == ErrorCode.WRONG_ANSWER, msg


def test_a_faulting_kernel_costs_one_record_and_the_runner_goes_on():
    """An illegal address poisons the CUDA context: the runner must rebuild it (or its process)."""
    from tensortune.codegen.measure import BuildResult, LocalRunner
    good = _matmul_state(64)
    task = make_task(good.dag, TARGET)
    builds = [BuildResult(_bad_artifact("fault", 64, task), 0, "", 0.0), BuildResult(build(good, TARGET), 0, "", 0.0),
              BuildResult(_bad_artifact("fault", 64, task), 0, "", 0.0), BuildResult(build(good, TARGET), 0, "", 0.0)]
    runner = LocalRunner(timeout=60, config=TimingConfig(number=1, min_repeat_ms=1))
    try:
        res = runner.run(task, builds)
    finally:
        runner.close()
    codes = [r.error_code for r in res]
    assert codes == [ErrorCode.RUNTIME_DEVICE, ErrorCode.NO_ERROR] * 2, [r.error_msg[:200] for r in res]


def test_hardware_params_come_from_the_device():
    arch, hw = device_hardware_params()
    assert arch.startswith("sm_") and hw.max_threads_per_block >= 512 and hw.warp_size == 32
    assert hw.max_shared_memory_per_block >= 48 * 1024 and hw.num_cores > 0
    task = make_task(make_dag("matmul", 64, 64, 64), device_target())
    assert task.hardware.num_cores == hw.num_cores and task.target == f"cuda -arch={arch}"
    bare = make_task(make_dag("matmul", 64, 64, 64), "cuda")      # a bare "cuda" is this GPU
    assert bare.hardware == hw and bare.target == f"cuda -arch={arch}"


def test_measurer_and_tuning_find_a_correct_kernel():
    from tensortune.codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
    from tensortune.flows.tuning import apply_best, tune_task
    task = make_task(make_dag("matmul_bias_relu", 256, 256, 256), device_target())
    measurer = ProgramMeasurer(LocalBuilder(n_parallel=8, timeout=60),
                               LocalRunner(timeout=30, config=TimingConfig(min_repeat_ms=10)))
    try:
        res = tune_task(task, 32, measurer=measurer, model="random", seed=1)
    finally:
        measurer.close()
    assert math.isfinite(res.best_latency) and res.best_gflops > 0
    _check(apply_best(task, res), task.dag, seed=5)
