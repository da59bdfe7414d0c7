"""Tensor expressions: the small, immutable language every workload is written in.

A workload is a set of `Tensor`s: placeholders (inputs) and computes whose body is an expression
of their axis variables. Expressions compare by identity (so they can key dicts); use
`structural_key` when two trees must be compared by value.
"""
from __future__ import annotations

import builtins
import inspect
import math
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

# Bytes per element of every dtype the DSL knows (bool is stored as one byte).
DTYPE_BYTES: dict[str, int] = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "int16": 2,
                               "int8": 1, "uint8": 1, "bool": 1}

FLOAT_DTYPES = ("float16", "float32", "float64")
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")
DTYPES = FLOAT_DTYPES + INT_DTYPES + ("bool",)
INDEX_DTYPE = "int64"
INTRINSICS = ("exp", "log", "sqrt", "rsqrt", "tanh", "erf", "sigmoid", "abs", "floor", "ceil", "pow",
              "sin", "cos")
EXPENSIVE_INTRINSICS = ("exp", "log", "tanh", "erf", "sigmoid", "pow", "sin", "cos")


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise TypeError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return dtype


class Expr:
    """Base of the expression tree. Operators build new nodes; nothing is ever mutated."""

    __slots__ = ("dtype",)
    dtype: str

    def __add__(self, o): return binary("add", self, o)
    def __radd__(self, o): return binary("add", o, self)
    def __sub__(self, o): return binary("sub", self, o)
    def __rsub__(self, o): return binary("sub", o, self)
    def __mul__(self, o): return binary("mul", self, o)
    def __rmul__(self, o): return binary("mul", o, self)
    def __truediv__(self, o): return binary("div", self, o)
    def __rtruediv__(self, o): return binary("div", o, self)
    def __floordiv__(self, o): return binary("floordiv", self, o)
    def __rfloordiv__(self, o): return binary("floordiv", o, self)
    def __mod__(self, o): return binary("floormod", self, o)
    def __rmod__(self, o): return binary("floormod", o, self)
    def __neg__(self): return binary("sub", const(0, self.dtype), self)
    def __lt__(self, o): return compare("lt", self, o)
    def __le__(self, o): return compare("le", self, o)
    def __gt__(self, o): return compare("gt", self, o)
    def __ge__(self, o): return compare("ge", self, o)
    def __eq__(self, o): return compare("eq", self, o)
    def __ne__(self, o): return compare("ne", self, o)
    __hash__ = object.__hash__
    def __and__(self, o): return compare("and", self, o)
    def __or__(self, o): return compare("or", self, o)
    def __invert__(self): return Not(self)

    def __bool__(self):
        raise TypeError("an expression has no truth value; use te.if_then_else, te.all or te.any")

    def __repr__(self) -> str:
        return to_text(self)


class Var(Expr):
    __slots__ = ("name",)

    def __init__(self, name: str, dtype: str = INDEX_DTYPE):
        self.name, self.dtype = name, dtype


class IterVar(Var):
    """An axis of a compute: a variable with a range [0, extent) and a kind (spatial or reduce)."""

    __slots__ = ("extent", "kind")

    def __init__(self, name: str, extent: int, kind: str):
        super().__init__(name)
        if not isinstance(extent, int) or isinstance(extent, bool) or extent <= 0:
            raise ValueError(f"axis {name!r} needs a positive integer extent, got {extent!r}")
        self.extent, self.kind = extent, kind


class Const(Expr):
    __slots__ = ("value",)

    def __init__(self, value, dtype: str):
        self.dtype = check_dtype(dtype)
        self.value = float(value) if is_float(dtype) else (builtins.bool(value) if dtype == "bool" else int(value))


class BinOp(Expr):
    """Arithmetic: add sub mul div floordiv floormod min max."""

    __slots__ = ("op", "a", "b")

    def __init__(self, op: str, a: Expr, b: Expr):
        self.op, self.a, self.b, self.dtype = op, a, b, a.dtype


class Cmp(Expr):
    """Comparisons and logic (lt le gt ge eq ne and or); always bool."""

    __slots__ = ("op", "a", "b")

    def __init__(self, op: str, a: Expr, b: Expr):
        self.op, self.a, self.b, self.dtype = op, a, b, "bool"

    def __bool__(self):
        # `x == y` builds an expression; where Python needs a truth value (dict/list lookups) it means
        # "the same node", as TVM's EqualOp does.
        if self.op == "eq":
            return self.a is self.b
        if self.op == "ne":
            return self.a is not self.b
        return Expr.__bool__(self)


