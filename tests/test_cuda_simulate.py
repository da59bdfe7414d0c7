"""GPU semantics without a GPU: the kernels' loop programs (after vthread injection) run in a
lockstep simulator of CUDA blocks and are compared with the NumPy reference.

Lockstep execution is one legal schedule of a race-free kernel, so this checks what the GPU would
compute — shared regions relaxed over the block's threads, virtual threads, guards, the block
all-reduce — and flags what no schedule may do: a barrier or an all-reduce reached by only some
threads, two threads storing different values to one address, an out-of-bounds access, a read of
shared or local memory nothing wrote (NaN-poisoned). Races between barriers it cannot see; the GPU
tests run the same programs for real.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tensortune.codegen.cuda_codegen import BLOCK_AXES, GRID_AXES, generate_cuda, inject_virtual_threads, split_kernels
from tensortune.codegen.ir import Allocate, Barrier, Buffer, BufferLoad, For, IfThenElse, Seq, Stmt, Store
from tensortune.codegen.lower import THREAD_ALLREDUCE, lower
from tensortune.schedule.state import State
from tensortune.tasks import te
from tensortune.tasks.reference import evaluate, mismatch
from tests.conftest import GPU_WORKLOADS
from tests.test_cuda_codegen import gpu_programs

_UNARY = {"exp": np.exp, "log": np.log, "sqrt": np.sqrt, "tanh": np.tanh, "abs": np.abs, "floor": np.floor,
          "ceil": np.ceil, "sin": np.sin, "cos": np.cos, "rsqrt": lambda x: 1 / np.sqrt(x),
          "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "erf": np.vectorize(math.erf, otypes=[np.float64])}
_BIN = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "min": np.minimum,
        "max": np.maximum, "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
        "eq": np.equal, "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or}


class SimulationError(AssertionError):
    pass


def _np_dtype(dtype: str):
    return np.float64 if te.is_float(dtype) else (bool if dtype == "bool" else np.dtype(dtype))


class BlockSimulator:
    """Runs one kernel body for every block of its grid, all threads of a block in lockstep."""

    def __init__(self, body: Stmt, grid, block, memory: dict[Buffer, np.ndarray]):
        self.body, self.grid, self.block, self.memory = body, grid, block, memory
        self.n = block[0] * block[1] * block[2]
        tid = np.arange(self.n)
        self.tid = tid
        self.thread = {"threadIdx.x": tid % block[0], "threadIdx.y": (tid // block[0]) % block[1],
                       "threadIdx.z": tid // (block[0] * block[1])}

    def run(self) -> None:
        gx, gy, gz = self.grid
        for b in range(gx * gy * gz):
            self.blk = {"blockIdx.x": b % gx, "blockIdx.y": (b // gx) % gy, "blockIdx.z": b // (gx * gy)}
            self.env: dict = {}
            self.scoped: dict[Buffer, np.ndarray] = {}
            self.stmt(self.body, np.ones(self.n, bool))

    # ------------------------------------------------------------------ statements

    def stmt(self, s: Stmt, mask: np.ndarray) -> None:
        if isinstance(s, Seq):
            for c in s.stmts:
                self.stmt(c, mask)
        elif isinstance(s, For):
            if s.kind in GRID_AXES:
                if self.blk[s.kind] < s.extent:
                    self.env[s.var] = self.blk[s.kind]
                    self.stmt(s.body, mask)
            elif s.kind in BLOCK_AXES:
                vals = self.thread[s.kind]
                self.env[s.var] = vals
                self.stmt(s.body, mask & (vals < s.extent))
            else:
                for i in range(s.extent):
                    self.env[s.var] = i
                    self.stmt(s.body, mask)
        elif isinstance(s, IfThenElse):
            c = np.broadcast_to(np.asarray(self.ev(s.cond, mask), bool), (self.n,))
            self.stmt(s.then, mask & c)
            if s.orelse is not None:
                self.stmt(s.orelse, mask & ~c)
        elif isinstance(s, Allocate):
            b = s.buffer
            shape = (self.n, b.size) if b.scope == "local" else (b.size,)
            self.scoped[b] = np.full(shape, np.nan) if te.is_float(b.dtype) else np.zeros(shape, _np_dtype(b.dtype))
            self.stmt(s.body, mask)
        elif isinstance(s, Barrier):
            if not mask.all():
                raise SimulationError("__syncthreads() reached by only some threads of a block")
        elif isinstance(s, Store):
            self.store(s, mask)
        else:
            raise SimulationError(f"unknown statement {type(s).__name__}")

    def _array(self, b: Buffer) -> np.ndarray:
        return self.scoped[b] if b in self.scoped else self.memory[b]

    def _index(self, b: Buffer, e, mask) -> np.ndarray:
        idx = np.broadcast_to(np.asarray(self.ev(e, mask)), (self.n,)).astype(np.int64)
        bad = mask & ((idx < 0) | (idx >= b.size))
        if bad.any():
            raise SimulationError(f"{b.name}[{idx[bad][0]}] is out of bounds (size {b.size})")
        return np.where(mask, idx, 0)

    def store(self, s: Store, mask) -> None:
        if not mask.any():
            return
        b, arr = s.buffer, self._array(s.buffer)
        idx = self._index(b, s.index, mask)
        if isinstance(s.value, te.Call) and s.value.name.startswith(THREAD_ALLREDUCE):
            if not mask.all():
                raise SimulationError("a block all-reduce reached by only some threads")
            v = np.broadcast_to(np.asarray(self.ev(s.value.args[0], mask)), (self.n,))
            red = {"sum": np.sum, "max": np.max, "min": np.min}[s.value.name.split(".")[-1]]
            val = np.full(self.n, red(v))
        else:
            val = np.broadcast_to(np.asarray(self.ev(s.value, mask)), (self.n,))
        if b.scope == "local":
            arr[self.tid[mask], idx[mask]] = val[mask]
            return
        where, what = idx[mask], val[mask]
        if len(np.unique(where)) != len(where):
            order = np.argsort(where, kind="stable")
            w, v = where[order], what[order]
            same = w[1:] == w[:-1]
            if np.any(same & ~((v[1:] == v[:-1]) | (np.isnan(v[1:]) & np.isnan(v[:-1])))):
                raise SimulationError(f"threads store different values to the same element of {b.name}")
        arr[where] = what

    # ------------------------------------------------------------------ expressions

    def ev(self, e, mask):
        if isinstance(e, BufferLoad):
            b = e.buffer
            idx = self._index(b, e.index, mask)
            arr = self._array(b)
            return arr[self.tid, idx] if arr.ndim == 2 else arr[idx]
        if isinstance(e, te.Var):
            return self.env[e]
        if isinstance(e, te.Const):
            return e.value
        if isinstance(e, te.BinOp):
            a, b = self.ev(e.a, mask), self.ev(e.b, mask)
            with np.errstate(all="ignore"):
                if e.op == "floordiv":
                    return np.floor_divide(a, b) if not te.is_float(e.dtype) else np.floor(np.divide(a, b))
                if e.op == "floormod":
                    return np.mod(a, b)
                return _BIN[e.op](a, b)
        if isinstance(e, te.Cmp):
            return _BIN[e.op](self.ev(e.a, mask), self.ev(e.b, mask))
        if isinstance(e, te.Not):
            return np.logical_not(self.ev(e.a, mask))
        if isinstance(e, te.Select):
            c = np.broadcast_to(np.asarray(self.ev(e.cond, mask), bool), (self.n,))
            return np.where(c, self.ev(e.t, mask & c), self.ev(e.f, mask & ~c))
        if isinstance(e, te.Call):
            args = [np.asarray(self.ev(a, mask), np.float64) for a in e.args]
            with np.errstate(all="ignore"):
                return np.power(*args) if e.name == "pow" else _UNARY[e.name](args[0])
        if isinstance(e, te.Cast):
            v = np.asarray(self.ev(e.value, mask))
            if not te.is_float(e.dtype) and te.is_float(e.value.dtype):
                v = np.trunc(np.nan_to_num(v))
            return v.astype(_np_dtype(e.dtype))
        raise SimulationError(f"unknown expression {type(e).__name__}")


def simulate(state: State, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The outputs the CUDA kernels of `state` compute, by lockstep simulation of every block."""
    func = lower(state, target_kind="cuda")
    module = generate_cuda(func)
    temps, nests = split_kernels(func)
    memory: dict[Buffer, np.ndarray] = {}
    n_in = len(state.dag.inputs)
    for i, b in enumerate(func.args):
        if i < n_in:
            memory[b] = np.asarray(inputs[i], _np_dtype(b.dtype)).reshape(-1).copy()
        else:
            memory[b] = np.full(b.size, np.nan) if te.is_float(b.dtype) else np.zeros(b.size, _np_dtype(b.dtype))
    for b in temps:
        memory[b] = np.full(b.size, np.nan) if te.is_float(b.dtype) else np.zeros(b.size, _np_dtype(b.dtype))
    for spec, nest in zip(module.kernels, nests):
        BlockSimulator(inject_virtual_threads(nest), spec.grid, spec.block, memory).run()
    return [memory[b].reshape(t.shape).astype(t.dtype) for b, t in zip(func.args[n_in:], state.dag.outputs)]


