"""LLVM IR text from a lowered program.

The code generator does what LLVM does badly on its own: a `vectorize` loop becomes explicit vector
instructions of the loop's width (contiguous loads, broadcasts, FMAs, masked or gathered accesses
where needed), `unroll` loops are unrolled here, and `parallel` loops are outlined into functions run
by libgomp's persistent thread pool. Each integer value is tracked as uniform, a ramp
(base + stride * lane) or a general vector, so indexing stays scalar wherever it can.
"""
from __future__ import annotations

import struct
from collections import ChainMap
from dataclasses import dataclass

from tensortune.codegen.ir import (
    Allocate,
    Barrier,
    BufferLoad,
    For,
    IfThenElse,
    LoweredFunc,
    Seq,
    Stmt,
    Store,
    stmt_exprs,
    uses,
)
from tensortune.tasks import te
from tensortune.tasks.arith import const_bounds
from tensortune.tasks.te import DTYPE_BYTES, Expr, Var

STACK_LIMIT_BYTES = 64 * 1024

_LLTYPE = {"float32": "float", "float64": "double", "float16": "half", "int8": "i8", "int16": "i16",
           "int32": "i32", "int64": "i64", "uint8": "i8", "bool": "i1"}


class CodegenError(ValueError):
    pass


def _mem_type(dtype: str) -> str:
    return "i8" if dtype == "bool" else _LLTYPE[dtype]


def _float_literal(v: float, dtype: str) -> str:
    """LLVM wants float constants as the exact double of the rounded value, in hex."""
    if dtype in ("float32", "float16"):
        limit = 3.4028234663852886e38 if dtype == "float32" else 65504.0
        if v == v and abs(v) > limit:
            v = float("inf") if v > 0 else float("-inf")
        elif dtype == "float32":
            v = struct.unpack("f", struct.pack("f", v))[0]
        else:
            v = struct.unpack("e", struct.pack("e", v))[0]
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", v))[0]


@dataclass
class Val:
    """An emitted value. lanes == 1: uniform. ramp: (base Val, stride) meaning base + stride * lane."""
    ty: str                      # scalar llvm type
    lanes: int = 1
    ref: str | None = None       # llvm operand (scalar if lanes == 1 else vector)
    const: int | float | None = None   # python constant (uniform; a bool is an int)
    ramp: tuple[Val, int] | None = None

    @property
    def is_const(self) -> bool:
        return self.const is not None and self.lanes == 1

    @property
    def constant(self) -> int | float:
        """The constant of an `is_const` value."""
        if self.const is None:
            raise CodegenError("a value without a constant was used as one")
        return self.const