class Not(Expr):
    __slots__ = ("a",)

    def __init__(self, a: Expr):
        if a.dtype != "bool":
            raise TypeError(f"'not' needs a bool expression, got {a.dtype}")
        self.a, self.dtype = a, "bool"


class Select(Expr):
    """if_then_else: only the chosen branch is evaluated (loads in the other may be out of bounds)."""

    __slots__ = ("cond", "t", "f")

    def __init__(self, cond: Expr, t: Expr, f: Expr):
        self.cond, self.t, self.f, self.dtype = cond, t, f, t.dtype


class Call(Expr):
    __slots__ = ("name", "args")

    def __init__(self, name: str, args: tuple[Expr, ...], dtype: str):
        self.name, self.args, self.dtype = name, args, dtype


class Cast(Expr):
    __slots__ = ("value",)

    def __init__(self, dtype: str, value: Expr):
        self.dtype, self.value = check_dtype(dtype), value


class Load(Expr):
    __slots__ = ("tensor", "indices")

    def __init__(self, tensor: "Tensor", indices: tuple[Expr, ...]):
        self.tensor, self.indices, self.dtype = tensor, indices, tensor.dtype


class Reduce(Expr):
    """A commutative reduction (sum, max, min) of `source` over `axes`; only valid as a compute body."""

    __slots__ = ("combiner", "source", "axes")

    def __init__(self, combiner: str, source: Expr, axes: tuple[IterVar, ...]):
        self.combiner, self.source, self.axes, self.dtype = combiner, source, axes, source.dtype

    @property
    def identity(self) -> Const:
        return reduce_identity(self.combiner, self.dtype)


def reduce_identity(combiner: str, dtype: str) -> Const:
    if combiner == "sum":
        return const(0, dtype)
    big = math.inf if is_float(dtype) else (2 ** 63 - 1 if dtype == "int64" else 2 ** 31 - 1)
    return const(-big if combiner == "max" else big, dtype)


# ----------------------------------------------------------------------------------- construction

def const(value, dtype: str | None = None) -> Const:
    if dtype is None:
        dtype = "bool" if isinstance(value, bool) else INDEX_DTYPE if isinstance(value, int) else "float32"
    return Const(value, dtype)


