"""The LLVM backend emits what the design promises: wide vectors, unrolled tiles, a persistent pool."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tensortune.codegen.llvm_backend import LLVMKernel, assembly, build
from tensortune.codegen.llvm_codegen import generate_llvm_ir
from tensortune.codegen.lower import lower
from tensortune.codegen.target import parse_target
from tensortune.schedule.state import State
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import check_state


def _register_tiled_matmul(n: int = 128) -> State:
    s = State(make_dag("matmul", n, n, n)).cache_write("C", "local")
    s = s.split("C.local", 0, [8, 4]).split("C.local", 3, [2, 32]).split("C.local", 6, [16])
    s = s.reorder("C.local", [0, 3, 6, 1, 4, 7, 2, 5]).unroll("C.local", 6).vectorize("C.local", 7)
    s = s.split("C", 0, [32]).split("C", 2, [64]).reorder("C", [0, 2, 1, 3]).fuse("C", [0, 1])
    s = s.parallel("C", 0).vectorize("C", 2)
    return s.compute_at("C.local", "C", 0)


@pytest.mark.parametrize("cpu, features, lanes, register", [
    ("skylake-avx512", "+avx,+avx2,+fma,+avx512f,+avx512bw,+avx512vl,+avx512dq", 16, "zmm"),
    ("znver3", "+avx,+avx2,+fma", 8, "ymm")])
def test_vectorized_loops_use_the_targets_vector_width(cpu, features, lanes, register):
    """Compiled for an AVX-512 and an AVX2 CPU (whatever this host is): the 32-wide vectorized loop is
    emitted as native vectors of the target's width, and the register tile lives in its registers."""
    target = parse_target(f"llvm -mcpu={cpu} -mattr={features}")
    ir = generate_llvm_ir(lower(_register_tiled_matmul()), target.cpu, target.features)
    assert f"<{lanes} x float>" in ir and "<32 x float>" not in ir and "llvm.fmuladd" in ir
    asm = assembly(ir, target)
    assert re.search(rf"\bvfmadd\w+\s+%{register}\d+", asm), f"expected FMAs on {register} registers"
    wider = {"ymm": "zmm"}.get(register)
    assert wider is None or wider not in asm


def test_kernel_buffers_are_noalias():
    ir = generate_llvm_ir(lower(_register_tiled_matmul()), "generic", "")
    kernel = next(line for line in ir.splitlines() if line.startswith("define") and "@default_function(" in line)
    assert kernel.count("ptr noalias") == 3                      # A, B and C
    body = next(line for line in ir.splitlines() if line.startswith("define") and "_par1_body" in line)
    assert body.count("ptr noalias") == 3                        # the parallel body's too


def test_auto_unroll_pragma_unrolls_short_loops_only_when_asked():
    def tiled(depth: int) -> str:
        s = State(make_dag("matmul", 32, 32, 32)).split("C", 1, [8]).split("C", 3, [4])
        s = s.reorder("C", [0, 1, 3, 4, 2]).pragma("C", 0, f"auto_unroll_max_step${depth}")
        return lower(s).text()
    # TVM's rule: a loop unrolls when its steps times those of the loops inside it fit the budget
    assert '"unroll"' not in tiled(0)
    assert tiled(8).count('"unroll"') == 2 and 'k.1, 0, 4) "unroll"' not in tiled(8)   # j.1: 8; k.1: 32
    assert tiled(64).count('"unroll"') == 3 and 'k.1, 0, 4) "unroll"' in tiled(64)     # k.0: 256 stays

    def rows(width: int) -> str:   # 8 rows of a vectorized copy `width` wide, under a budget of 64 steps
        s = State(make_dag("elementwise", 1, 1, 8, width, "relu")).vectorize("T_relu", 3)
        return lower(s.pragma("T_relu", 0, "auto_unroll_max_step$64")).text()
    # a vector of up to 16 lanes is one step; wider ones are one per 16 lanes (a packing copy's row),
    # so 8 rows of 256 lanes (128 steps) stay a loop instead of 128 vector instructions of straight code
    assert 'for (ax2, 0, 8) "unroll"' in rows(64) and 'for (ax2, 0, 8) "unroll"' not in rows(256)


def test_auto_unroll_counts_unrolled_loops_inside_not_loops_above():
    """TVM's UnrollLoop limits how many unrolled loops nest inside a loop (8), counting loops from the
    inside out, and never counts loops of extent 1 (lets there). Counted from the root, the innermost
    loops of a deep tile nest stayed rolled whatever the pragma: here six loops of extent 1 stand above
    the reduction, which unrolls (8 steps), as does j.4 (2 x (8 + the init) = 18); j.0 (72) stays a loop."""
    s = State(make_dag("matmul", 8, 8, 8)).split("C", 0, [1, 1, 1, 2]).split("C", 5, [1, 1, 1, 2])
    s = s.pragma("C", 0, "auto_unroll_max_step$64")
    text = lower(s).text()
    unrolled = re.findall(r"for \((\w+\.?\d*), 0, (\d+)\) \"unroll\"", text)
    assert sorted(unrolled) == [("j.4", "2"), ("k", "8")], text
    check_state(s)