class _Function:
    """One LLVM function being written: lines, an entry block for allocas, a fresh-name counter."""

    def __init__(self, header: str, module: "_Module"):
        self.header, self.module = header, module
        self.entry: list[str] = []
        self.lines: list[str] = []
        self.exit_lines: list[str] = []
        self.block = "entry"
        self.counter = 0

    def tmp(self, prefix: str = "t") -> str:
        self.counter += 1
        return f"%{prefix}{self.counter}"

    def label(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def emit(self, line: str) -> None:
        self.lines.append("  " + line)

    def start_block(self, name: str) -> None:
        self.lines.append(f"{name}:")
        self.block = name

    def text(self) -> str:
        body = ["entry:"] + ["  " + x for x in self.entry] + self.lines + self.exit_lines
        return f"{self.header} {{\n" + "\n".join(body) + "\n}\n"


class _Module:
    def __init__(self) -> None:
        self.decls: dict[str, str] = {}
        self.functions: list[_Function] = []

    def declare(self, name: str, decl: str) -> None:
        self.decls.setdefault(name, decl)


class LLVMCodegen:
    """Emits one module: the kernel, its outlined parallel bodies, and call wrappers."""

    def __init__(self, func: LoweredFunc, cpu: str, features: str, num_threads: int = 0):
        """num_threads: the threads of every parallel loop, compiled in (0 leaves it to libgomp, which
        reads OMP_NUM_THREADS: only for code that must follow its process's setting)."""
        self.func, self.cpu, self.features, self.num_threads = func, cpu, features, num_threads
        self.module = _Module()
        self.n_outlined = 0
        self.stack_owner: dict = {}     # Buffer -> the function whose stack holds it (thread-private)
        self.root: _Function | None = None   # the kernel's own function (not an outlined parallel body)
        self.n_workspaces = 0
        self._native_lanes: dict[int, int] = {}   # id(For) -> native_lanes (the func keeps its loops alive)
        flags = set(features.split(","))
        self.vector_bits = 512 if "+avx512f" in flags else 256 if "+avx" in flags or "+avx2" in flags else 128

    def native_lanes(self, loop: For) -> int:
        """Lanes of one hardware vector for the widest element type the loop loads or stores
        (index arithmetic is i64 but stays mostly scalar, so it does not count). Memoised per loop: an
        unrolled loop emits the vectorised loop inside it once per iteration."""
        lanes = self._native_lanes.get(id(loop))
        if lanes is None:
            widest = 1
            for e in stmt_exprs(loop.body):
                for n in te.walk_distinct(e):
                    if isinstance(n, BufferLoad):
                        widest = max(widest, DTYPE_BYTES[n.buffer.dtype])
            lanes = self._native_lanes[id(loop)] = max(1, self.vector_bits // (8 * widest))
        return lanes

    # ------------------------------------------------------------------ module

    def generate(self) -> str:
        f = self.func
        params = ", ".join(f"ptr noalias nocapture %arg{i}" for i in range(len(f.args)))
        fn = self.root = _Function(f"define void @{f.name}({params}) #0", self.module)
        state = _EmitState(fn, {b: f"%arg{i}" for i, b in enumerate(f.args)}, {}, None, 1, False, {})
        self._stmt(f.body, state)
        fn.emit("br label %exit")
        fn.lines.append("exit:")
        fn.exit_lines.append("  ret void")
        self.module.functions.insert(0, fn)
        wrappers = self._wrappers()
        attrs = (f'attributes #0 = {{ nounwind "target-cpu"="{self.cpu}" "target-features"="{self.features}" '
                 f'"prefer-vector-width"="512" "min-legal-vector-width"="512" "frame-pointer"="none" }}\n'
                 'attributes #1 = { noinline }')
        # what the last parallel loop ran on, read back by the runner: a kernel that got fewer threads
        # than its target asks for is reported, not timed as if it were the configuration tuned for
        seen = f"@{f.name}_threads = global i32 0, align 4"
        parts = [seen, *self.module.decls.values(), *(fn.text() for fn in self.module.functions), wrappers, attrs]
        return "\n".join(parts) + "\n"

    def _wrappers(self) -> str:
        """`<name>_packed(ptr args)` and `<name>_repeat(ptr args, i64 n)`: one ctypes call times n runs.

        The kernel is a pure function of its noalias buffers, so once inlined into the repeat loop LLVM
        may run a small one once and call it n runs (a 512-float kernel timed at 0.8 ns a run): the call
        stays a call (#1 = noinline) and a memory barrier follows it."""
        f = self.func
        n = len(f.args)
        loads = "\n".join(f"  %p{i}.a = getelementptr ptr, ptr %args, i64 {i}\n  %p{i} = load ptr, ptr %p{i}.a"
                          for i in range(n))
        call = f"call void @{f.name}({', '.join(f'ptr %p{i}' for i in range(n))})"
        return (f"define void @{f.name}_packed(ptr %args) #0 {{\n{loads}\n  {call}\n  ret void\n}}\n"
                f"define void @{f.name}_repeat(ptr %args, i64 %n) #0 {{\nentry:\n{loads}\n  br label %loop\n"
                f"loop:\n  %i = phi i64 [0, %entry], [%i.next, %loop]\n  {call} #1\n"
                f'  call void asm sideeffect "", "~{{memory}}"()\n'
                f"  %i.next = add i64 %i, 1\n  %c = icmp slt i64 %i.next, %n\n  br i1 %c, label %loop, label %done\n"
                f"done:\n  ret void\n}}\n")

    # ------------------------------------------------------------------ statements

    def _stmt(self, s: Stmt, st: "_EmitState") -> None:
        if isinstance(s, Seq):
            for c in s.stmts:
                self._stmt(c, st)
        elif isinstance(s, For):
            self._for(s, st)
        elif isinstance(s, Store):
            self._store(s, st)
        elif isinstance(s, IfThenElse):
            self._if(s, st)
        elif isinstance(s, Allocate):
            self._allocate(s, st)
            self._stmt(s.body, st)
        elif isinstance(s, Barrier):
            pass
        else:
            raise CodegenError(f"cannot generate code for {type(s).__name__}")

    def _allocate(self, s: Allocate, st: "_EmitState") -> None:
        fn, b = st.fn, s.buffer
        ty = _mem_type(b.dtype)
        nbytes = b.size * DTYPE_BYTES[b.dtype]
        ptr = fn.tmp("buf")
        if nbytes <= STACK_LIMIT_BYTES and b.scope != "global":
            fn.entry.append(f"{ptr} = alloca {ty}, i64 {b.size}, align 64")
            self.stack_owner[b] = fn
        elif fn is self.root or self.num_threads > 0:
            # Temporaries too large for the stack live in a static workspace (.bss), as the compiled
            # library's arena does: the kernel's own in one block, a parallel body's in one slot per
            # thread (the thread count is compiled in, so omp_get_thread_num() < num_threads). Allocated
            # on every call, glibc maps large blocks afresh (always so under Dask's nanny, which sets
            # MALLOC_TRIM_THRESHOLD_): a run paid a page fault per 4 KiB touched (97 per call on average
            # over ResNet-18's default and sampled programs, against 1 in a plain process), so the flow's
            # runners and the library's timed one program differently. The price: a loaded kernel is not
            # reentrant (two threads must not call it at once, as with the network runtime's and the
            # library's planned buffers).
            slot = (nbytes + 63) // 64 * 64
            slots = 1 if fn is self.root else self.num_threads
            self.n_workspaces += 1
            ws = f"@{self.func.name}_ws{self.n_workspaces}"
            self.module.declare(ws, f"{ws} = internal global [{slot * slots} x i8] zeroinitializer, align 64")
            if slots == 1:
                ptr = ws
            else:
                tid = fn.tmp("tid")
                fn.entry.append(f"{tid}.32 = call i32 @omp_get_thread_num()")
                fn.entry.append(f"{tid} = zext i32 {tid}.32 to i64")
                fn.entry.append(f"{tid}.off = mul i64 {tid}, {slot}")
                fn.entry.append(f"{ptr} = getelementptr inbounds i8, ptr {ws}, i64 {tid}.off")
        else:
            self.module.declare("aligned_alloc", "declare noalias ptr @aligned_alloc(i64, i64)")
            self.module.declare("free", "declare void @free(ptr)")
            fn.entry.append(f"{ptr} = call ptr @aligned_alloc(i64 64, i64 {(nbytes + 63) // 64 * 64})")
            fn.exit_lines.insert(0, f"  call void @free(ptr {ptr})")
        st.buffers[b] = ptr

    def _for(self, loop: For, st: "_EmitState") -> None:
        kind = loop.kind
        st.ranges[loop.var] = (0, loop.extent - 1)
        if kind == "unroll" or (kind == "vectorize" and st.lanes > 1):
            for i in range(loop.extent):
                st.env[loop.var] = Val("i64", const=i)
                self._stmt(loop.body, st)
            return
        if kind == "vectorize" and loop.extent > 1:
            # Loops wider than a hardware vector run as unrolled chunks of native width: LLVM would
            # split the wide vector types anyway, at a high compile-time cost.
            lanes = self.native_lanes(loop)
            for base in range(0, loop.extent, lanes):
                width = min(lanes, loop.extent - base)
                if width == 1:
                    st.env[loop.var] = Val("i64", const=base)
                    self._stmt(loop.body, st)
                    continue
                inner = st.child(lanes=width)
                inner.env[loop.var] = Val("i64", lanes=width, ramp=(Val("i64", const=base), 1))
                self._stmt(loop.body, inner)
            return
        if loop.extent == 1:
            st.env[loop.var] = Val("i64", const=0)
            self._stmt(loop.body, st)
            return
        if kind == "parallel" and not st.in_parallel and st.lanes == 1 and st.mask is None:
            self._parallel(loop, st)
            return
        self._serial(loop, st, 0, loop.extent)

    def _serial(self, loop: For, st: "_EmitState", begin, end) -> None:
        """A do-while loop over [begin, end); begin/end are ints or i64 operands (non-empty range)."""
        fn = st.fn
        pre = fn.block
        head, done = fn.label("for"), fn.label("for_end")
        iv = fn.tmp(loop.var.name.replace(".", "_").replace("@", "_") + "_")
        fn.emit(f"br label %{head}")
        fn.start_block(head)
        phi_at = len(fn.lines)
        fn.lines.append("")  # patched below, once the latch block is known
        st.env[loop.var] = Val("i64", ref=iv)
        self._stmt(loop.body, st)
        nxt = fn.tmp("next")
        fn.emit(f"{nxt} = add nuw nsw i64 {iv}, 1")
        cond = fn.tmp("c")
        fn.emit(f"{cond} = icmp slt i64 {nxt}, {end}")
        fn.emit(f"br i1 {cond}, label %{head}, label %{done}")
        fn.lines[phi_at] = f"  {iv} = phi i64 [{begin}, %{pre}], [{nxt}, %{fn.block}]"
        fn.start_block(done)

    def _parallel(self, loop: For, st: "_EmitState") -> None:
        """Outline the loop body into fn(ptr closure) and run it on libgomp's thread pool (static chunks)."""
        self.module.declare("GOMP_parallel", "declare void @GOMP_parallel(ptr, ptr, i32, i32)")
        self.module.declare("omp_get_thread_num", "declare i32 @omp_get_thread_num()")
        self.module.declare("omp_get_num_threads", "declare i32 @omp_get_num_threads()")
        self.n_outlined += 1
        name = f"{self.func.name}_par{self.n_outlined}"
        used_vars, used_bufs = uses(loop.body)
        captured_bufs = [(b, p) for b, p in st.buffers.items() if b in used_bufs]
        captured_vars = [(v, val) for v, val in st.env.items()
                         if v in used_vars and val.lanes == 1 and not val.is_const and val.ref]
        fields = ["ptr"] * len(captured_bufs) + ["i64"] * len(captured_vars)
        sty = "{" + ", ".join(fields or ["i8"]) + "}"
        fn, closure = st.fn, st.fn.tmp("closure")
        fn.entry.append(f"{closure} = alloca {sty}, align 8")
        k = 0
        for _, ptr in captured_bufs:
            p = fn.tmp()
            fn.emit(f"{p} = getelementptr {sty}, ptr {closure}, i32 0, i32 {k}")
            fn.emit(f"store ptr {ptr}, ptr {p}")
            k += 1
        for _, val in captured_vars:
            p = fn.tmp()
            fn.emit(f"{p} = getelementptr {sty}, ptr {closure}, i32 0, i32 {k}")
            fn.emit(f"store i64 {val.ref}, ptr {p}")
            k += 1
        fn.emit(f"call void @GOMP_parallel(ptr @{name}, ptr {closure}, i32 {self.num_threads}, i32 0)")
        # The thread entry unpacks the closure and calls the loop body, whose buffer parameters are
        # noalias: pointers loaded from a struct would make LLVM assume they alias, and then it could
        # neither keep accumulators in registers nor reuse broadcast loads.
        params = [f"ptr noalias nocapture %b{j}" for j in range(len(captured_bufs))] + \
            [f"i64 %v{j}" for j in range(len(captured_vars))] + ["i64 %begin", "i64 %end"]
        body = _Function(f"define internal void @{name}_body({', '.join(params)}) #0", self.module)
        inner = _EmitState(body, {buf: f"%b{j}" for j, (buf, _) in enumerate(captured_bufs)}, {}, None, 1, True,
                           dict(st.ranges))
        for j, (var, _) in enumerate(captured_vars):
            inner.env[var] = Val("i64", ref=f"%v{j}")
        for var, val in st.env.items():
            if var not in inner.env and (val.is_const or val.lanes > 1):
                inner.env[var] = val
        self._serial(loop, inner, "%begin", "%end")
        body.emit("br label %exit")
        body.lines.append("exit:")
        body.exit_lines.append("  ret void")
        self.module.functions.append(body)
        entry = _Function(f"define internal void @{name}(ptr %closure) #0", self.module)
        args = []
        for k, ty in enumerate(fields if (captured_bufs or captured_vars) else []):
            p, v = entry.tmp(), entry.tmp("cap")
            entry.emit(f"{p} = getelementptr {sty}, ptr %closure, i32 0, i32 {k}")
            entry.emit(f"{v} = load {ty}, ptr {p}")
            args.append(f"{ty} {v}")
        tid, nt = entry.tmp("tid"), entry.tmp("nt")
        entry.emit(f"{tid}.32 = call i32 @omp_get_thread_num()")
        entry.emit(f"{nt}.32 = call i32 @omp_get_num_threads()")
        entry.emit(f"store atomic i32 {nt}.32, ptr @{self.func.name}_threads monotonic, align 4")
        entry.emit(f"{tid} = sext i32 {tid}.32 to i64")
        entry.emit(f"{nt} = sext i32 {nt}.32 to i64")
        ext = loop.extent
        chunk, begin, end0, end, empty = (entry.tmp(x) for x in ("chunk", "begin", "end0", "end", "empty"))
        entry.emit(f"{chunk}.a = add i64 {nt}, {ext - 1}")
        entry.emit(f"{chunk} = sdiv i64 {chunk}.a, {nt}")
        entry.emit(f"{begin} = mul i64 {tid}, {chunk}")
        entry.emit(f"{end0} = add i64 {begin}, {chunk}")
        entry.emit(f"{end}.c = icmp slt i64 {end0}, {ext}")
        entry.emit(f"{end} = select i1 {end}.c, i64 {end0}, i64 {ext}")
        entry.emit(f"{empty} = icmp sge i64 {begin}, {end}")
        run = entry.label("run")
        entry.emit(f"br i1 {empty}, label %exit, label %{run}")
        entry.start_block(run)
        entry.emit(f"call void @{name}_body({', '.join(args + [f'i64 {begin}', f'i64 {end}'])})")
        entry.emit("br label %exit")
        entry.lines.append("exit:")
        entry.exit_lines.append("  ret void")
        self.module.functions.append(entry)

    def _if(self, s: IfThenElse, st: "_EmitState") -> None:
        cond = self._expr(s.cond, st.statement())
        if cond.is_const:
            branch = s.then if cond.const else s.orelse
            if branch is not None:
                self._stmt(branch, st)
            return
        if cond.lanes > 1:
            m = self._vec(cond, st)
            self._stmt(s.then, st.child(mask=self._and_mask(st, m)))
            if s.orelse is not None:
                self._stmt(s.orelse, st.child(mask=self._and_mask(st, self._not(m, st))))
            return
        fn = st.fn
        then_l, else_l, end_l = fn.label("then"), fn.label("else"), fn.label("endif")
        fn.emit(f"br i1 {cond.ref}, label %{then_l}, label %{else_l if s.orelse is not None else end_l}")
        fn.start_block(then_l)
        self._stmt(s.then, st.scoped())
        fn.emit(f"br label %{end_l}")
        if s.orelse is not None:
            fn.start_block(else_l)
            self._stmt(s.orelse, st.scoped())
            fn.emit(f"br label %{end_l}")
        fn.start_block(end_l)

    def _store(self, s: Store, st: "_EmitState") -> None:
        st = st.statement()
        fn = st.fn
        buf = s.buffer
        ty = _mem_type(buf.dtype)
        idx = self._expr(s.index, st)
        val = self._expr(s.value, st)
        if buf.dtype == "bool":
            val = self._cast_bool_to_i8(val, st)
        base = st.buffers[buf]
        lanes = max(idx.lanes, val.lanes, st.lanes if st.mask is not None else 1)
        if lanes == 1:
            p = self._gep(base, ty, idx, st)
            fn.emit(f"store {ty} {self._scalar(val, st)}, ptr {p}, align {DTYPE_BYTES[buf.dtype]}")
            return
        v = self._vec(val, st, lanes)
        vty = f"<{lanes} x {ty}>"
        if idx.lanes == 1:
            raise CodegenError(f"store to {buf.name}: every lane writes one address (vectorized reduction axis)")
        if idx.ramp is not None and idx.ramp[1] == 1:
            p = self._gep(base, ty, idx.ramp[0], st)
            if st.mask is None:
                fn.emit(f"store {vty} {v}, ptr {p}, align {DTYPE_BYTES[buf.dtype]}")
            elif self._private_and_in_bounds(s, st):
                # Blend instead of a masked store: an imperfect split's guard masks the register tile's
                # stores, and a masked store on every reduction step keeps the accumulators in memory
                # (200x slower); a plain load/select/store of this thread's own stack buffer is the same
                # result, and LLVM keeps it in registers.
                old, out = fn.tmp("old"), fn.tmp("blend")
                fn.emit(f"{old} = load {vty}, ptr {p}, align {DTYPE_BYTES[buf.dtype]}")
                fn.emit(f"{out} = select <{lanes} x i1> {st.mask}, {vty} {v}, {vty} {old}")
                fn.emit(f"store {vty} {out}, ptr {p}, align {DTYPE_BYTES[buf.dtype]}")
            else:
                name = f"llvm.masked.store.v{lanes}{self._suffix(ty)}.p0"
                self.module.declare(name, f"declare void @{name}({vty}, ptr, i32, <{lanes} x i1>)")
                fn.emit(f"call void @{name}({vty} {v}, ptr {p}, i32 {DTYPE_BYTES[buf.dtype]}, "
                        f"<{lanes} x i1> {st.mask})")
            return
        ptrs = self._vec_gep(base, ty, idx, st, lanes)
        name = f"llvm.masked.scatter.v{lanes}{self._suffix(ty)}.v{lanes}p0"
        self.module.declare(name, f"declare void @{name}({vty}, <{lanes} x ptr>, i32, <{lanes} x i1>)")
        fn.emit(f"call void @{name}({vty} {v}, <{lanes} x ptr> {ptrs}, i32 {DTYPE_BYTES[buf.dtype]}, "
                f"<{lanes} x i1> {st.mask or self._all_true(lanes)})")

    def _private_and_in_bounds(self, s: Store, st: "_EmitState") -> bool:
        """The store's buffer lives on this function's stack (no other thread sees it) and every lane's
        index, masked or not, lies inside it."""
        if self.stack_owner.get(s.buffer) is not st.fn:
            return False
        lo, hi = const_bounds(s.index, st.ranges)
        return lo >= 0 and hi <= s.buffer.size - 1

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _suffix(ty: str) -> str:
        return {"float": "f32", "double": "f64", "half": "f16"}.get(ty, ty)

    def _all_true(self, lanes: int) -> str:
        return "<" + ", ".join(["i1 true"] * lanes) + ">"

    def _gep(self, base: str, ty: str, idx: Val, st) -> str:
        p = st.fn.tmp("p")
        st.fn.emit(f"{p} = getelementptr inbounds {ty}, ptr {base}, i64 {self._scalar(idx, st)}")
        return p

    def _vec_gep(self, base: str, ty: str, idx: Val, st, lanes: int) -> str:
        v = self._vec(idx, st, lanes)
        p = st.fn.tmp("ps")
        st.fn.emit(f"{p} = getelementptr {ty}, ptr {base}, <{lanes} x i64> {v}")
        return p

    def _and_mask(self, st, m: str) -> str:
        if st.mask is None:
            return m
        out = st.fn.tmp("m")
        st.fn.emit(f"{out} = and <{st.lanes} x i1> {st.mask}, {m}")
        return out

    def _not(self, m: str, st) -> str:
        out = st.fn.tmp("m")
        st.fn.emit(f"{out} = xor <{st.lanes} x i1> {m}, {self._all_true(st.lanes)}")
        return out

    def _literal(self, v: Val) -> str:
        if v.ty in ("float", "double", "half"):
            dt = {"float": "float32", "double": "float64", "half": "float16"}[v.ty]
            return _float_literal(float(v.constant), dt)
        if v.ty == "i1":
            return "true" if v.const else "false"
        return str(int(v.constant))

    def _scalar(self, v: Val, st) -> str:
        if v.lanes != 1:
            raise CodegenError("a vector value was used where a scalar is required")
        return self._literal(v) if v.is_const else self._operand(v)

    @staticmethod
    def _operand(v: Val) -> str:
        """v's LLVM operand; constants and ramps have none until they are materialised."""
        if v.ref is None:
            raise CodegenError("a value without an LLVM operand was used as one")
        return v.ref

    def _vec(self, v: Val, st, lanes: int | None = None) -> str:
        """Materialise v as a <lanes x ty> operand (broadcast uniforms, build ramps)."""
        lanes = lanes or v.lanes
        ramp = v.ramp
        if v.lanes > 1 and ramp is None:
            return self._operand(v)
        fn = st.fn
        vty = f"<{lanes} x {v.ty}>"
        if v.lanes == 1:
            if v.is_const:
                lit = self._literal(v)
                return "<" + ", ".join([f"{v.ty} {lit}"] * lanes) + ">"
            a, b = fn.tmp("bc"), fn.tmp("bc")
            fn.emit(f"{a} = insertelement <1 x {v.ty}> poison, {v.ty} {v.ref}, i64 0")
            fn.emit(f"{b} = shufflevector <1 x {v.ty}> {a}, <1 x {v.ty}> poison, <{lanes} x i32> zeroinitializer")
            return b
        if ramp is None:
            raise CodegenError("a vector value has neither an operand nor a ramp")
        base, stride = ramp
        steps = "<" + ", ".join(f"i64 {i * stride}" for i in range(lanes)) + ">"
        if base.is_const:
            return "<" + ", ".join(f"i64 {int(base.constant) + i * stride}" for i in range(lanes)) + ">"
        b = self._vec(base, st, lanes)
        out = fn.tmp("ramp")
        fn.emit(f"{out} = add {vty} {b}, {steps}")
        return out

    def _cast_bool_to_i8(self, v: Val, st) -> Val:
        if v.ty != "i1":
            return v
        if v.is_const:
            return Val("i8", const=int(bool(v.const)))
        out = st.fn.tmp()
        t = f"<{v.lanes} x i1>" if v.lanes > 1 else "i1"
        t8 = f"<{v.lanes} x i8>" if v.lanes > 1 else "i8"
        st.fn.emit(f"{out} = zext {t} {self._vec(v, st) if v.lanes > 1 else v.ref} to {t8}")
        return Val("i8", v.lanes, out)

    # ------------------------------------------------------------------ expressions

    def _expr(self, e: Expr, st: "_EmitState") -> Val:
        """e's value; inside a statement each expression object is emitted once (`_EmitState.memo`)."""
        memo = st.memo
        if memo is None or isinstance(e, (te.Const, Var)):
            return self._emit_expr(e, st)
        hit = memo.get(id(e))
        if hit is None:
            hit = memo[id(e)] = (e, self._emit_expr(e, st))     # e kept alive: its id stays its own
        return hit[1]

    def _emit_expr(self, e: Expr, st: "_EmitState") -> Val:
        if isinstance(e, te.Const):
            ty = _LLTYPE[e.dtype]
            return Val(ty, const=e.value)
        if isinstance(e, Var):
            if e not in st.env:
                raise CodegenError(f"variable {e.name} is used outside its loop")
            return st.env[e]
        if isinstance(e, BufferLoad):
            return self._load(e, st)
        if isinstance(e, te.BinOp):
            if te.is_float(e.dtype) and e.op == "add":
                return self._float_add(e, st)
            nonneg = e.op in ("floordiv", "floormod") and const_bounds(e.a, st.ranges)[0] >= 0
            return self._binop(e.op, self._expr(e.a, st), self._expr(e.b, st), e.dtype, st, nonneg)
        if isinstance(e, te.Cmp):
            return self._cmp(e, st)
        if isinstance(e, te.Not):
            a = self._expr(e.a, st)
            if a.is_const:
                return Val("i1", const=not a.const)
            return self._raw(st, "xor", a, Val("i1", const=True), "i1")
        if isinstance(e, te.Select):
            return self._select(e, st)
        if isinstance(e, te.Call):
            return self._call(e, st)
        if isinstance(e, te.Cast):
            return self._cast(self._expr(e.value, st), e.value.dtype, e.dtype, st)
        raise CodegenError(f"cannot generate code for expression {type(e).__name__}")

    def _load(self, e: BufferLoad, st: "_EmitState") -> Val:
        fn, buf = st.fn, e.buffer
        ty = _mem_type(buf.dtype)
        align = DTYPE_BYTES[buf.dtype]
        base = st.buffers.get(buf)
        if base is None:
            raise CodegenError(f"buffer {buf.name} is read outside its allocation")
        idx = self._expr(e.index, st)
        lanes = idx.lanes
        masked = st.mask is not None
        if lanes == 1 and not masked:
            p = self._gep(base, ty, idx, st)
            out = fn.tmp("ld")
            fn.emit(f"{out} = load {ty}, ptr {p}, align {align}")
            return self._from_mem(Val(ty, 1, out), buf.dtype, st)
        lanes = max(lanes, st.lanes)
        vty = f"<{lanes} x {ty}>"
        out = fn.tmp("vld")
        if idx.ramp is not None and idx.ramp[1] == 1 and idx.lanes > 1:
            p = self._gep(base, ty, idx.ramp[0], st)
            if not masked:
                fn.emit(f"{out} = load {vty}, ptr {p}, align {align}")
            else:
                name = f"llvm.masked.load.v{lanes}{self._suffix(ty)}.p0"
                self.module.declare(name, f"declare {vty} @{name}(ptr, i32, <{lanes} x i1>, {vty})")
                fn.emit(f"{out} = call {vty} @{name}(ptr {p}, i32 {align}, <{lanes} x i1> {st.mask}, {vty} poison)")
            return self._from_mem(Val(ty, lanes, out), buf.dtype, st)
        ptrs = self._vec_gep(base, ty, idx, st, lanes)
        name = f"llvm.masked.gather.v{lanes}{self._suffix(ty)}.v{lanes}p0"
        self.module.declare(name, f"declare {vty} @{name}(<{lanes} x ptr>, i32, <{lanes} x i1>, {vty})")
        fn.emit(f"{out} = call {vty} @{name}(<{lanes} x ptr> {ptrs}, i32 {align}, "
                f"<{lanes} x i1> {st.mask or self._all_true(lanes)}, {vty} poison)")
        return self._from_mem(Val(ty, lanes, out), buf.dtype, st)

    def _from_mem(self, v: Val, dtype: str, st) -> Val:
        if dtype != "bool":
            return v
        t8 = f"<{v.lanes} x i8>" if v.lanes > 1 else "i8"
        t1 = f"<{v.lanes} x i1>" if v.lanes > 1 else "i1"
        out = st.fn.tmp()
        st.fn.emit(f"{out} = trunc {t8} {v.ref} to {t1}")
        return Val("i1", v.lanes, out)

    def _float_add(self, e: te.BinOp, st) -> Val:
        """a*b + c as one fmuladd where a side of the add is a product with a non-constant factor, else
        a plain fadd. Every operand is emitted once (the statement's memo, `_expr`): trying the fusion by
        emitting the operands and, on failure, emitting them again from the top doubled the code at each
        level of an add chain whose terms fold to constant products (a Winograd transform of a
        zero-padded tile: 2^n copies, tens of millions of lines for a 6x6 tile)."""
        for mul, other in ((e.a, e.b), (e.b, e.a)):
            if isinstance(mul, te.BinOp) and mul.op == "mul":
                a, b = self._expr(mul.a, st), self._expr(mul.b, st)
                if not (a.is_const and b.is_const):
                    return self._fma(a, b, self._expr(other, st), e.dtype, st)

        def side(x: Expr) -> Val:      # a product of constants: its factors are emitted already
            if isinstance(x, te.BinOp) and x.op == "mul":
                return self._binop("mul", self._expr(x.a, st), self._expr(x.b, st), x.dtype, st)
            return self._expr(x, st)
        return self._binop("add", side(e.a), side(e.b), e.dtype, st)

    def _fma(self, a: Val, b: Val, c: Val, dtype: str, st) -> Val:
        """a*b + c: llvm.fmuladd (which LLVM contracts to an FMA instruction), or mul and add where a
        scalar operand is a constant, for LLVM to fold."""
        lanes = max(a.lanes, b.lanes, c.lanes)
        ty = a.ty
        if lanes == 1:
            if a.is_const or b.is_const or c.is_const:
                return self._binop("add", self._binop("mul", a, b, dtype, st), c, dtype, st)
            name = f"llvm.fmuladd.{self._suffix(ty)}"
            self.module.declare(name, f"declare {ty} @{name}({ty}, {ty}, {ty})")
            out = st.fn.tmp("fma")
            st.fn.emit(f"{out} = call contract {ty} @{name}({ty} {a.ref}, {ty} {b.ref}, {ty} {c.ref})")
            return Val(ty, 1, out)
        vty = f"<{lanes} x {ty}>"
        name = f"llvm.fmuladd.v{lanes}{self._suffix(ty)}"
        self.module.declare(name, f"declare {vty} @{name}({vty}, {vty}, {vty})")
        out = st.fn.tmp("fma")
        st.fn.emit(f"{out} = call contract {vty} @{name}({vty} {self._vec(a, st, lanes)}, "
                   f"{vty} {self._vec(b, st, lanes)}, {vty} {self._vec(c, st, lanes)})")
        return Val(ty, lanes, out)

    def _raw(self, st, opcode: str, a: Val, b: Val, ty: str, flags: str = "") -> Val:
        lanes = max(a.lanes, b.lanes)
        fn = st.fn
        out = fn.tmp()
        if lanes == 1:
            fn.emit(f"{out} = {opcode} {flags}{ty} {self._scalar(a, st)}, {self._scalar(b, st)}")
            return Val(ty, 1, out)
        fn.emit(f"{out} = {opcode} {flags}<{lanes} x {ty}> {self._vec(a, st, lanes)}, {self._vec(b, st, lanes)}")
        return Val(ty, lanes, out)

    def _binop(self, op: str, a: Val, b: Val, dtype: str, st, nonneg: bool = False) -> Val:
        ty = _LLTYPE[dtype]
        is_float = te.is_float(dtype)
        if a.is_const and b.is_const and not is_float:
            from tensortune.tasks.te import _fold
            if not (op in ("floordiv", "floormod") and b.const == 0):
                return Val(ty, const=_fold(op, a.const, b.const))
        if not is_float:
            r = self._ramp_arith(op, a, b, st)
            if r is not None:
                return r
            if op in ("floordiv", "floormod"):
                return self._floor_divmod(op, a, b, ty, st, nonneg)
            if op in ("min", "max"):
                signed = dtype != "uint8"
                pred = ("slt" if op == "min" else "sgt") if signed else ("ult" if op == "min" else "ugt")
                c = self._raw(st, "icmp " + pred, a, b, ty)
                return self._select_vals(Val("i1", c.lanes, c.ref), a, b, ty, st)
            opcode = {"add": "add", "sub": "sub", "mul": "mul"}[op]
            return self._raw(st, opcode, a, b, ty)
        if op in ("min", "max"):
            name_base = "minnum" if op == "min" else "maxnum"
            return self._intrinsic(name_base, [a, b], ty, st, flags="nnan nsz ")
        if op in ("floordiv", "floormod"):
            q = self._raw(st, "fdiv", a, b, ty, "contract ")
            fq = self._intrinsic("floor", [q], ty, st)
            if op == "floordiv":
                return fq
            return self._raw(st, "fsub", a, self._raw(st, "fmul", fq, b, ty, "contract "), ty, "contract ")
        opcode = {"add": "fadd", "sub": "fsub", "mul": "fmul", "div": "fdiv"}[op]
        return self._raw(st, opcode, a, b, ty, "contract ")

    def _ramp_arith(self, op: str, a: Val, b: Val, st) -> Val | None:
        """Keep `base + stride*lane` symbolic through add/sub/mul-by-constant."""
        def parts(v: Val):
            if v.lanes == 1:
                return v, 0
            if v.ramp is not None:
                return v.ramp
            return None
        pa, pb = parts(a), parts(b)
        if pa is None or pb is None or (a.lanes == 1 and b.lanes == 1):
            return None
        lanes = max(a.lanes, b.lanes)
        if op in ("add", "sub"):
            base = self._binop(op, pa[0], pb[0], "int64", st)
            stride = pa[1] + pb[1] if op == "add" else pa[1] - pb[1]
            return Val("i64", lanes, ramp=(base, stride))
        if op == "mul":
            if b.is_const:
                return Val("i64", lanes, ramp=(self._binop("mul", pa[0], b, "int64", st), pa[1] * int(b.constant)))
            if a.is_const:
                return Val("i64", lanes, ramp=(self._binop("mul", a, pb[0], "int64", st), pb[1] * int(a.constant)))
        if op in ("floordiv", "floormod") and b.is_const and int(b.constant) > 0:
            c = int(b.constant)
            base, stride = pa
            # (base + s*lane) // c is uniform when base % c + s*(lanes-1) < c and s >= 0.
            if stride >= 0 and stride % c == 0:
                if op == "floordiv":
                    return Val("i64", lanes, ramp=(self._binop("floordiv", base, b, "int64", st), stride // c))
                return self._binop("floormod", base, b, "int64", st)
        return None

    def _floor_divmod(self, op: str, a: Val, b: Val, ty: str, st, nonneg: bool = False) -> Val:
        if nonneg and b.is_const and int(b.constant) > 0:
            return self._raw(st, "udiv" if op == "floordiv" else "urem", a, b, ty)
        q = self._raw(st, "sdiv", a, b, ty)
        r = self._raw(st, "srem", a, b, ty)
        zero = Val(ty, const=0)
        neg_r = self._raw(st, "icmp slt", r, zero, ty)
        if b.is_const and int(b.constant) > 0:
            fix = Val("i1", neg_r.lanes, neg_r.ref)
        else:
            neg_b = self._raw(st, "icmp slt", b, zero, ty)
            fix = self._raw(st, "xor", Val("i1", neg_r.lanes, neg_r.ref), Val("i1", neg_b.lanes, neg_b.ref), "i1")
            nz = self._raw(st, "icmp ne", r, zero, ty)
            fix = self._raw(st, "and", fix, Val("i1", nz.lanes, nz.ref), "i1")
        if op == "floordiv":
            one = self._select_vals(fix, Val(ty, const=1), Val(ty, const=0), ty, st)
            return self._raw(st, "sub", q, one, ty)
        adj = self._select_vals(fix, b, Val(ty, const=0), ty, st)
        return self._raw(st, "add", r, adj, ty)

    def _cmp(self, e: te.Cmp, st) -> Val:
        a, b = self._expr(e.a, st), self._expr(e.b, st)
        if e.op in ("and", "or"):
            if a.is_const:
                return b if (a.const if e.op == "and" else not a.const) else a
            if b.is_const:
                return a if (b.const if e.op == "and" else not b.const) else b
            return self._raw(st, e.op, a, b, "i1")
        dt = e.a.dtype
        if a.is_const and b.is_const:
            import operator
            f = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
                 "ne": operator.ne}[e.op]
            return Val("i1", const=bool(f(a.constant, b.constant)))
        ty = _LLTYPE[dt]
        if te.is_float(dt):
            pred = {"lt": "olt", "le": "ole", "gt": "ogt", "ge": "oge", "eq": "oeq", "ne": "une"}[e.op]
            r = self._raw(st, "fcmp " + pred, a, b, ty)
        else:
            unsigned = dt == "uint8"
            pred = {"lt": "slt", "le": "sle", "gt": "sgt", "ge": "sge", "eq": "eq", "ne": "ne"}[e.op]
            if unsigned:
                pred = pred.replace("s", "u", 1) if pred.startswith("s") else pred
            r = self._raw(st, "icmp " + pred, a, b, ty)
        return Val("i1", r.lanes, r.ref)

    def _select_vals(self, c: Val, a: Val, b: Val, ty: str, st) -> Val:
        lanes = max(c.lanes, a.lanes, b.lanes)
        out = st.fn.tmp("sel")
        if lanes == 1:
            st.fn.emit(f"{out} = select i1 {self._scalar(c, st)}, {ty} {self._scalar(a, st)}, "
                       f"{ty} {self._scalar(b, st)}")
            return Val(ty, 1, out)
        ct = f"<{lanes} x i1> {self._vec(c, st, lanes)}" if c.lanes > 1 else f"i1 {self._scalar(c, st)}"
        st.fn.emit(f"{out} = select {ct}, <{lanes} x {ty}> {self._vec(a, st, lanes)}, "
                   f"<{lanes} x {ty}> {self._vec(b, st, lanes)}")
        return Val(ty, lanes, out)

    def _select(self, e: te.Select, st) -> Val:
        c = self._expr(e.cond, st)
        ty = _LLTYPE[e.dtype]
        if c.is_const:
            return self._expr(e.t if c.const else e.f, st)
        has_load = any(isinstance(n, BufferLoad) for n in te.walk_distinct(e.t)) or \
            any(isinstance(n, BufferLoad) for n in te.walk_distinct(e.f))
        if not has_load:
            return self._select_vals(c, self._expr(e.t, st), self._expr(e.f, st), ty, st)
        if c.lanes > 1 or st.lanes > 1:
            lanes = max(c.lanes, st.lanes)
            cm = self._vec(c, st, lanes) if c.lanes > 1 else self._vec(c, st, lanes)
            t = self._expr(e.t, st.child(mask=self._and_mask(st, cm), lanes=lanes))
            f = self._expr(e.f, st.child(mask=self._and_mask(st, self._not_lanes(cm, lanes, st)), lanes=lanes))
            return self._select_vals(Val("i1", lanes, cm), t, f, ty, st)
        fn = st.fn
        tl, fl, end = fn.label("sel_t"), fn.label("sel_f"), fn.label("sel_end")
        fn.emit(f"br i1 {c.ref}, label %{tl}, label %{fl}")
        fn.start_block(tl)
        tv = self._expr(e.t, st.scoped())
        tref, tblock = self._scalar(tv, st), fn.block
        fn.emit(f"br label %{end}")
        fn.start_block(fl)
        fv = self._expr(e.f, st.scoped())
        fref, fblock = self._scalar(fv, st), fn.block
        fn.emit(f"br label %{end}")
        fn.start_block(end)
        out = fn.tmp("phi")
        fn.emit(f"{out} = phi {ty} [{tref}, %{tblock}], [{fref}, %{fblock}]")
        return Val(ty, 1, out)

    def _not_lanes(self, m: str, lanes: int, st) -> str:
        out = st.fn.tmp("m")
        st.fn.emit(f"{out} = xor <{lanes} x i1> {m}, {self._all_true(lanes)}")
        return out

    def _intrinsic(self, base: str, args: list[Val], ty: str, st, flags: str = "") -> Val:
        lanes = max(a.lanes for a in args)
        if lanes == 1:
            name = f"llvm.{base}.{self._suffix(ty)}"
            self.module.declare(name, f"declare {ty} @{name}({', '.join([ty] * len(args))})")
            out = st.fn.tmp()
            st.fn.emit(f"{out} = call {flags}{ty} @{name}({', '.join(f'{ty} {self._scalar(a, st)}' for a in args)})")
            return Val(ty, 1, out)
        vty = f"<{lanes} x {ty}>"
        name = f"llvm.{base}.v{lanes}{self._suffix(ty)}"
        self.module.declare(name, f"declare {vty} @{name}({', '.join([vty] * len(args))})")
        out = st.fn.tmp()
        st.fn.emit(f"{out} = call {flags}{vty} @{name}({', '.join(f'{vty} {self._vec(a, st, lanes)}' for a in args)})")
        return Val(ty, lanes, out)

    def _exp(self, a: Val, ty: str, st) -> Val:
        """exp: float as Cephes' expf computes it (_exp_float), other types by LLVM's intrinsic."""
        return self._exp_float(a, ty, st) if ty == "float" else self._intrinsic("exp", [a], ty, st)

    def _exp_float(self, a: Val, ty: str, st) -> Val:
        """float exp as Cephes' expf: x = m ln2 + r with |r| <= ln2/2, exp(r) by a degree-7 polynomial,
        then times 2^m, built in the exponent bits as 2^(m//2) * 2^(m - m//2) so that both factors
        are normal floats and the product overflows to inf and underflows through the subnormals as
        exp does. Within 1 ulp of exp for every normal result, inf above ln(FLT_MAX), 0 below the
        smallest subnormal, NaN for NaN (tests/test_codegen_math.py). LLVM's llvm.exp on a vector is a
        libm call per lane (1.5 ns an element on Zen 5, where NumPy's SIMD exp takes 0.4): softmax,
        sigmoid and SiLU were bound by it."""
        def fma(x: Val, y: Val, z: Val) -> Val:
            return self._raw(st, "fadd", self._raw(st, "fmul", x, y, ty, "contract "), z, ty, "contract ")

        def const(c: float) -> Val:
            return Val(ty, const=c)
        x = self._intrinsic("maxnum", [self._intrinsic("minnum", [a, const(89.0)], ty, st), const(-104.0)], ty, st)
        m = self._intrinsic("floor", [fma(x, const(1.4426950408889634), const(0.5))], ty, st)
        r = fma(m, const(-0.693359375), x)            # ln2 in two parts: m * 0.693359375 is exact
        r = fma(m, const(2.12194440e-4), r)
        r2 = self._raw(st, "fmul", r, r, ty, "contract ")
        y = fma(self._horner(_EXP_P, r, ty, st), r2, self._raw(st, "fadd", r, const(1.0), ty, "contract "))
        mi = self._cast(m, "float32", "int32", st)
        half = self._raw(st, "ashr", mi, Val("i32", const=1), "i32")
        for k in (half, self._raw(st, "sub", mi, half, "i32")):
            bits = self._raw(st, "shl", self._raw(st, "add", k, Val("i32", const=127), "i32"), Val("i32", const=23),
                             "i32")
            y = self._raw(st, "fmul", y, self._convert("bitcast", bits, "i32", ty, st, "bits"), ty)
        nan = self._raw(st, "fcmp uno", a, a, ty)
        return self._select_vals(Val("i1", nan.lanes, nan.ref), a, y, ty, st)

    def _tanh_float(self, a: Val, ty: str, st) -> Val:
        """float tanh as Eigen computes it: x clamped to +-7.905 (tanh is +-1 in float beyond), then
        x P(x^2) / Q(x^2); x itself below 0.0004, where that is tanh to the last bit. Within 3.5e-7
        of tanh (6 ulp near +-1; tests/test_codegen_math.py), NaN for NaN; libm's is a call per lane
        (the tanh-approximated GELU of GPT-2's exports runs it on every activation)."""
        y = self._odd_rational(a, 7.90531110763549805, _TANH_P, _TANH_Q, ty, st)
        tiny = self._raw(st, "fcmp olt", self._intrinsic("fabs", [a], ty, st), Val(ty, const=0.0004), ty)
        keep = self._raw(st, "fcmp uno", a, a, ty)
        keep = self._raw(st, "or", Val("i1", tiny.lanes, tiny.ref), Val("i1", keep.lanes, keep.ref), "i1")
        return self._select_vals(keep, a, y, ty, st)

    def _odd_rational(self, a: Val, bound: float, p: tuple[float, ...], q: tuple[float, ...], ty: str, st) -> Val:
        """x P(x^2) / Q(x^2) for x = a clamped to [-bound, bound] (the coefficients highest degree first):
        the form of Eigen's float erf and tanh. A NaN input clamps to a bound (minnum/maxnum)."""
        def mul(x: Val, y: Val) -> Val:
            return self._raw(st, "fmul", x, y, ty, "contract ")
        x = self._intrinsic("maxnum", [self._intrinsic("minnum", [a, Val(ty, const=bound)], ty, st),
                                       Val(ty, const=-bound)], ty, st)
        x2 = mul(x, x)
        return self._raw(st, "fdiv", mul(x, self._horner(p, x2, ty, st)), self._horner(q, x2, ty, st), ty)

    def _horner(self, coefficients: tuple[float, ...], x: Val, ty: str, st) -> Val:
        """The polynomial with `coefficients` (highest degree first) at x, one multiply-add a degree."""
        acc = Val(ty, const=coefficients[0])
        for c in coefficients[1:]:
            acc = self._raw(st, "fadd", self._raw(st, "fmul", acc, x, ty, "contract "), Val(ty, const=c), ty,
                            "contract ")
        return acc

    def _convert(self, op: str, v: Val, sty: str, dty: str, st, prefix: str = "cv") -> Val:
        """One conversion instruction (sext, fptosi, bitcast, ...) from sty to dty, lane for lane."""
        out = st.fn.tmp(prefix)
        if v.lanes == 1:
            st.fn.emit(f"{out} = {op} {sty} {self._scalar(v, st)} to {dty}")
        else:
            st.fn.emit(f"{out} = {op} <{v.lanes} x {sty}> {self._vec(v, st)} to <{v.lanes} x {dty}>")
        return Val(dty, v.lanes, out)

    def _erf_float(self, a: Val, ty: str, st) -> Val:
        """float erf as Eigen and XLA compute it: x clamped to [-4, 4] (erf is +-1 in float beyond),
        then x * P(x^2) / Q(x^2), clamped to [-1, 1]; within 4e-7 of erf everywhere (tests/test_codegen_math.py). libm's
        erff is a call per vector lane: in BERT's GELU layer (393,216 values) it took more time than
        the matrix product it follows. A NaN input gives +-1, not NaN (the clamp's minnum/maxnum)."""
        y = self._odd_rational(a, 4.0, _ERF_P, _ERF_Q, ty, st)
        # the rational function overshoots 1 by an ulp near the clamp; erf never does
        return self._intrinsic("maxnum", [self._intrinsic("minnum", [y, Val(ty, const=1.0)], ty, st),
                                          Val(ty, const=-1.0)], ty, st)

    def _libm(self, fname: str, a: Val, ty: str, st) -> Val:
        """Scalar libm call, applied lane by lane for vectors."""
        cname = fname + ("f" if ty == "float" else "")
        self.module.declare(cname, f"declare {ty} @{cname}({ty})")
        fn = st.fn
        if a.lanes == 1:
            out = fn.tmp()
            fn.emit(f"{out} = call {ty} @{cname}({ty} {self._scalar(a, st)})")
            return Val(ty, 1, out)
        vec, lanes = self._vec(a, st), a.lanes
        acc = "poison"
        for i in range(lanes):
            x, y, z = fn.tmp(), fn.tmp(), fn.tmp()
            fn.emit(f"{x} = extractelement <{lanes} x {ty}> {vec}, i64 {i}")
            fn.emit(f"{y} = call {ty} @{cname}({ty} {x})")
            fn.emit(f"{z} = insertelement <{lanes} x {ty}> {acc}, {ty} {y}, i64 {i}")
            acc = z
        return Val(ty, lanes, acc)

    def _call(self, e: te.Call, st) -> Val:
        ty = _LLTYPE[e.dtype]
        args = [self._expr(a, st) for a in e.args]
        name = e.name
        one = Val(ty, const=1.0)
        if name == "exp":
            return self._exp(args[0], ty, st)
        if name in ("log", "sqrt", "floor", "ceil", "sin", "cos"):
            return self._intrinsic(name, args, ty, st)
        if name == "abs":
            if te.is_float(e.dtype):
                return self._intrinsic("fabs", args, ty, st)
            neg = self._raw(st, "sub", Val(ty, const=0), args[0], ty)
            c = self._raw(st, "icmp slt", args[0], Val(ty, const=0), ty)
            return self._select_vals(Val("i1", c.lanes, c.ref), neg, args[0], ty, st)
        if name == "pow":
            return self._intrinsic("pow", args, ty, st)
        if name == "rsqrt":
            return self._raw(st, "fdiv", one, self._intrinsic("sqrt", args, ty, st), ty, "contract ")
        if name == "sigmoid":
            neg = self._raw(st, "fsub", Val(ty, const=0.0), args[0], ty, "contract ")
            den = self._raw(st, "fadd", one, self._exp(neg, ty, st), ty, "contract ")
            return self._raw(st, "fdiv", one, den, ty, "contract ")
        if name == "erf" and ty == "float":
            return self._erf_float(args[0], ty, st)
        if name == "tanh" and ty == "float":
            return self._tanh_float(args[0], ty, st)
        if name in ("tanh", "erf"):
            return self._libm(name, args[0], ty, st)
        raise CodegenError(f"unknown intrinsic {name!r}")

    def _cast(self, v: Val, src: str, dst: str, st) -> Val:
        sty, dty = _LLTYPE[src], _LLTYPE[dst]
        if sty == dty and src != "uint8" and dst != "uint8":
            return v if v.ty == dty else Val(dty, v.lanes, v.ref, v.const, v.ramp)
        if v.is_const:
            if te.is_float(dst):
                return Val(dty, const=float(v.constant))
            return Val(dty, const=int(v.constant))
        if v.ramp is not None and not te.is_float(dst) and dst != "bool":
            base = self._cast(v.ramp[0], src, dst, st)
            return Val(dty, v.lanes, ramp=(base, v.ramp[1]))
        fs, fd = te.is_float(src), te.is_float(dst)
        if fs and fd:
            order = {"half": 0, "float": 1, "double": 2}
            op = "fpext" if order[dty] > order[sty] else "fptrunc"
        elif fs:
            op = "fptosi" if dst != "uint8" else "fptoui"
        elif fd:
            op = "sitofp" if src not in ("uint8", "bool") else "uitofp"
        else:
            bits = {"i1": 1, "i8": 8, "i16": 16, "i32": 32, "i64": 64}
            if bits[dty] > bits[sty]:
                op = "zext" if src in ("uint8", "bool") else "sext"
            else:
                op = "trunc"
        return self._convert(op, v, sty, dty, st)


# exp(r) = 1 + r + r^2 P(r) on [-ln2/2, ln2/2], highest degree first (Cephes' expf)
_EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)

# tanh(x) = x P(x^2) / Q(x^2) on [-7.905, 7.905], highest degree first (Eigen's generic_fast_tanh_float)
_TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
           1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)
_TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)