def as_expr(value, like: str | None = None) -> Expr:
    """Python scalars take the dtype of the expression they meet."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, bool):
        return const(value, "bool")
    if isinstance(value, (int, float)):
        if like is not None and like != "bool":
            if isinstance(value, float) and not is_float(like) and not float(value).is_integer():
                raise TypeError(f"cannot mix the float {value} into a {like} expression; cast first")
            return const(value, like)
        return const(value)
    raise TypeError(f"cannot use {type(value).__name__} {value!r} in a tensor expression")


def _unify(a, b) -> tuple[Expr, Expr]:
    if not isinstance(a, Expr):
        b = as_expr(b)
        return as_expr(a, b.dtype), b
    if not isinstance(b, Expr):
        return a, as_expr(b, a.dtype)
    if a.dtype == b.dtype:
        return a, b
    if not is_float(a.dtype) and not is_float(b.dtype) and "bool" not in (a.dtype, b.dtype):
        wide = builtins.max(a.dtype, b.dtype, key=lambda d: INT_DTYPES.index(d) if d != "uint8" else 0)
        return (a if a.dtype == wide else Cast(wide, a)), (b if b.dtype == wide else Cast(wide, b))
    raise TypeError(f"dtype mismatch: {a.dtype} vs {b.dtype} in {to_text(a)} and {to_text(b)}; "
                    f"use te.cast to convert one side")


def _fold(op: str, x, y):
    fold = _FOLDS.get(op)
    return fold(x, y) if fold is not None else None


_FOLDS = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
          "floordiv": lambda x, y: x // y, "floormod": lambda x, y: x % y,
          "min": lambda x, y: builtins.min(x, y), "max": lambda x, y: builtins.max(x, y)}


def binary(op: str, a, b) -> Expr:
    a, b = _unify(a, b)
    if a.dtype == "bool":
        raise TypeError(f"arithmetic '{op}' on a bool expression {to_text(a)}")
    integral = not is_float(a.dtype)
    if integral and op == "div":
        raise TypeError("integer division must be written // (floor division)")
    ca, cb = isinstance(a, Const), isinstance(b, Const)
    if integral:
        if ca and cb and (op not in ("floordiv", "floormod") or b.value != 0):
            return Const(_fold(op, a.value, b.value), a.dtype)
        if cb and b.value == 0 and op in ("add", "sub"):
            return a
        if ca and a.value == 0 and op == "add":
            return b
        if op == "mul" and ((cb and b.value == 0) or (ca and a.value == 0)):
            return Const(0, a.dtype)
        if op == "mul" and cb and b.value == 1:
            return a
        if op == "mul" and ca and a.value == 1:
            return b
        if op == "floordiv" and cb and b.value == 1:
            return a
        if op == "floormod" and cb and b.value == 1:
            return Const(0, a.dtype)
    return BinOp(op, a, b)


def compare(op: str, a, b) -> Expr:
    a, b = _unify(a, b)
    if op in ("and", "or"):
        if a.dtype != "bool" or b.dtype != "bool":
            raise TypeError(f"'{op}' needs bool operands, got {a.dtype} and {b.dtype}")
        if isinstance(a, Const):
            return (b if a.value else a) if op == "and" else (a if a.value else b)
        if isinstance(b, Const):
            return (a if b.value else b) if op == "and" else (b if b.value else a)
    return Cmp(op, a, b)


def eq(a, b) -> Expr:
    return compare("eq", a, b)


def ne(a, b) -> Expr:
    return compare("ne", a, b)


def all(*conds) -> Expr:  # noqa: A001 - mirrors te.all
    out: Expr = const(True)
    for c in conds:
        out = compare("and", out, c)
    return out


def any(*conds) -> Expr:  # noqa: A001 - mirrors te.any
    out: Expr = const(False)
    for c in conds:
        out = compare("or", out, c)
    return out


def if_then_else(cond, t, f) -> Expr:
    cond = as_expr(cond)
    if cond.dtype != "bool":
        raise TypeError(f"if_then_else needs a bool condition, got {cond.dtype}")
    t, f = _unify(t, f)
    if isinstance(cond, Const):
        return t if cond.value else f
    return Select(cond, t, f)


def cast(dtype: str, value) -> Expr:
    value = as_expr(value)
    return value if value.dtype == dtype else Cast(dtype, value)


def _intrinsic(name: str, *args) -> Expr:
    exprs = [as_expr(a) for a in args]
    if len(exprs) == 2:
        exprs = list(_unify(*exprs))
    if not is_float(exprs[0].dtype) and name != "abs":
        raise TypeError(f"{name} needs a float argument, got {exprs[0].dtype}")
    return Call(name, tuple(exprs), exprs[0].dtype)


def exp(x) -> Expr: return _intrinsic("exp", x)
def log(x) -> Expr: return _intrinsic("log", x)
def sqrt(x) -> Expr: return _intrinsic("sqrt", x)
def rsqrt(x) -> Expr: return _intrinsic("rsqrt", x)
def tanh(x) -> Expr: return _intrinsic("tanh", x)
def erf(x) -> Expr: return _intrinsic("erf", x)
def sigmoid(x) -> Expr: return _intrinsic("sigmoid", x)
def abs(x) -> Expr: return _intrinsic("abs", x)  # noqa: A001
def floor(x) -> Expr: return _intrinsic("floor", x)
def ceil(x) -> Expr: return _intrinsic("ceil", x)
def power(x, y) -> Expr: return _intrinsic("pow", x, y)


def maximum(a, b) -> Expr:
    return binary("max", a, b)


def minimum(a, b) -> Expr:
    return binary("min", a, b)


def _reducer(combiner: str, elementwise: str) -> Callable:
    def reduce_or_combine(expr, b=None, axis=None):
        if axis is None and b is not None and not isinstance(b, (IterVar, list, tuple)):
            return binary(elementwise, expr, b)
        axes = axis if axis is not None else b
        if axes is None:
            raise TypeError(f"{combiner} needs axis=[reduce axes] (or two operands to combine)")
        axes = tuple(axes) if isinstance(axes, (list, tuple)) else (axes,)
        for ax in axes:
            if not isinstance(ax, IterVar) or ax.kind != "reduce":
                raise TypeError(f"{combiner} axis must come from te.reduce_axis, got {ax!r}")
        source = as_expr(expr)
        if _contains_reduce(source):
            raise TypeError("nested reductions are not supported; split them into two computes")
        return Reduce(combiner, source, axes)
    reduce_or_combine.__name__ = combiner
    return reduce_or_combine


sum = _reducer("sum", "add")  # noqa: A001
max = _reducer("max", "max")  # noqa: A001
min = _reducer("min", "min")  # noqa: A001


def reduce_axis(extent, name: str = "k") -> IterVar:
    """`reduce_axis(K)` or TVM's `reduce_axis((0, K))`."""
    if isinstance(extent, tuple):
        lo, hi = extent
        if lo != 0:
            raise ValueError(f"reduce_axis {name!r} must start at 0, got ({lo}, {hi})")
        extent = hi
    return IterVar(name, extent, "reduce")


