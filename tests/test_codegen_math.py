"""Math the code generator emits itself instead of calling libm per lane: float erf (GELU's)."""
from __future__ import annotations

import math

import numpy as np

from tensortune.codegen.llvm_backend import LLVMKernel, assembly, build
from tensortune.codegen.llvm_codegen import generate_llvm_ir
from tensortune.codegen.lower import lower
from tensortune.codegen.target import parse_target
from tensortune.schedule.state import State
from tensortune.tasks import te
from tensortune.tasks.compute_dag import ComputeDAG


def _erf_state(n: int, vector: int) -> State:
    x = te.placeholder((n,), "float32", "x")
    y = te.compute((n,), lambda i: te.erf(x[i]), name="y")
    state = State(ComputeDAG([x, y]))
    if vector > 1:
        state = state.split("y", 0, [vector]).vectorize("y", 1)
    return state


def test_float_erf_is_within_4e_7_of_erf_vectorised_and_scalar():
    xs = np.concatenate([np.linspace(-6, 6, 16384), [0.0, -0.0, 1e-30, -1e-30, 3.99, 4.01, 40.0, -40.0],
                         np.random.default_rng(0).standard_normal(8184) * 2]).astype(np.float32)
    want = np.array([math.erf(float(v)) for v in xs])
    for vector in (16, 1):
        out = np.full_like(xs, np.nan)
        LLVMKernel(build(_erf_state(xs.size, vector)))(xs, out)
        assert float(np.max(np.abs(out - want))) <= 4e-7, vector
        assert np.all(np.abs(out) <= 1.0) and out[np.argmax(xs)] == 1.0 and np.array_equal(np.sign(out), np.sign(want))


def test_vectorised_erf_makes_no_libm_call():
    target = parse_target("llvm")
    ir = generate_llvm_ir(lower(_erf_state(4096, 16), target_kind="cpu"), target.cpu, target.features,
                          target.num_threads)
    assert "erff" not in ir and "erff" not in assembly(ir, target)