# erf(x) = x P(x^2) / Q(x^2) on [-4, 4], highest degree first (Eigen's generic_fast_erf_float)
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


@dataclass
class _EmitState:
    fn: _Function
    buffers: dict          # Buffer -> llvm ptr operand
    env: dict              # Var -> Val
    mask: str | None       # <lanes x i1> operand or None
    lanes: int
    in_parallel: bool
    ranges: dict
    # id(expr) -> (expr, Val) emitted so far in this statement (a store, or an if's condition; None
    # outside one, where no expression is emitted): a lowered expression is a DAG (a
    # Winograd transform's 36 sums share their tile's loads and padding tests), and emitting every path
    # to a shared node wrote it out once per path. Per statement, so loads never outlive a store; a
    # branch or masked child (child, scoped) sees what dominates it, and what it emits stays its own.
    memo: ChainMap | None = None

    def child(self, mask: str | None = None, lanes: int | None = None) -> "_EmitState":
        return _EmitState(self.fn, self.buffers, dict(self.env), mask if mask is not None else self.mask,
                          lanes or self.lanes, self.in_parallel, self.ranges, self._inner_memo())

    def scoped(self) -> "_EmitState":
        return _EmitState(self.fn, self.buffers, dict(self.env), self.mask, self.lanes, self.in_parallel,
                          self.ranges, self._inner_memo())

    def statement(self) -> "_EmitState":
        """This state with a fresh memo, for one statement."""
        return _EmitState(self.fn, self.buffers, self.env, self.mask, self.lanes, self.in_parallel,
                          self.ranges, ChainMap())

    def _inner_memo(self) -> ChainMap | None:
        return None if self.memo is None else self.memo.new_child()


def generate_llvm_ir(func: LoweredFunc, cpu: str, features: str, num_threads: int = 0) -> str:
    return LLVMCodegen(func, cpu, features, num_threads).generate()