# ----------------------------------------------------------------------------------- tensors

class Tensor:
    """A placeholder (body None) or a compute: out[axes] = body (a Reduce, or an expression)."""

    __slots__ = ("name", "shape", "dtype", "axes", "body", "attrs")

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str, axes: tuple[IterVar, ...] = (),
                 body: Expr | None = None, attrs: dict | None = None):
        self.name, self.shape, self.dtype = name, shape, check_dtype(dtype)
        self.axes, self.body, self.attrs = axes, body, dict(attrs or {})

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_placeholder(self) -> bool:
        return self.body is None

    @property
    def reduce_axes(self) -> tuple[IterVar, ...]:
        return self.body.axes if isinstance(self.body, Reduce) else ()

    def inputs(self) -> list["Tensor"]:
        """The tensors this compute reads, in first-use order."""
        seen: dict[Tensor, None] = {}
        if self.body is not None:
            for node in walk(self.body):
                if isinstance(node, Load):
                    seen.setdefault(node.tensor, None)
        return list(seen)

    def __getitem__(self, index) -> Load:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != len(self.shape):
            raise IndexError(f"{self.name} has {len(self.shape)} dimensions, indexed with {len(index)}")
        idx = []
        for i in index:
            e = as_expr(i, INDEX_DTYPE)
            if is_float(e.dtype) or e.dtype == "bool":
                raise TypeError(f"index of {self.name} must be an integer expression, got {e.dtype}")
            idx.append(e if e.dtype == INDEX_DTYPE else Cast(INDEX_DTYPE, e))
        return Load(self, tuple(idx))

    def __repr__(self) -> str:
        return f"Tensor({self.name}, {list(self.shape)}, {self.dtype})"


def _shape(shape) -> tuple[int, ...]:
    shape = tuple(shape) if isinstance(shape, (list, tuple)) else (shape,)
    for s in shape:
        if not isinstance(s, int) or isinstance(s, bool) or s <= 0:
            raise ValueError(f"shape {list(shape)} must hold positive integers")
    return shape


def placeholder(shape, dtype: str = "float32", name: str = "placeholder") -> Tensor:
    return Tensor(name, _shape(shape), dtype)


def compute(shape, fcompute: Callable, name: str = "compute", attrs: dict | None = None) -> Tensor:
    """out[i, j, ...] = fcompute(i, j, ...); axis names come from fcompute's parameter names."""
    shape = _shape(shape)
    params = list(inspect.signature(fcompute).parameters.values())
    if len(params) == len(shape) and builtins.all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params):
        names = [p.name for p in params]
    else:
        names = [f"ax{i}" for i in range(len(shape))]
    axes = tuple(IterVar(n, e, "spatial") for n, e in zip(names, shape))
    body = fcompute(*axes)
    if isinstance(body, Tensor):
        raise TypeError(f"compute {name!r} returned a tensor; index it (e.g. t[i, j])")
    body = as_expr(body)
    if not isinstance(body, Reduce) and _contains_reduce(body):
        raise TypeError(f"compute {name!r}: a reduction must be the whole body, not part of an "
                        f"expression; compute the reduction in its own stage")
    return Tensor(name, shape, body.dtype, axes, shared(body), attrs)


# ----------------------------------------------------------------------------------- traversal

def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, (BinOp, Cmp)):
        return (e.a, e.b)
    if isinstance(e, Load):
        return e.indices
    if isinstance(e, Select):
        return (e.cond, e.t, e.f)
    if isinstance(e, Call):
        return e.args
    if isinstance(e, Cast):
        return (e.value,)
    if isinstance(e, Not):
        return (e.a,)
    if isinstance(e, Reduce):
        return (e.source,)
    return ()


def walk(e: Expr) -> Iterable[Expr]:
    """Pre-order traversal."""
    stack = [e]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(children(node)))


