"""CUDA C from a lowered program (TVM's CodeGenCUDA, InjectVirtualThread and LowerThreadAllreduce).

Each root loop nest becomes one `__global__` kernel; a root stage that others read lives in a global
temporary between launches. Loops bound to blockIdx/threadIdx become the launch grid and block (a
loop shorter than its launch dimension is guarded). A `vthread` loop is injected as TVM does: the
statements that use the virtual thread are repeated once per value and the local buffers under it
get one copy per virtual thread, while what does not use it (shared-memory fetches, barriers) runs
once. Shared buffers are declared at the top of the kernel, barriers become `__syncthreads()`, and a
cross-thread reduction becomes a block-level all-reduce (warp shuffles, then shared memory).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tensortune.codegen.ir import (
    Allocate,
    Barrier,
    Buffer,
    BufferLoad,
    For,
    IfThenElse,
    LoweredFunc,
    Seq,
    Stmt,
    Store,
    seq,
    uses,
    walk_stmts,
)
from tensortune.codegen.lower import THREAD_ALLREDUCE
from tensortune.tasks import te
from tensortune.tasks.arith import const_bounds
from tensortune.tasks.te import DTYPE_BYTES, Expr, Var

GRID_AXES = ("blockIdx.x", "blockIdx.y", "blockIdx.z")
BLOCK_AXES = ("threadIdx.x", "threadIdx.y", "threadIdx.z")
_CTYPE = {"float32": "float", "float64": "double", "int8": "signed char", "int16": "short", "int32": "int",
          "int64": "long long", "uint8": "unsigned char", "bool": "bool"}
_SHUFFLE_TYPE = {"float32": "float", "float64": "double", "int64": "long long"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "and": "&&", "or": "||"}
_UNARY_F32 = {"exp": "expf", "log": "logf", "sqrt": "sqrtf", "rsqrt": "rsqrtf", "tanh": "tanhf", "erf": "erff",
              "abs": "fabsf", "floor": "floorf", "ceil": "ceilf", "sin": "sinf", "cos": "cosf"}

PRELUDE = """#ifndef TENSORTUNE_CUDA_PRELUDE
#define TENSORTUNE_CUDA_PRELUDE
template <typename T> __device__ __forceinline__ T tt_floordiv(T a, T b) {
  T q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
template <typename T> __device__ __forceinline__ T tt_floormod(T a, T b) {
  T m = a % b; return (m != 0 && ((m < 0) != (b < 0))) ? m + b : m; }
template <typename T> __device__ __forceinline__ T tt_max(T a, T b) { return a > b ? a : b; }
template <typename T> __device__ __forceinline__ T tt_min(T a, T b) { return a < b ? a : b; }
#endif
"""


class CudaCodegenError(ValueError):
    """A program the CUDA code generator cannot express (an unsupported dtype, a divergent barrier)."""


@dataclass(frozen=True)
class KernelSpec:
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int                 # static shared memory, all buffers plus the all-reduce scratch
    params: tuple[str, ...]           # buffer names in parameter order (arguments and temporaries)
    writes: tuple[str, ...]           # the parameters it stores to
    vthreads: int                     # the largest vthread extent in the kernel

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


@dataclass(frozen=True)
class CudaModule:
    source: str
    kernels: tuple[KernelSpec, ...]
    temps: tuple[tuple[str, str, int], ...]     # global temporaries: (buffer name, dtype, elements)


# ------------------------------------------------------------------------------ statement utilities

def _map_stmt(s: Stmt, fe) -> Stmt:
    """The same statement tree with every expression passed through fe (Store targets via fe_store)."""
    if isinstance(s, Seq):
        return Seq([_map_stmt(c, fe) for c in s.stmts])
    if isinstance(s, For):
        return For(s.var, s.extent, s.kind, _map_stmt(s.body, fe), dict(s.pragmas))
    if isinstance(s, IfThenElse):
        return IfThenElse(fe(s.cond), _map_stmt(s.then, fe), None if s.orelse is None else _map_stmt(s.orelse, fe))
    if isinstance(s, Allocate):
        return Allocate(s.buffer, _map_stmt(s.body, fe))
    if isinstance(s, Store):
        target = fe(BufferLoad(s.buffer, (s.index,)))
        return Store(target.buffer, target.index, fe(s.value))
    return s


def _self_updating(s: Stmt) -> bool:
    """Whether some store in s reads the location it writes (running it twice is not running it once)."""
    for x in walk_stmts(s):
        if isinstance(x, Store) and any(isinstance(n, BufferLoad) and n.buffer is x.buffer for n in te.walk(x.value)):
            return True
    return False


# ------------------------------------------------------------------------------ virtual threads

class _VThreadInjector:
    """Push one vthread loop down to the statements that use its variable."""

    def __init__(self, var: Var, extent: int):
        self.v, self.n = var, extent
        self.expanded: dict[Buffer, tuple[Buffer, int]] = {}

    def _depends(self, s: Stmt) -> bool:
        vars_, bufs = uses(s)
        return self.v in vars_ or any(b in self.expanded for b in bufs)

    def _depends_expr(self, e: Expr) -> bool:
        return any(n is self.v or (isinstance(n, BufferLoad) and n.buffer in self.expanded) for n in te.walk(e))

    def _expand(self, e: Expr) -> Expr:
        def repl(n):
            if isinstance(n, BufferLoad) and n.buffer in self.expanded:
                nb, size = self.expanded[n.buffer]
                return BufferLoad(nb, (self.v * size + n.index,))
            return None
        return te.transform(e, repl)

    def _copies(self, s: Stmt) -> Stmt:
        s = _map_stmt(s, self._expand)
        return seq([_map_stmt(s, lambda e, i=i: te.substitute(e, {self.v: te.const(i)})) for i in range(self.n)])

    def visit(self, s: Stmt) -> Stmt:
        if isinstance(s, Allocate):
            if s.buffer.scope == "local":
                b = s.buffer
                nb = Buffer(b.name, b.dtype, (self.n * b.size,), (1,), "local")
                self.expanded[b] = (nb, b.size)
                return Allocate(nb, self.visit(s.body))
            return Allocate(s.buffer, self.visit(s.body))
        if not self._depends(s):
            # the same work for every virtual thread: once, unless it accumulates
            return For(self.v, self.n, "serial", s) if _self_updating(s) else s
        if isinstance(s, Seq):
            return seq([self.visit(c) for c in s.stmts])
        if isinstance(s, For):
            return For(s.var, s.extent, s.kind, self.visit(s.body), dict(s.pragmas))
        if isinstance(s, IfThenElse) and not self._depends_expr(s.cond):
            return IfThenElse(s.cond, self.visit(s.then), None if s.orelse is None else self.visit(s.orelse))
        return self._copies(s)


def inject_virtual_threads(s: Stmt) -> Stmt:
    """Replace every vthread loop (innermost first) by its injected body."""
    if isinstance(s, Seq):
        return Seq([inject_virtual_threads(c) for c in s.stmts])
    if isinstance(s, IfThenElse):
        return IfThenElse(s.cond, inject_virtual_threads(s.then),
                          None if s.orelse is None else inject_virtual_threads(s.orelse))
    if isinstance(s, Allocate):
        return Allocate(s.buffer, inject_virtual_threads(s.body))
    if isinstance(s, For):
        body = inject_virtual_threads(s.body)
        if s.kind == "vthread":
            if s.extent == 1:
                return _map_stmt(body, lambda e: te.substitute(e, {s.var: te.const(0)}))
            return _VThreadInjector(s.var, s.extent).visit(body)
        return For(s.var, s.extent, s.kind, body, dict(s.pragmas))
    return s


# ------------------------------------------------------------------------------ emission

def _sanitize(name: str) -> str:
    out = re.sub(r"[^0-9a-zA-Z_]", "_", name).strip("_") or "v"
    return out if not out[0].isdigit() else "v" + out


def _float_literal(v: float, dtype: str) -> str:
    if math.isnan(v):
        return "__int_as_float(0x7fc00000)" if dtype == "float32" else "__longlong_as_double(0x7ff8000000000000LL)"
    if math.isinf(v):
        if dtype == "float32":
            return "__int_as_float(0x7f800000)" if v > 0 else "__int_as_float(0xff800000)"
        return "__longlong_as_double(0x7ff0000000000000LL)" if v > 0 else "__longlong_as_double(0xfff0000000000000LL)"
    if dtype == "float32" and abs(v) > 3.4028234663852886e38:
        return _float_literal(math.copysign(math.inf, v), dtype)
    text = repr(float(v))
    return f"{text}f" if dtype == "float32" else text


class _Kernel:
    def __init__(self, name: str, body: Stmt, args: list[Buffer], temps: list[Buffer], index_type: str):
        self.name, self.index_type = name, index_type
        vthreads = [s.extent for s in walk_stmts(body) if isinstance(s, For) and s.kind == "vthread"]
        self.vthreads = max(vthreads, default=1)
        self.body = inject_virtual_threads(body)
        self.dims: dict[str, int] = {}
        shared: dict[Buffer, None] = {}
        for s in walk_stmts(self.body):
            if isinstance(s, For) and s.kind in GRID_AXES + BLOCK_AXES:
                self.dims[s.kind] = max(self.dims.get(s.kind, 1), s.extent)
            if isinstance(s, Allocate) and s.buffer.scope == "shared":
                shared.setdefault(s.buffer)
        self.shared = list(shared)
        self.grid = _dim3(self.dims, GRID_AXES)
        self.block = _dim3(self.dims, BLOCK_AXES)
        _, used = uses(self.body)
        stored = {s.buffer for s in walk_stmts(self.body) if isinstance(s, Store)}
        self.params = [b for b in args + temps if b in used]
        self.written = stored
        self.names: dict = {}
        self.taken: set[str] = set()
        self.ranges: dict[Var, tuple[int, int]] = {}
        self.thread_vars: set[Var] = set()
        self.lines: list[str] = []
        self.reduce_types: set[str] = set()
        for s in walk_stmts(self.body):
            if isinstance(s, Store) and isinstance(s.value, te.Call) and s.value.name.startswith(THREAD_ALLREDUCE):
                if self.block[0] > 32:
                    self.reduce_types.add(_SHUFFLE_TYPE.get(s.value.dtype, "int"))

    # -------------------------------------------------------------- names and types

    def name_of(self, obj) -> str:
        if obj not in self.names:
            base = _sanitize(obj.name)
            name, i = base, 1
            while name in self.taken:
                name, i = f"{base}_{i}", i + 1
            self.taken.add(name)
            self.names[obj] = name
        return self.names[obj]

    def ctype(self, dtype: str) -> str:
        if dtype == "int64" and self.index_type == "int":
            return "int"
        if dtype not in _CTYPE:
            raise CudaCodegenError(f"the CUDA backend does not support dtype {dtype}")
        return _CTYPE[dtype]

    @property
    def shared_bytes(self) -> int:
        scratch = 32 * sum(8 if t in ("double", "long long") else 4 for t in self.reduce_types)
        return sum(b.size * DTYPE_BYTES[b.dtype] for b in self.shared) + scratch

    # -------------------------------------------------------------- statements

    def emit(self, line: str, depth: int) -> None:
        self.lines.append("  " * depth + line)

    def source(self) -> str:
        for b in self.params:
            self.name_of(b)
        params = ", ".join(f"{'const ' if b not in self.written else ''}{self.ctype(b.dtype)}* __restrict__ "
                           f"{self.name_of(b)}" for b in self.params)
        threads = self.block[0] * self.block[1] * self.block[2]
        head = [f'extern "C" __global__ void __launch_bounds__({threads}) {self.name}({params}) {{']
        for b in self.shared:
            head.append(f"  __shared__ {self.ctype(b.dtype)} {self.name_of(b)}[{b.size}];")
        for t in sorted(self.reduce_types):
            head.append(f"  __shared__ {t} tt_red_{t.replace(' ', '_')}[32];")
        self.stmt(self.body, 1, False)
        return "\n".join(head + self.lines + ["}"]) + "\n"

    def stmt(self, s: Stmt, d: int, divergent: bool) -> None:
        if isinstance(s, Seq):
            for c in s.stmts:
                self.stmt(c, d, divergent)
        elif isinstance(s, For):
            self.loop(s, d, divergent)
        elif isinstance(s, Store):
            if isinstance(s.value, te.Call) and s.value.name.startswith(THREAD_ALLREDUCE):
                self.allreduce(s, s.value, d, divergent)
            else:
                self.emit(f"{self.name_of(s.buffer)}[{self.ex(s.index)}] = {self.ex(s.value)};", d)
        elif isinstance(s, IfThenElse):
            div = divergent or bool(te.free_vars(s.cond) & self.thread_vars)
            self.emit(f"if ({self.ex(s.cond)}) {{", d)
            self.stmt(s.then, d + 1, div)
            if s.orelse is not None:
                self.emit("} else {", d)
                self.stmt(s.orelse, d + 1, div)
            self.emit("}", d)
        elif isinstance(s, Allocate):
            if s.buffer.scope == "shared":
                self.stmt(s.body, d, divergent)
                return
            self.emit(f"{{ {self.ctype(s.buffer.dtype)} {self.name_of(s.buffer)}[{s.buffer.size}];", d)
            self.stmt(s.body, d + 1, divergent)
            self.emit("}", d)
        elif isinstance(s, Barrier):
            if divergent:
                raise CudaCodegenError(f"{self.name}: a barrier under a condition that differs between threads")
            self.emit("__syncthreads();", d)
        else:
            raise CudaCodegenError(f"cannot generate CUDA for {type(s).__name__}")

    def loop(self, s: For, d: int, divergent: bool) -> None:
        v = self.name_of(s.var)
        it = self.index_type
        self.ranges[s.var] = (0, s.extent - 1)
        if s.kind in GRID_AXES + BLOCK_AXES:
            axis, comp = s.kind.split(".")
            self.emit(f"{{ const {it} {v} = ({it}){axis}.{comp};", d)
            if s.kind in BLOCK_AXES:
                self.thread_vars.add(s.var)
            if s.extent < self.dims[s.kind]:
                self.emit(f"if ({v} < {s.extent}) {{", d + 1)
                self.stmt(s.body, d + 2, True)
                self.emit("}", d + 1)
            else:
                self.stmt(s.body, d + 1, divergent)
            self.emit("}", d)
            return
        if s.extent == 1:
            self.emit(f"{{ const {it} {v} = 0;", d)
            self.stmt(s.body, d + 1, divergent)
            self.emit("}", d)
            return
        if s.kind in ("unroll", "vectorize"):
            self.emit("#pragma unroll", d)
        self.emit(f"for ({it} {v} = 0; {v} < {s.extent}; ++{v}) {{", d)
        self.stmt(s.body, d + 1, divergent)
        self.emit("}", d)

    def allreduce(self, s: Store, call: te.Call, d: int, divergent: bool) -> None:
        """All threads of the block combine their value; every thread gets the (same) result. `call` is
        s.value, the all-reduce intrinsic."""
        if divergent:
            raise CudaCodegenError(f"{self.name}: a block-level reduction under a condition that differs "
                                   "between threads")
        if self.block[1] != 1 or self.block[2] != 1:
            raise CudaCodegenError(f"{self.name}: a cross-thread reduction needs a one-dimensional thread block")
        combiner = call.name.split(".")[-1]
        dtype = call.dtype
        st = _SHUFFLE_TYPE.get(dtype, "int")
        op = {"sum": "({a} + {b})", "max": "tt_max({a}, {b})", "min": "tt_min({a}, {b})"}[combiner]
        n = self.block[0]
        e = lambda line, k=1: self.emit(line, d + k)  # noqa: E731
        self.emit(f"{{ {st} tt_v = ({st})({self.ex(call.args[0])});", d)
        if n > 1:
            warps, last = -(-n // 32), n - 32 * (-(-n // 32) - 1)
            e("const int tt_lane = threadIdx.x & 31, tt_warp = threadIdx.x >> 5;")
            e(f"const int tt_n = tt_warp == {warps - 1} ? {last} : 32;")
            full = "0xffffffffu" if last == 32 else f"(tt_warp == {warps - 1} ? {hex((1 << last) - 1)}u : 0xffffffffu)"
            e(f"const unsigned tt_mask = {full};")
            off = 16
            while off >= 1:
                if off < min(n, 32):
                    e(f"{{ {st} tt_o = __shfl_down_sync(tt_mask, tt_v, {off}, 32); "
                      f"if (tt_lane + {off} < tt_n) tt_v = {op.format(a='tt_v', b='tt_o')}; }}")
                off //= 2
            if warps == 1:
                e("tt_v = __shfl_sync(tt_mask, tt_v, 0, 32);")
            else:
                buf = f"tt_red_{st.replace(' ', '_')}"
                e("__syncthreads();")
                e(f"if (tt_lane == 0) {buf}[tt_warp] = tt_v;")
                e("__syncthreads();")
                e(f"tt_v = {buf}[0];")
                for w in range(1, warps):
                    e(f"tt_v = {op.format(a='tt_v', b=f'{buf}[{w}]')};")
        e(f"{self.name_of(s.buffer)}[{self.ex(s.index)}] = ({self.ctype(dtype)})tt_v;")
        self.emit("}", d)

    # -------------------------------------------------------------- expressions

    def ex(self, e: Expr) -> str:
        if isinstance(e, BufferLoad):
            return f"{self.name_of(e.buffer)}[{self.ex(e.index)}]"
        if isinstance(e, Var):
            return self.name_of(e)
        if isinstance(e, te.Const):
            return self.const(e)
        if isinstance(e, te.BinOp):
            return self.binop(e)
        if isinstance(e, te.Cmp):
            return f"({self.ex(e.a)} {_INFIX[e.op]} {self.ex(e.b)})"
        if isinstance(e, te.Not):
            return f"(!{self.ex(e.a)})"
        if isinstance(e, te.Select):
            return f"({self.ex(e.cond)} ? {self.ex(e.t)} : {self.ex(e.f)})"
        if isinstance(e, te.Cast):
            return f"(({self.ctype(e.dtype)})({self.ex(e.value)}))"
        if isinstance(e, te.Call):
            return self.call(e)
        raise CudaCodegenError(f"cannot generate CUDA for expression {type(e).__name__}")

    def const(self, e: te.Const) -> str:
        if e.dtype == "bool":
            return "true" if e.value else "false"
        if te.is_float(e.dtype):
            if e.dtype not in ("float32", "float64"):
                raise CudaCodegenError(f"the CUDA backend does not support dtype {e.dtype}")
            return _float_literal(e.value, e.dtype)
        v = int(e.value)
        ty = self.ctype(e.dtype)
        if ty == "long long":
            return f"{v}LL" if v != -(1 << 63) else "(-9223372036854775807LL - 1)"
        if v == -(1 << 31):
            return "(-2147483647 - 1)"
        return str(v) if v >= 0 else f"({v})"

    def binop(self, e: te.BinOp) -> str:
        a, b = self.ex(e.a), self.ex(e.b)
        if e.op in ("min", "max"):
            return f"tt_{e.op}({a}, {b})"
        if e.op in ("floordiv", "floormod"):
            if te.is_float(e.dtype):
                f = "floorf" if e.dtype == "float32" else "floor"
                return f"{f}({a} / {b})" if e.op == "floordiv" else f"({a} - {f}({a} / {b}) * {b})"
            nonneg = isinstance(e.b, te.Const) and e.b.value > 0 and const_bounds(e.a, self.ranges)[0] >= 0
            if nonneg:
                return f"({a} {'/' if e.op == 'floordiv' else '%'} {b})"
            return f"tt_{e.op}<{self.ctype(e.dtype)}>({a}, {b})"
        return f"({a} {_INFIX[e.op]} {b})"

    def call(self, e: te.Call) -> str:
        args = [self.ex(a) for a in e.args]
        f32 = e.dtype == "float32"
        if e.name == "sigmoid":
            one = "1.0f" if f32 else "1.0"
            return f"({one} / ({one} + {'expf' if f32 else 'exp'}(-({args[0]}))))"
        if e.name == "pow":
            return f"{'powf' if f32 else 'pow'}({args[0]}, {args[1]})"
        if e.name == "abs" and not te.is_float(e.dtype):
            return f"(({args[0]}) < 0 ? -({args[0]}) : ({args[0]}))"
        if e.name in _UNARY_F32:
            if e.dtype not in ("float32", "float64"):
                raise CudaCodegenError(f"the CUDA backend does not support {e.name} on {e.dtype}")
            fn = _UNARY_F32[e.name] if f32 else _UNARY_F32[e.name][:-1]
            return f"{fn}({args[0]})"
        raise CudaCodegenError(f"unknown intrinsic {e.name!r}")


def split_kernels(func: LoweredFunc) -> tuple[list[Buffer], list[Stmt]]:
    """Peel the global temporaries off the body and split it into root nests (one kernel each)."""
    body, temps = func.body, []
    while isinstance(body, Allocate):
        temps.append(body.buffer)
        body = body.body
    return temps, list(body.stmts) if isinstance(body, Seq) else [body]


def _index_type(func: LoweredFunc, temps: list[Buffer], nests: list[Stmt]) -> str:
    """32-bit indexing (what GPUs are fast at) unless a buffer or a loop nest needs 64 bits, or int64
    data shares the dtype name with index arithmetic."""
    buffers = list(func.args) + temps
    for nest in nests:
        buffers += [s.buffer for s in walk_stmts(nest) if isinstance(s, Allocate)]
    if any(b.dtype == "int64" for b in buffers) or any(b.size >= 2 ** 31 for b in buffers):
        return "long long"
    return "int"


def _dim3(dims: dict[str, int], axes: tuple[str, str, str]) -> tuple[int, int, int]:
    """A launch dimension (x, y, z) from the loops bound to `axes`; an axis no loop binds is 1."""
    x, y, z = (dims.get(a, 1) for a in axes)
    return x, y, z


def generate_cuda(func: LoweredFunc) -> CudaModule:
    """The CUDA C module of a lowered program: kernels `<name>_kernel<i>`, launched in order."""
    temps, nests = split_kernels(func)
    index_type = _index_type(func, temps, nests)
    parts, specs = [PRELUDE], []
    for i, nest in enumerate(nests):
        k = _Kernel(f"{func.name}_kernel{i}", nest, list(func.args), temps, index_type)
        parts.append(k.source())
        specs.append(KernelSpec(k.name, k.grid, k.block, k.shared_bytes, tuple(b.name for b in k.params),
                                tuple(b.name for b in k.params if b in k.written), k.vthreads))
    return CudaModule("\n".join(parts), tuple(specs), tuple((b.name, b.dtype, b.size) for b in temps))
