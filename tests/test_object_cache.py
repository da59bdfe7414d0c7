"""Programs whose steps differ but whose LLVM IR is the same are compiled once per process
(codegen.object_cache): the bounded cache itself, then real builds of two auto-unroll depths that
unroll the same loops, each kernel checked against the NumPy reference."""
from __future__ import annotations

import pytest

from tensortune.codegen import llvm_backend
from tensortune.codegen.llvm_codegen import generate_llvm_ir
from tensortune.codegen.lower import lower
from tensortune.codegen.object_cache import ObjectCache
from tensortune.schedule.state import State
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import check_state


def test_a_hit_is_not_compiled_and_the_oldest_object_goes_first():
    cache = ObjectCache(max_bytes=10)
    compiled: list[str] = []

    def compile_(ir: str, obj: bytes):
        return lambda: compiled.append(ir) or obj

    assert cache.get_or_compile("a", "cpu", "", compile_("a", b"AAAA")) == b"AAAA"
    assert cache.get_or_compile("b", "cpu", "", compile_("b", b"BBBB")) == b"BBBB"
    assert cache.get_or_compile("a", "cpu", "", compile_("a", b"new")) == b"AAAA"   # a is now the most recent
    assert compiled == ["a", "b"] and (cache.hits, cache.misses) == (1, 2)
    cache.get_or_compile("c", "cpu", "", compile_("c", b"CCCC"))                   # 12 bytes: b goes
    assert len(cache) == 2 and cache.nbytes == 8
    assert cache.get_or_compile("b", "cpu", "", compile_("b", b"BBBB")) == b"BBBB" and compiled[-1] == "b"
    # the same IR for another CPU or other features is another compilation
    cache.get_or_compile("c", "other", "", compile_("c", b"X"))
    cache.get_or_compile("c", "cpu", "+avx512f", compile_("c", b"Y"))
    assert compiled[-2:] == ["c", "c"]
    # an object larger than the whole cache is returned, not kept
    for _ in range(2):
        assert cache.get_or_compile("big", "cpu", "", compile_("big", b"B" * 11)) == b"B" * 11
    assert compiled[-2:] == ["big", "big"] and cache.nbytes <= 10
    with pytest.raises(ValueError):
        ObjectCache(max_bytes=-1)


def _matmul_unrolled_to(depth: int) -> State:
    """Its innermost loop runs 32 times, so depths 0 and 16 unroll nothing and 64 unrolls it."""
    s = State(make_dag("matmul", 48, 40, 64)).split("C", 2, [32]).vectorize("C", 1)
    return s.pragma("C", 0, f"auto_unroll_max_step${depth}")


def test_two_programs_with_the_same_ir_are_compiled_once(monkeypatch):
    monkeypatch.setattr(llvm_backend, "OBJECTS", ObjectCache())
    none, sixteen, sixty_four = (_matmul_unrolled_to(d) for d in (0, 16, 64))
    assert none.steps != sixteen.steps
    ir = {d: generate_llvm_ir(lower(s), "generic", "") for d, s in ((0, none), (16, sixteen), (64, sixty_four))}
    assert ir[0] == ir[16] != ir[64]
    for state in (none, sixteen, sixty_four):
        check_state(state)                       # builds it, runs it, compares with NumPy
    assert (llvm_backend.OBJECTS.misses, llvm_backend.OBJECTS.hits) == (2, 1)