def walk_distinct(e: Expr) -> Iterable[Expr]:
    """Pre-order traversal that visits each node object once. An expression is a DAG wherever a
    subtree object is used twice (a Winograd transform's sums share their tile's loads), and `walk`
    visits a shared subtree once per path to it: of the 8.5 million nodes the code generator's
    vector-width check walked for twelve F(4) programs, half were such repeats. For every question
    of whether some node is there, or which ones are, each distinct node once suffices."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(reversed(children(node)))


def _contains_reduce(e: Expr) -> bool:
    return builtins.any(isinstance(n, Reduce) for n in walk_distinct(e))


def rebuild(e: Expr, kids: Sequence[Expr], fold: bool = True) -> Expr:
    """The same node over new children; constant folding re-applies unless `fold` is False (the node
    made as it was, whatever its children)."""
    if isinstance(e, BinOp):
        return binary(e.op, kids[0], kids[1]) if fold else BinOp(e.op, kids[0], kids[1])
    if isinstance(e, Cmp):
        return compare(e.op, kids[0], kids[1]) if fold else Cmp(e.op, kids[0], kids[1])
    if isinstance(e, Load):
        return type(e)(e.tensor, tuple(kids))
    if isinstance(e, Select):
        return if_then_else(*kids) if fold else Select(kids[0], kids[1], kids[2])
    if isinstance(e, Call):
        return Call(e.name, tuple(kids), e.dtype)
    if isinstance(e, Cast):
        return cast(e.dtype, kids[0]) if fold else Cast(e.dtype, kids[0])
    if isinstance(e, Not):
        return Not(kids[0])
    if isinstance(e, Reduce):
        return Reduce(e.combiner, kids[0], e.axes)
    return e


def shared(e: Expr) -> Expr:
    """`e` with structurally equal subtrees made one object (hash-consing); the tree it prints is `e`'s.

    Why: the walks a body goes through once per program the search looks at (`substitute`, `transform`,
    `walk_distinct`, lowering) are memoised by object, so they cost what the body has in distinct
    objects, not in tree nodes. A Winograd F(4) input transform, a select chain over the 36 points of a
    6x6 tile whose branches read the tile's 36 padded values, made each read afresh: with the padding
    inlined, 14 500 objects, 1 400 once shared. And the shape of a body must not depend on where it was
    made: the code generator emits a shared node once per statement, so a task built in the flow and
    the same task read back from JSON (a tree) on a worker gave different LLVM IR for some Winograd
    programs. Every body comes from `compute` or from `dag_from_json`, and both share it here. What
    reads a body as a tree (its text, the workload key, the kernel identity, the features, which count
    paths) is unchanged."""
    return _shared(e, {}, {})


def _shared(node: Expr, memo: dict[int, Expr], table: dict[tuple, Expr]) -> Expr:
    out = memo.get(id(node))
    if out is not None:
        return out
    if isinstance(node, Var):
        out = node
    elif isinstance(node, Const):
        out = table.setdefault((Const, node.dtype, repr(node.value)), node)     # repr: -0.0 and 0.0 stay apart
    else:
        kids = children(node)
        new_kids = tuple(_shared(k, memo, table) for k in kids)
        key = (type(node), node.dtype, _fields(node), tuple(id(k) for k in new_kids))
        out = table.get(key)
        if out is None:
            same = builtins.all(a is b for a, b in zip(kids, new_kids))
            out = table[key] = node if same else rebuild(node, new_kids, fold=False)
    memo[id(node)] = out
    return out


def _fields(e: Expr) -> object:
    """What, besides its type, dtype and children, makes a node what it is (`shared`'s key); a node of a
    kind not known here is itself, so it is never merged with another."""
    if isinstance(e, (BinOp, Cmp)):
        return e.op
    if isinstance(e, Call):
        return e.name
    if isinstance(e, Load):
        return e.tensor
    if isinstance(e, Reduce):
        return e.combiner, e.axes
    if isinstance(e, (Not, Select, Cast)):
        return None
    return e


def transform(e: Expr, fn: Callable[[Expr], Expr | None]) -> Expr:
    """Bottom-up rewrite: `fn(node)` returns a replacement or None to keep the node (memoised)."""
    return _transform(e, fn, {})


def _transform(node: Expr, fn: Callable[[Expr], Expr | None], memo: dict[int, Expr]) -> Expr:
    # a module-level function, not a recursive closure: a closure that calls itself is a reference
    # cycle, which keeps every tree it touched alive until the cyclic collector runs
    key = id(node)
    if key in memo:
        return memo[key]
    kids = children(node)
    new_kids = [_transform(k, fn, memo) for k in kids]
    out = node if builtins.all(a is b for a, b in zip(kids, new_kids)) else rebuild(node, new_kids)
    repl = fn(out)
    memo[key] = out if repl is None else repl
    return memo[key]


_V = TypeVar("_V", bound="Var")


def substitute(e: Expr, mapping: Mapping[_V, Expr]) -> Expr:
    """`e` with each variable in `mapping` replaced (memoised, so a shared subtree stays shared).
    `transform` with a replace-the-variables function, written out: substituting loop values into index
    expressions is the largest part of making a feature template, and the general walk called its
    function on every node."""
    if not mapping:
        return e
    return _substitute(e, mapping, {})


def _substitute(node: Expr, mapping: Mapping[Any, Expr], memo: dict[int, Expr]) -> Expr:
    key = id(node)
    out = memo.get(key)
    if out is not None:
        return out
    if isinstance(node, Var):
        out = mapping.get(node, node)
    else:
        kids = children(node)
        new_kids = [_substitute(k, mapping, memo) for k in kids]
        out = node if builtins.all(a is b for a, b in zip(kids, new_kids)) else rebuild(node, new_kids)
    memo[key] = out
    return out


def free_vars(e: Expr) -> set[Var]:
    return {n for n in walk_distinct(e) if isinstance(n, Var)}


def structural_key(e: Expr, names: dict | None = None) -> tuple:
    """A hashable value that is equal for structurally equal trees (vars by identity or `names`)."""
    if isinstance(e, Var):
        return ("v", names.get(e, id(e)) if names else id(e))
    if isinstance(e, Const):
        return ("c", e.value, e.dtype)
    if isinstance(e, Load):
        return ("ld", id(e.tensor), tuple(structural_key(i, names) for i in e.indices))
    head = (type(e).__name__, getattr(e, "op", None) or getattr(e, "name", None) or getattr(e, "combiner", None),
            e.dtype)
    return head + tuple(structural_key(c, names) for c in children(e))


# ----------------------------------------------------------------------------------- printing

_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "floormod": "%",
          "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "&&", "or": "||"}


def to_text(e: Expr, names: dict | None = None, memo: dict[int, str] | None = None) -> str:
    """Infix text with full parentheses; tensors and vars print by name (or `names[obj]`). Each object's
    text is made once (memoised by object; a caller printing many expressions with one `names` may pass
    one `memo` for all, while their objects live): the text of a body is a tree's, and a kernel identity
    prints a lowered Winograd F(4) program, whose transform is 1 400 objects that print as a tree ten
    times that, for every program the search considers."""
    return _text(e, names or {}, {} if memo is None else memo)


def _text(n: Expr, names: dict, memo: dict[int, str]) -> str:
    # a module-level function, not a recursive closure (see _transform)
    out = memo.get(id(n))
    if out is not None:
        return out
    if isinstance(n, Var):
        out = names.get(n, n.name) if names else n.name
    elif isinstance(n, Const):
        if n.dtype == "bool":
            out = "True" if n.value else "False"
        elif is_float(n.dtype):
            out = f"{n.value!r}f" if n.dtype == "float32" else repr(n.value)
        else:
            out = str(n.value)
    elif isinstance(n, BinOp):
        a, b = _text(n.a, names, memo), _text(n.b, names, memo)
        out = f"{n.op}({a}, {b})" if n.op in ("min", "max") else f"({a}{_INFIX[n.op]}{b})"
    elif isinstance(n, Cmp):
        out = f"({_text(n.a, names, memo)} {_INFIX[n.op]} {_text(n.b, names, memo)})"
    elif isinstance(n, Not):
        out = f"!{_text(n.a, names, memo)}"
    elif isinstance(n, Select):
        out = f"if_then_else({', '.join(_text(k, names, memo) for k in (n.cond, n.t, n.f))})"
    elif isinstance(n, Call):
        out = f"{n.name}({', '.join(_text(a, names, memo) for a in n.args)})"
    elif isinstance(n, Cast):
        out = f"{n.dtype}({_text(n.value, names, memo)})"
    elif isinstance(n, Load):
        tensor = names.get(n.tensor, n.tensor.name) if names else n.tensor.name
        out = f"{tensor}[{', '.join(_text(i, names, memo) for i in n.indices)}]"
    elif isinstance(n, Reduce):
        axes = ", ".join(f"{names.get(a, a.name) if names else a.name}:{a.extent}" for a in n.axes)
        out = f"{n.combiner}({_text(n.source, names, memo)}, axis=[{axes}])"
    else:
        raise TypeError(f"unknown expression node {type(n).__name__}")
    memo[id(n)] = out
    return out