def test_register_tiled_matmul_is_correct():
    check_state(_register_tiled_matmul(96))


def test_parallel_loops_run_on_the_gomp_pool():
    s = _register_tiled_matmul()
    ir = generate_llvm_ir(lower(s), "generic", "")
    assert "@GOMP_parallel" in ir and "define internal void @default_function_par1" in ir
    # the pool persists: after the first call, further calls start no new threads
    import os
    kernel = LLVMKernel(build(s))
    dag = s.dag
    args = dag.random_inputs() + dag.empty_outputs()
    kernel(*args)
    threads = len(os.listdir("/proc/self/task"))
    for _ in range(20):
        kernel(*args)
    assert len(os.listdir("/proc/self/task")) == threads


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


def test_a_guarded_register_tile_keeps_its_accumulators_out_of_memory():
    """An imperfect split of the vectorized axis (100 columns in 24-wide tiles) guards the tile's stores:
    into the thread's own stack buffer they become select + plain store, which LLVM keeps in registers
    across the reduction loop; masked stores stay only for the copy out to the argument."""
    s = State(make_dag("matmul", 64, 100, 64)).cache_write("C", "local")
    s = s.split("C.local", 0, [4]).split("C.local", 2, [24]).split("C.local", 4, [16])
    s = s.reorder("C.local", [0, 2, 4, 1, 5, 3]).unroll("C.local", 4).vectorize("C.local", 5)
    s = s.split("C", 0, [16]).split("C", 2, [48]).reorder("C", [0, 2, 1, 3]).fuse("C", [0, 1])
    s = s.parallel("C", 0).vectorize("C", 2).compute_at("C.local", "C", 0)
    target = parse_target("llvm")
    ir = generate_llvm_ir(lower(s), target.cpu, target.features)
    base_of = dict(re.findall(r"(%p\d+) = getelementptr inbounds \w+, ptr (%\w+),", ir))
    stack = set(re.findall(r"(%buf\d+) = alloca", ir))
    masked = [base_of.get(p) for p in re.findall(r"@llvm\.masked\.store\.\S+\(<\d+ x float> \S+, ptr (%\w+),", ir)]
    blended = [base_of.get(p) for p in re.findall(r"store <\d+ x float> %blend\d+, ptr (%\w+)", ir)]
    assert stack and masked and blended
    assert not set(masked) & stack and set(blended) <= stack
    check_state(s)


def test_the_timing_loop_runs_the_kernel_every_time():
    """A small serial kernel is a pure function of its noalias buffers: inlined into the `_repeat`
    timing loop, LLVM ran it once for n runs (ResNet-18's 512-channel global pool was recorded at
    0.8 ns). The loop must still call it, and the kernel must still be right."""
    from tensortune.tasks import ops, te
    from tensortune.tasks.compute_dag import ComputeDAG
    data = te.placeholder((1, 512, 1, 1), name="data")
    dag = ComputeDAG([data, ops.global_avg_pool2d_nchw(data)])
    steps = '[["CA",1,2,1],["CR",2],["FU",2,[0,1,2,3]],["PR",1,0,"auto_unroll_max_step$0"],["AN",2,0,2]]'
    state = State.from_json(dag, steps)
    check_state(state)
    target = parse_target("llvm -mcpu=znver3 -mattr=+avx,+avx2,+fma")
    asm = assembly(generate_llvm_ir(lower(state), target.cpu, target.features), target)
    repeat = asm[asm.index("default_function_repeat:"):]
    repeat = repeat[:repeat.index(".Lfunc_end")]
    assert re.search(r"\bcallq?\s", repeat), repeat       # (through the GOT: `callq *%r13`)


