"""The LLVM backend emits what the design promises: wide vectors, unrolled tiles, a persistent pool."""
from __future__ import annotations

import re

import numpy as np

from codegen.llvm_backend import LLVMKernel, assembly, build
from codegen.llvm_codegen import generate_llvm_ir
from codegen.lower import lower
from codegen.target import parse_target
from search.state import State
from tasks.workload_registry import make_dag
from tests.conftest import check_state


def _register_tiled_matmul(n: int = 128) -> State:
    s = State(make_dag("matmul", n, n, n)).cache_write("C", "local")
    s = s.split("C.local", 0, [8, 4]).split("C.local", 3, [2, 32]).split("C.local", 6, [16])
    s = s.reorder("C.local", [0, 3, 6, 1, 4, 7, 2, 5]).unroll("C.local", 6).vectorize("C.local", 7)
    s = s.split("C", 0, [32]).split("C", 2, [64]).reorder("C", [0, 2, 1, 3]).fuse("C", [0, 1])
    s = s.parallel("C", 0).vectorize("C", 2)
    return s.compute_at("C.local", "C", 0)


def test_vectorized_kernel_uses_512_bit_registers():
    target = parse_target("llvm")
    if "+avx512f" not in target.features:
        import pytest
        pytest.skip("host has no AVX-512")
    ir = generate_llvm_ir(lower(_register_tiled_matmul()), target.cpu, target.features)
    # the 32-wide vectorized loop is emitted as two native 16-float vectors
    assert "<16 x float>" in ir and "<32 x float>" not in ir and "llvm.fmuladd" in ir
    asm = assembly(ir, target)
    assert re.search(r"\bzmm\d+\b", asm), "expected 512-bit zmm registers in the register tile"
    assert "vfmadd" in asm


def test_register_tiled_matmul_is_correct():
    check_state(_register_tiled_matmul(96))


def test_parallel_loops_run_on_the_gomp_pool():
    s = _register_tiled_matmul()
    ir = generate_llvm_ir(lower(s), "generic", "")
    assert "@GOMP_parallel" in ir and "define internal void @default_function_par1" in ir


def test_kernel_is_reusable_and_checks_arguments():
    s = _register_tiled_matmul(64)
    k = LLVMKernel(build(s))
    a, b = s.dag.random_inputs()
    c = np.zeros((64, 64), np.float32)
    for _ in range(3):
        k(a, b, c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    import pytest
    with pytest.raises(ValueError, match=r"argument C must be float32\[64, 64\]"):
        k(a, b, np.zeros((64, 63), np.float32))
