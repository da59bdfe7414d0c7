"""Math the code generator emits itself instead of calling libm per lane: float erf (GELU's), exp
(softmax's, sigmoid's) and tanh."""
from __future__ import annotations

import math
import re

import numpy as np

from tensortune.codegen.llvm_backend import LLVMKernel, assembly, build
from tensortune.codegen.llvm_codegen import generate_llvm_ir
from tensortune.codegen.lower import lower
from tensortune.codegen.target import parse_target
from tensortune.schedule.state import State
from tensortune.tasks import te
from tensortune.tasks.compute_dag import ComputeDAG


def _unary_state(n: int, vector: int, fn=te.erf) -> State:
    x = te.placeholder((n,), "float32", "x")
    y = te.compute((n,), lambda i: fn(x[i]), name="y")
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
        LLVMKernel(build(_unary_state(xs.size, vector)))(xs, out)
        assert float(np.max(np.abs(out - want))) <= 4e-7, vector
        assert np.all(np.abs(out) <= 1.0) and out[np.argmax(xs)] == 1.0 and np.array_equal(np.sign(out), np.sign(want))


def test_vectorised_erf_makes_no_libm_call():
    target = parse_target("llvm")
    ir = generate_llvm_ir(lower(_unary_state(4096, 16), target_kind="cpu"), target.cpu, target.features,
                          target.num_threads)
    assert "erff" not in ir and "erff" not in assembly(ir, target)


def test_float_exp_is_within_1_ulp_of_exp_and_overflows_underflows_and_propagates_nan_as_exp():
    rng = np.random.default_rng(0)
    xs = np.concatenate([np.linspace(-110, 95, 400_000), rng.standard_normal(100_000) * 10,
                         [0.0, -0.0, 88.72, 88.7228, 88.73, -87.3, -103.0, -104.0, -200, 200, np.inf, -np.inf, np.nan]
                         ]).astype(np.float32)
    with np.errstate(over="ignore", under="ignore"):
        want64 = np.exp(xs.astype(np.float64))
        want = want64.astype(np.float32)
    normal = np.isfinite(want) & (want >= np.finfo(np.float32).tiny)
    for vector in (16, 1):
        out = np.full_like(xs, -1.0)
        LLVMKernel(build(_unary_state(xs.size, vector, te.exp)))(xs, out)
        ulps = np.abs(out[normal].view(np.int32).astype(np.int64) - want[normal].view(np.int32).astype(np.int64))
        assert ulps.max() <= 1, (vector, xs[normal][ulps.argmax()])
        small = ~normal & np.isfinite(want)           # subnormal results and 0: within a subnormal step
        assert np.all(np.abs(out[small] - want64[small]) <= 2e-45)
        assert np.array_equal(np.isinf(out), np.isinf(want)) and np.array_equal(np.isnan(out), np.isnan(xs))


def test_float_tanh_is_within_3_5e_7_of_tanh_odd_bounded_and_propagates_nan():
    xs = np.concatenate([np.linspace(-12, 12, 400_001), np.logspace(-9, 1, 20_000), -np.logspace(-9, 1, 20_000),
                         [0.0, -0.0, 7.9, 7.91, 40.0, -40.0, np.inf, -np.inf, np.nan]]).astype(np.float32)
    want = np.tanh(xs.astype(np.float64))
    for vector in (16, 1):
        out = np.full_like(xs, 2.0)
        LLVMKernel(build(_unary_state(xs.size, vector, te.tanh)))(xs, out)
        finite = ~np.isnan(xs)
        err = np.abs(out[finite] - want[finite])
        assert err.max() <= 3.5e-7 and np.all(err <= 3.5e-7 * np.abs(want[finite]) + 1e-45), vector
        assert np.all(np.abs(out[finite]) <= 1.0) and np.array_equal(np.isnan(out), np.isnan(xs))
        assert np.array_equal(np.signbit(out[finite]), np.signbit(xs[finite]))


def test_vectorised_exp_sigmoid_and_tanh_make_no_libm_call():
    target = parse_target("llvm")
    for fn in (te.exp, te.sigmoid, te.tanh):
        ir = generate_llvm_ir(lower(_unary_state(4096, 16, fn), target_kind="cpu"), target.cpu, target.features,
                              target.num_threads)
        assert not {"expf", "tanhf"} & set(re.findall(r"\w+", assembly(ir, target))) and "llvm.exp" not in ir
