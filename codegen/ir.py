"""The lowered program: a loop nest over flat buffers, shared by the LLVM and CUDA backends."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator as PyIterator
from typing import cast

from tensortune.tasks import te
from tensortune.tasks.te import Expr, Var


@dataclass(eq=False)
class Buffer:
    """A flat array. scope: 'arg' (kernel argument), 'global' (heap temp), 'local', 'shared'."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    scope: str

    @property
    def size(self) -> int:
        """Elements to allocate (covers the last element under padded strides)."""
        return 1 + sum((s - 1) * st for s, st in zip(self.shape, self.strides)) if self.shape else 1

    def flat(self, indices) -> Expr:
        out: Expr = te.const(0)
        for i, st in zip(indices, self.strides):
            out = out + te.as_expr(i) * st
        return out


def dense_strides(shape, align: dict[int, tuple[int, int]] | None = None) -> tuple[int, ...]:
    """Row-major strides; `align[d] = (factor, offset)` pads dim d's stride to factor*k + offset."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        s = strides[d + 1] * shape[d + 1]
        if align and d in align:
            factor, offset = align[d]
            s = s + (offset - s) % factor
        strides[d] = s
    return tuple(strides)


class BufferLoad(te.Load):
    """A load from a flat buffer (`tensor` is the Buffer, `indices` is the one flat index).

    It is a te.Load so that te's walk, rebuild, structural key and printing cover lowered code too; those
    use the `tensor` slot only for its name, dtype and identity, which a Buffer has. The slot is declared
    a Tensor, so the Buffer goes in and comes out through a cast; only `buffer` should read it."""
    __slots__ = ()

    def __init__(self, buffer: Buffer, indices: tuple[Expr, ...]):
        self.tensor, self.indices, self.dtype = cast(te.Tensor, buffer), indices, buffer.dtype

    @property
    def buffer(self) -> Buffer:
        return cast(Buffer, self.tensor)

    @property
    def index(self) -> Expr:
        return self.indices[0]


class Stmt:
    pass


@dataclass(eq=False)
class For(Stmt):
    var: Var
    extent: int
    kind: str          # serial | parallel | vectorize | unroll | vthread | blockIdx.x ... | threadIdx.z
    body: Stmt
    pragmas: dict = field(default_factory=dict)


@dataclass(eq=False)
class Store(Stmt):
    buffer: Buffer
    index: Expr
    value: Expr


@dataclass(eq=False)
class IfThenElse(Stmt):
    cond: Expr
    then: Stmt
    orelse: Stmt | None = None


@dataclass(eq=False)
class Seq(Stmt):
    stmts: list[Stmt]


@dataclass(eq=False)
class Allocate(Stmt):
    buffer: Buffer
    body: Stmt


@dataclass(eq=False)
class Barrier(Stmt):
    """__syncthreads() on GPU; nothing on CPU."""


@dataclass
class LoweredFunc:
    name: str
    args: list[Buffer]
    body: Stmt
    flops: float = 0.0

    def text(self, canonical: bool = False) -> str:
        return lowered_text(self, canonical)


def seq(stmts: list[Stmt]) -> Stmt:
    flat: list[Stmt] = []
    for s in stmts:
        if isinstance(s, Seq):
            flat.extend(s.stmts)
        elif s is not None:
            flat.append(s)
    return flat[0] if len(flat) == 1 else Seq(flat)


def walk_stmts(s: Stmt) -> PyIterator[Stmt]:
    yield s
    if isinstance(s, (For, Allocate)):
        yield from walk_stmts(s.body)
    elif isinstance(s, IfThenElse):
        yield from walk_stmts(s.then)
        if s.orelse is not None:
            yield from walk_stmts(s.orelse)
    elif isinstance(s, Seq):
        for c in s.stmts:
            yield from walk_stmts(c)


def stmt_exprs(s: Stmt) -> PyIterator[Expr]:
    """Every expression a statement tree evaluates: conditions, stores (as a load of the stored
    element, so their buffer and index show) and stored values."""
    for x in walk_stmts(s):
        if isinstance(x, IfThenElse):
            yield x.cond
        elif isinstance(x, Store):
            yield BufferLoad(x.buffer, (x.index,))
            yield x.value


def uses(s: Stmt) -> tuple[set, set]:
    """(vars, buffers) a statement tree reads or writes."""
    vars_, bufs = set(), set()
    for e in stmt_exprs(s):
        for n in te.walk_distinct(e):
            if isinstance(n, Var):
                vars_.add(n)
            elif isinstance(n, BufferLoad):
                bufs.add(n.buffer)
    return vars_, bufs


_UNBOUND_KINDS = ("serial", "parallel", "vectorize", "unroll", "vthread")


def lowered_text(f: LoweredFunc, canonical: bool = False) -> str:
    """TVM `lower(..., simple_mode=True)`-style text of the loop nest.

    canonical: the text two programs share exactly when the backends compile them alike
    (`codegen.kernel_identity`): loop variables are numbered in order (two stages' loops may share a
    name, so one nested in the other would print ambiguously); pragmas are left out (lowering consumed
    them: `auto_unroll_max_step` became the loops' `unroll` kinds; no backend reads them); a loop of
    extent 1 is left out, its variable printed as 0, as both backends emit it (its body, the variable
    the constant 0), unless it is bound to a GPU grid or block axis (the launch's dimensions)."""
    names: dict = {}
    texts: dict[int, str] = {}      # one memo for every expression of `f` (the statements share objects)
    out = [f"{f.name}({', '.join(f'{b.name}: {b.dtype}{list(b.shape)}' for b in f.args)}) {{"]

    def ex(e: Expr) -> str:
        return te.to_text(e, names, texts)

    def dropped(s: For) -> bool:
        return canonical and s.extent == 1 and s.kind in _UNBOUND_KINDS

    loops = [s for s in walk_stmts(f.body) if isinstance(s, For)]
    names.update((s.var, "0") for s in loops if dropped(s))
    kept = [s for s in loops if not dropped(s)]
    names.update((s.var, f"v{k}" if canonical else s.var.name) for k, s in enumerate(kept))

    def go(s: Stmt, d: int) -> None:
        pad = "  " * d
        if isinstance(s, For) and dropped(s):
            go(s.body, d)
        elif isinstance(s, For):
            kind = "" if s.kind == "serial" else f' "{s.kind}"'
            prag = "" if canonical else "".join(f" // pragma {k}={v}" for k, v in s.pragmas.items())
            out.append(f"{pad}for ({names[s.var]}, 0, {s.extent}){kind} {{{prag}")
            go(s.body, d + 1)
            out.append(f"{pad}}}")
        elif isinstance(s, Allocate):
            out.append(f"{pad}allocate {s.buffer.name}[{s.buffer.dtype} * {s.buffer.size}] {s.buffer.scope}")
            go(s.body, d)
        elif isinstance(s, Store):
            out.append(f"{pad}{s.buffer.name}[{ex(s.index)}] = {ex(s.value)}")
        elif isinstance(s, IfThenElse):
            out.append(f"{pad}if ({ex(s.cond)}) {{")
            go(s.then, d + 1)
            if s.orelse is not None:
                out.append(f"{pad}}} else {{")
                go(s.orelse, d + 1)
            out.append(f"{pad}}}")
        elif isinstance(s, Seq):
            for c in s.stmts:
                go(c, d)
        elif isinstance(s, Barrier):
            out.append(f"{pad}__syncthreads()")

    go(f.body, 1)
    out.append("}")
    return "\n".join(out) + "\n"