def check_simulated(state: State, seed: int = 0) -> None:
    inputs = state.dag.random_inputs(seed)
    for t, out, ref in zip(state.dag.outputs, simulate(state, inputs), evaluate(state.dag, inputs)):
        bad = mismatch(out, ref)
        assert bad is None, f"{t.name}: {bad}\nsteps: {state.steps_json()}"


# Simulating F(4, 3)'s 6 x 6 transforms thread by thread takes 17 s; F(2, 3) runs the same code: -m slow.
@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.slow) if k == "conv2d_winograd_f4" else k
                                 for k in sorted(GPU_WORKLOADS)])
def test_sampled_gpu_programs_compute_the_reference(key):
    for state in gpu_programs(key):
        check_simulated(state)


@pytest.mark.parametrize("threads", [80, 256])
def test_block_allreduce_program_over_several_warps(threads):
    from tensortune.codegen.target import make_task
    from tensortune.tasks.workload_registry import make_dag
    dag = make_task(make_dag("norm", 3, 40, 50), "cuda -arch=sm_90").dag
    state = State(dag)
    sid = state.stage_id("T_sum_sq")
    state = state.fuse(sid, [1, 2]).split(sid, 1, [threads]).bind(sid, 2, "threadIdx.x").bind(sid, 0, "blockIdx.x")
    out = state.stage_id("T_norm")
    state = state.split(out, 0, [3]).bind(out, 1, "threadIdx.x")
    check_simulated(state)