def test_annotation_vectorises_a_wide_register_tile_so_llvm_cannot_gather_it():
    """An 8x32 accumulator tile whose 32 columns were left unannotated (TVM's max_vectorize_size 16):
    LLVM's own vectoriser went across the tile's rows with gathers and scatters, 8 GFLOP/s where the
    annotated tile ran 444 (1024^3, Zen 5). With the search's default width the annotation rule
    vectorises the columns, and the kernel holds no gather or scatter and computes the product."""
    import random

    from tensortune.search.annotation import annotate_vectorization
    from tensortune.search.params import SearchParams

    s = State(make_dag("matmul", 256, 256, 256)).cache_write("C", "local")
    s = s.split("C.local", 0, [16, 8]).split("C.local", 3, [1, 32]).split("C.local", 6, [64])
    s = s.reorder("C.local", [0, 3, 6, 1, 4, 7, 2, 5])
    s = s.split("C", 0, [128]).split("C", 2, [32]).reorder("C", [0, 2, 1, 3]).fuse("C", [0, 1]).parallel("C", 0)
    s = s.compute_at("C.local", "C", 0)
    target = parse_target("llvm -mcpu=skylake-avx512 -mattr=+avx,+avx2,+fma,+avx512f,+avx512bw,+avx512vl,+avx512dq")

    def gathers(state: State) -> int:
        asm = assembly(generate_llvm_ir(lower(state), target.cpu, target.features), target)
        return len(re.findall(r"\bv(gather|scatter)", asm))

    narrow = annotate_vectorization(s, random.Random(0), 16)
    assert gathers(narrow) > 0        # the failure the default avoids, on this LLVM
    wide = annotate_vectorization(s, random.Random(0), SearchParams().max_vectorize_size)
    assert wide.stages[wide.stage_id("C.local")].iters[-1].annotation == "vectorize"
    assert gathers(wide) == 0
    check_state(wide)


@pytest.mark.parametrize("vector", [16, 1])
def test_a_sum_of_products_that_fold_to_constants_is_emitted_once_per_term(vector):
    """A Winograd input transform over a zero-padded tile is a sum of `pad_test(tile) ? x : 0` times a
    constant, and where the tile is known (an unrolled or single-iteration loop) half the terms fold
    to constant products. Each term must cost a bounded number of instructions: the fused
    multiply-add used to emit the rest of the chain, fail on the constant product and emit it again,
    2^n copies (a 2x2 image's F(4) transform ran the compiler out of memory). The sum is also checked
    against NumPy on random inputs."""
    from tensortune.tasks import te
    from tensortune.tasks.compute_dag import ComputeDAG
    n, terms = 64, 24
    x = te.placeholder((terms, n), "float32", "x")

    def body(z, j):
        total = te.const(0.0, "float32")
        for i in range(terms):        # term i is live for z = i % 2: a constant zero product otherwise
            total = total + te.if_then_else(z == i % 2, x[i, j], te.const(0.0, "float32")) * (i + 1.5)
        return total
    y = te.compute((2, n), body, name="y")
    state = State(ComputeDAG([x, y])).unroll("y", 0)
    if vector > 1:
        state = state.split("y", 1, [vector]).vectorize("y", 2)
    target = parse_target("llvm")
    ir = generate_llvm_ir(lower(state, target_kind="cpu"), target.cpu, target.features, target.num_threads)
    assert ir.count("\n") < 60 * terms, f"{ir.count(chr(10))} lines of IR for {terms} terms"
    xs = np.random.default_rng(0).standard_normal((terms, n)).astype(np.float32)
    out = np.full((2, n), np.nan, np.float32)
    LLVMKernel(build(state))(xs, out)
    coef = np.arange(terms) + 1.5
    want = np.stack([(coef[z::2, None] * xs[z::2].astype(np.float64)).sum(0) for z in (0, 1)])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vector", [16, 1])
def test_a_shared_subexpression_is_emitted_once_per_statement(vector):
    """A lowered expression is a DAG where a subtree object is used twice (a Winograd transform's sums
    share their tile's loads): the code generator emits such a node once per statement, not once per
    path to it (which made F(4) programs' IR several times longer than its operations). A use under a
    select's mask may load it again (masked), never more. Checked against NumPy on random inputs,
    masked lanes included."""
    from tensortune.tasks import te
    from tensortune.tasks.compute_dag import ComputeDAG
    n = 64
    x = te.placeholder((n,), "float32", "x")

    def body(j):
        s = x[j] * 2.0 + 1.0                 # one object, used seven times
        return s * s + s * s * s + s + te.if_then_else(j < 40, s, te.const(0.0, "float32"))
    y = te.compute((n,), body, name="y")
    state = State(ComputeDAG([x, y]))
    if vector > 1:
        state = state.split("y", 0, [vector]).vectorize("y", 1)
    target = parse_target("llvm")
    ir = generate_llvm_ir(lower(state, target_kind="cpu"), target.cpu, target.features, target.num_threads)
    kernel = ir[ir.index("define void @default_function("):]
    kernel = kernel[:kernel.index("\n}\n")]
    loads = len(re.findall(r"= (load|call \S+ @llvm\.masked\.load)", kernel))
    assert 1 <= loads <= 2, kernel          # one statement emitted: one load, two with the mask
    xs = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    LLVMKernel(build(state))(xs, out)
    s = xs.astype(np.float64) * 2 + 1
    np.testing.assert_allclose(out, s * s + s ** 3 + s + np.where(np.arange(n) < 40, s, 0), rtol=1e-5, atol=1e-5)
