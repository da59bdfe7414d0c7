"""Kernel temporaries live in static workspaces, so a call costs the same in any process.

Temporaries too large for the stack were malloc'd and freed on every call. Under Dask's nanny, which
sets MALLOC_TRIM_THRESHOLD_ in every worker (and so in the flow's runner processes), glibc then mapped
them afresh each call, and each run paid a page fault per 4 KiB touched: the flow timed such programs
slower than the library did. Page faults are counted, not timed, so the test is exact."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tensortune.codegen.ir import Allocate, For, IfThenElse, Seq, Stmt
from tensortune.codegen.llvm_codegen import STACK_LIMIT_BYTES, generate_llvm_ir
from tensortune.codegen.lower import lower
from tensortune.codegen.target import parse_target
from tensortune.flows.tuning import default_programs, network_tasks
from tensortune.schedule.state import State
from tensortune.search.cost_model import RandomModel
from tensortune.search.sketch_policy import SketchPolicy
from tensortune.tasks.te import DTYPE_BYTES
from tests.conftest import check_state

# counts the minor page faults of three calls after two warm-up calls, per program
_CHILD = r"""
import json, resource, sys
from tensortune.codegen.llvm_backend import LLVMKernel, build
from tensortune.flows.tuning import network_tasks
from tensortune.schedule.state import State
_, tasks = network_tasks("resnet-18", "llvm", image_size=224)
out = []
for i, steps in json.load(sys.stdin):
    task = tasks[i]
    art = build(State.from_json(task.dag, steps), task.target)
    kernel = LLVMKernel(art)
    arrays = art.layout_inputs([t.name for t in task.dag.inputs], task.dag.random_inputs(seed=7))
    arrays += task.dag.empty_outputs()      # kept referenced: the packed pointers do not own them
    packed = kernel.pack(arrays)
    kernel.run_packed(packed, 2)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        kernel.run_packed(packed, 1)
    out.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 3)
print(json.dumps(out))
"""


def _heap_temporaries(s: Stmt | None) -> int:
    """Temporaries of a lowered kernel too large for its stack."""
    if isinstance(s, Allocate):
        big = s.buffer.size * DTYPE_BYTES[s.buffer.dtype] > STACK_LIMIT_BYTES or s.buffer.scope == "global"
        return int(big) + _heap_temporaries(s.body)
    if isinstance(s, Seq):
        return sum(_heap_temporaries(c) for c in s.stmts)
    if isinstance(s, For):
        return _heap_temporaries(s.body)
    if isinstance(s, IfThenElse):
        return _heap_temporaries(s.then) + _heap_temporaries(s.orelse)
    return 0


def _programs() -> list[tuple[int, State, str]]:
    """Default and sampled programs of two ResNet-18 convs (the stem, the first 3x3; task 0 is the
    image's NHWC transpose), with their IR for 2 threads."""
    _, tasks = network_tasks("resnet-18", "llvm", image_size=224)
    target = parse_target("llvm -num-threads=2")
    out = []
    for i in (1, 3):
        task = tasks[i]
        states = default_programs(task)[:1] + [c.state for c in SketchPolicy(task, RandomModel(0), seed=0).sample(6)]
        for st in states:
            ir = generate_llvm_ir(lower(st, target_kind="cpu"), target.cpu, target.features, target.num_threads)
            out.append((i, st, ir))
    return out


@pytest.fixture(scope="module")
def programs() -> list[tuple[int, State, str]]:
    return _programs()


def test_large_temporaries_are_static_workspaces_of_the_kernel_and_of_each_thread(programs):
    kernel_level = [p for p in programs if re.search(r"_ws\d+ = internal global", p[2])]
    per_thread = [p for p in programs if "call i32 @omp_get_thread_num()" in p[2] and ".off = mul" in p[2]]
    assert kernel_level and per_thread, "the sample must hold both kinds of temporaries, else this test proves nothing"
    for _, _, ir in programs:
        assert "aligned_alloc" not in ir and "@free" not in ir
    for _, st, _ in kernel_level + per_thread:
        check_state(st)               # per-thread slots must not overlap: outputs equal NumPy's


def test_a_call_does_not_fault_pages_under_the_dask_nannys_malloc_settings(programs):
    chosen = [(i, st.steps_json()) for i, st, _ in programs if _heap_temporaries(lower(st, target_kind="cpu").body)]
    assert len(chosen) >= 6
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536"}       # what distributed's nanny sets
    done = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(chosen), capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    faults = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(faults) == len(chosen)
    # malloc'd per call, these programs faulted 97 pages per call on average (one per 4 KiB touched)
    assert max(faults) < 1.0, faults
