"""Shared fixtures: small workloads of every op, and a helper that builds a state and checks it."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

from tensortune.codegen.llvm_backend import LLVMKernel, build
from tensortune.schedule.state import State
from tensortune.tasks.reference import evaluate, mismatch

# Hypothesis: the default suite (and CI) draws the same examples every run, so a failure is reproducible
# and never intermittent; `-m slow` (or HYPOTHESIS_PROFILE=wide) draws fresh random ones, five times as
# many, to look for new failures.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("wide", derandomize=False, print_blob=True)


def pytest_configure(config: pytest.Config) -> None:
    markexpr = config.getoption("markexpr", "") or ""
    wide = "slow" in markexpr and "not slow" not in markexpr
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "wide" if wide else "ci"))


def terminate(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM a process the test started, then SIGKILL it if it has not exited within `timeout`."""
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def start_as_from_a_terminal(command: list[str], **kwargs) -> subprocess.Popen:
    """A command as a shell runs it in the foreground: its own process group (a terminal's Ctrl-C goes
    to the group) and SIGINT at its default. A test runner started in the background of a
    non-interactive shell (`cmd &`, nohup, CI wrappers) inherits SIGINT ignored, its children with it,
    and a Python started with SIGINT ignored never raises KeyboardInterrupt: Ctrl-C tests would then
    test the runner's start, not the command."""
    return subprocess.Popen(command, start_new_session=True, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs)


def ctrl_c_after_first_round(proc: subprocess.Popen, records: Path, wait_s: float) -> tuple[str, str]:
    """Once `records` holds a stored round, send SIGINT to the command's process group (as a terminal's
    Ctrl-C does; start it with start_as_from_a_terminal) and return its (stdout, stderr)."""
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not list(records.rglob("*.parquet")):
            time.sleep(0.5)
        assert list(records.rglob("*.parquet")), "no round was stored in time"
        os.killpg(proc.pid, signal.SIGINT)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def examples(n: int) -> int:
    """How many examples a property test draws: n in the default suite, 5n in the wide profile."""
    return n * 5 if settings.default.derandomize is False else n


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Under the wide profile the property tests count as slow, so `-m slow` runs them (unmarked, they
    were deselected by it, and the wide profile never drew an example)."""
    if settings.get_current_profile_name() == "wide":
        for item in items:
            if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
                item.add_marker(pytest.mark.slow)


# Small shapes of every op in the library (odd sizes on purpose: they exercise imperfect tiling).
SMALL_WORKLOADS = {
    "matmul": (33, 20, 17),
    "matmul_bias_relu": (16, 40, 24),
    "dense": (2, 24, 20),
    "batch_matmul": (2, 12, 10, 8),
    "batch_matmul_tb": (2, 12, 10, 8, True),
    "conv1d": (1, 20, 4, 8, 3, 2, 1),
    "conv2d": (1, 10, 10, 4, 8, 3, 3, 1, 1),
    "conv2d_nhwc": (1, 9, 9, 4, 8, 3, 3, 2, 1, 1, "NHWC"),
    "conv2d_relu": (1, 8, 8, 4, 8, 3, 3, 1, 1, True),
    "conv3d": (1, 4, 6, 6, 2, 4, 3, 3, 3, 1, 1),
    "group_conv2d": (1, 8, 8, 8, 8, 3, 3, 2, 1, 2),
    "dilated_conv2d": (1, 12, 12, 3, 4, 3, 3, 1, 2, 2),
    "depthwise_conv2d": (1, 10, 10, 8, 3, 2, 1),
    "conv2d_transpose": (1, 4, 4, 4, 3, 4, 4, 2, 1),
    "capsule_conv2d": (1, 6, 6, 2, 4, 3, 3, 1, 1, 2),
    "norm": (2, 16, 12),
    "softmax": (4, 20),
    "layer_norm": (4, 24),
    "max_pool2d": (1, 4, 9, 9, 3, 2, 1),
    "avg_pool2d": (1, 3, 8, 8, 3, 2, 1),
    "elementwise": (1, 3, 5, 7, "add_relu"),
    "elementwise_gelu": (1, 2, 3, 10, "gelu"),
    "elementwise_sigmoid": (1, 2, 3, 10, "sigmoid"),
}
# GPU programs are also checked for the Winograd form, whose GPU sketches differ (a transform is a kernel
# of its own or folded into its reader); on CPUs tests/test_winograd*.py cover it
GPU_WORKLOADS = {
    **SMALL_WORKLOADS,
    "conv2d_winograd_f2": (1, 6, 6, 4, 8, 1, 2),
    "conv2d_winograd_f4": (1, 8, 8, 4, 8, 1, 4),
}


def small_dag(key: str):
    from tensortune.tasks.workload_registry import make_dag
    name = {"batch_matmul_tb": "batch_matmul", "conv2d_nhwc": "conv2d", "elementwise_gelu": "elementwise",
            "elementwise_sigmoid": "elementwise", "conv2d_winograd_f2": "conv2d_winograd",
            "conv2d_winograd_f4": "conv2d_winograd"}.get(key, key)
    return make_dag(name, *GPU_WORKLOADS[key])


def check_state(state: State, seed: int = 0) -> None:
    """Build the state, run it on fresh random inputs, and compare every output with the reference."""
    dag = state.dag
    kernel = LLVMKernel(build(state))
    inputs = dag.random_inputs(seed)
    outs = [np.full(t.shape, np.nan, dtype=t.dtype) for t in dag.outputs]
    kernel(*inputs, *outs)
    for t, out, ref in zip(dag.outputs, outs, evaluate(dag, inputs)):
        bad = mismatch(out, ref)
        assert bad is None, f"{t.name}: {bad}\nsteps: {state.steps_json()}"


@pytest.fixture(params=sorted(SMALL_WORKLOADS))
def small_workload(request):
    return small_dag(request.param)


# ------------------------------------------------------------------ the flow tests' Prefect API and cluster

@pytest.fixture(scope="module")
def prefect_api():
    """A temporary Prefect server for one test module's flow runs."""
    from prefect.testing.utilities import prefect_test_harness
    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="module")
def flow_cluster():
    """A LocalCluster of two worker processes advertising the CPU measure resource, as `dask worker
    --resources measure-cpu=1` starts them; the flow gets a client that is not the process default."""
    from distributed import Client, LocalCluster
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, resources={"measure-cpu": 1},
                      dashboard_address=None, host="127.0.0.1") as c, Client(c, set_as_default=False) as client:
        yield client
