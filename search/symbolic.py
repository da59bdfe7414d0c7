"""Integer index expressions compiled to straight-line numpy, for a whole population at once.

The features of a structure (`feature.py`) are expressions of its open numbers (tile sizes, unroll
depths, region sizes): `compile_exprs` turns a list of them into one function of an env of arrays.
An index is split by `linear_form` into loop-variable coefficients (expressions) and non-linear
atoms; `IntervalCompiler` writes the source of an atom's interval bounds while some loops vary.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from tensortune.tasks import te
from tensortune.tasks.te import Expr, Var


def numpy_source(e, names: dict) -> str:
    """Python/numpy source of an integer expression over symbol arrays."""
    if isinstance(e, int):
        return str(e)
    if isinstance(e, te.Const):
        return repr(e.value)
    if isinstance(e, Var):
        return f"e[{names[e]!r}]"
    if isinstance(e, te.BinOp):
        a, b = numpy_source(e.a, names), numpy_source(e.b, names)
        return {"add": f"({a} + {b})", "sub": f"({a} - {b})", "mul": f"({a} * {b})",
                "floordiv": f"({a} // {b})", "floormod": f"({a} % {b})", "div": f"({a} / {b})",
                "min": f"np.minimum({a}, {b})", "max": f"np.maximum({a}, {b})"}[e.op]
    if isinstance(e, te.Cast):
        return numpy_source(e.value, names)
    raise TypeError(f"feature template cannot evaluate {type(e).__name__}")


# compiled functions by their source: structures of one task share most of their loop nests and index
# expressions, and the same source (symbols are named by step and loop) is the same function; Python's
# compiler took a fifth of making a template, and half the sources of a conv's first round recur
_COMPILED: dict[str, Callable] = {}


def compiled(source: str, scope: dict[str, Any]) -> Callable:
    """The function `f` that `source` defines (compiled once per source; `scope`: the names it uses)."""
    fn = _COMPILED.get(source)
    if fn is None:
        if len(_COMPILED) >= 4096:
            _COMPILED.clear()
        exec(source, scope)  # noqa: S102 - source generated from our own expression trees
        fn = _COMPILED[source] = scope["f"]
    return fn


def compile_exprs(exprs: list, names: dict):
    """One function computing all `exprs` from an env dict of arrays (straight-line numpy)."""
    body = ", ".join(numpy_source(x, names) for x in exprs)
    return compiled(f"def f(e):\n    return ({body},)\n", {"np": np})


@dataclass
class Linear:
    """index = sum(coef[v] * v) + sum(atoms) + const, over the loop variables of one nest."""
    coef: dict = field(default_factory=dict)      # loop var -> coefficient expression
    atoms: list = field(default_factory=list)     # non-linear parts containing loop vars


class FreeVars:
    """te.free_vars, memoised by node: `_linear` asks about every subtree of every index, and index
    trees share subtrees, so walking each anew was quadratic (a third of building a template).
    The memo holds each node it keys by id: a freed temporary's id can be reused by a new node, which
    would then get the old node's variables."""

    def __init__(self):
        self.memo: dict[int, tuple[Expr, frozenset]] = {}

    def __call__(self, e: Expr) -> frozenset:
        hit = self.memo.get(id(e))
        if hit is not None:
            return hit[1]
        if isinstance(e, Var):
            found = frozenset((e,))
        else:
            found = frozenset().union(*(self(k) for k in te.children(e)))
        self.memo[id(e)] = (e, found)
        return found


def linear_form(e: Expr, loop_vars: set, free_vars: FreeVars) -> Linear:
    if isinstance(e, Var):
        return Linear({e: 1}) if e in loop_vars else Linear()
    if isinstance(e, te.Const):
        return Linear()
    if isinstance(e, te.BinOp) and not te.is_float(e.dtype):
        if e.op in ("add", "sub"):
            a, b = linear_form(e.a, loop_vars, free_vars), linear_form(e.b, loop_vars, free_vars)
            coef = dict(a.coef)
            for v, c in b.coef.items():
                c = c if e.op == "add" else te.binary("sub", te.const(0), te.as_expr(c))
                coef[v] = te.binary("add", te.as_expr(coef[v]), te.as_expr(c)) if v in coef else c
            return Linear(coef, a.atoms + b.atoms)
        if e.op == "mul":
            for x, y in ((e.a, e.b), (e.b, e.a)):
                if not (free_vars(y) & loop_vars):
                    inner = linear_form(x, loop_vars, free_vars)
                    return Linear({v: te.binary("mul", te.as_expr(c), y) for v, c in inner.coef.items()},
                                   [te.binary("mul", a, y) for a in inner.atoms])
    if free_vars(e) & loop_vars:
        return Linear({}, [e])
    return Linear()


class IntervalCompiler:
    """Straight-line numpy source for the bounds of an index expression: loop variables in `ranging`
    span [0, X[v] - 1] (X: their extents), other loop variables are held at 0, symbols take their
    values. Sub-expressions become local variables, so shared subtrees are bounded once.

    This is most of the features' run time, so the source is kept small: each interval carries a
    lower bound known at compile time (loop variables >= 0, tile and region sizes >= 1, given in
    `floors`), and the product of non-negative intervals is [lo*lo, hi*hi] (two multiplies, not four
    plus six min/max); a point interval (lo is hi: sizes and their products) is computed once; constant
    parts are folded.
    """

    def __init__(self, names: dict, loop_vars: set, floors: dict):
        self.names, self.loop_vars, self.floors = names, loop_vars, floors
        self.lines: list[str] = []
        self.memo: dict = {}

    def bound(self, e: Expr, ranging: frozenset) -> tuple[str, str]:
        """Source of e's (lower, upper) bound; the lines it needs are added to `lines`."""
        return self._signed(e, ranging)[:2]

    def function(self, outputs: list[str]) -> Callable[[dict, dict], tuple]:
        """f(e, X): the `lines` so far, then the tuple of `outputs` (sources of expressions over them)."""
        src = "def f(e, X):\n" + "".join(f"    {line}\n" for line in self.lines)
        src += f"    return ({', '.join(outputs)},)\n"
        return compiled(src, {"np": np, "_min4": _min4, "_max4": _max4, "_mod_lo": _mod_lo, "_mod_hi": _mod_hi})

    def _signed(self, e: Expr, ranging: frozenset) -> tuple[str, str, float]:
        """(lo, hi, a number no larger than lo)."""
        key = (id(e), ranging)
        if key in self.memo:
            return self.memo[key]
        lo, hi, floor = self._bound(e, ranging)
        if not _is_number(lo) and not _is_name(lo):
            n = len(self.lines)
            if lo == hi:
                self.lines.append(f"p{n} = {lo}")
                lo = hi = f"p{n}"
            else:
                self.lines.append(f"l{n} = {lo}; h{n} = {hi}")
                lo, hi = f"l{n}", f"h{n}"
        self.memo[key] = lo, hi, floor
        return lo, hi, floor

    def _bound(self, e: Expr, ranging: frozenset) -> tuple[str, str, float]:
        if isinstance(e, te.Const):
            return repr(e.value), repr(e.value), e.value
        if isinstance(e, Var):
            if e in self.loop_vars:
                return ("0", f"(X[{self.names[e]!r}] - 1)", 0) if e in ranging else ("0", "0", 0)
            name = self.names[e]
            return f"e[{name!r}]", f"e[{name!r}]", self.floors.get(name, -math.inf)
        if isinstance(e, te.Cast):
            return self._signed(e.value, ranging)
        if isinstance(e, te.BinOp):
            (al, ah, af), (bl, bh, bf) = self._signed(e.a, ranging), self._signed(e.b, ranging)
            if _is_number(al) and al == ah and _is_number(bl) and bl == bh and e.op in _FOLD:
                value = repr(_FOLD[e.op](_number(al), _number(bl)))
                return value, value, _number(value)
            if e.op == "add":
                return _join("+", al, bl), _join("+", ah, bh), af + bf
            if e.op == "sub":
                return _join("-", al, bh), _join("-", ah, bl), af - _number(bh) if _is_number(bh) else -math.inf
            if e.op == "mul":
                return self._mul(al, ah, af, bl, bh, bf)
            if e.op == "floordiv":
                lo = "0" if al == "0" else f"({al} // np.maximum({bh}, 1))"
                return lo, f"({ah} // np.maximum({bl}, 1))", 0 if af >= 0 else -math.inf
            if e.op == "floormod":
                return f"_mod_lo({al}, {ah}, {bl})", f"_mod_hi({al}, {ah}, {bl}, {bh})", 0
            if e.op in ("min", "max"):
                f = "np.minimum" if e.op == "min" else "np.maximum"
                return f"{f}({al}, {bl})", f"{f}({ah}, {bh})", min(af, bf) if e.op == "min" else max(af, bf)
        if isinstance(e, te.Select):
            (tl, th, tf), (fl, fh, ff) = self._signed(e.t, ranging), self._signed(e.f, ranging)
            return f"np.minimum({tl}, {fl})", f"np.maximum({th}, {fh})", min(tf, ff)
        return "0", "0", 0

    @staticmethod
    def _mul(al: str, ah: str, af: float, bl: str, bh: str, bf: float) -> tuple[str, str, float]:
        if af >= 0 and bf >= 0:
            return _join("*", al, bl), _join("*", ah, bh), af * bf
        for (xl, xh, xf), c in (((al, ah, af), bl if bl == bh else None), ((bl, bh, bf), al if al == ah else None)):
            if xf >= 0 and c is not None and _is_number(c):
                # a non-negative interval times a negative constant (non-negative ones were handled above)
                return _join("*", xh, c), _join("*", xl, c), -math.inf
        c = f"({al} * {bl}), ({al} * {bh}), ({ah} * {bl}), ({ah} * {bh})"
        return f"_min4({c})", f"_max4({c})", -math.inf


_FOLD: dict[str, Callable[[Any, Any], Any]] = {
         "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
         "floordiv": lambda a, b: a // max(b, 1), "min": min, "max": max}
_NAME = re.compile(r"^(e|X)\['\w+'\]$")


def _is_number(text: str) -> bool:
    """Whether a bound's source is a literal (the repr of a number). Most are names or expressions:
    they are told apart by their first character, without float()'s exception (a fifth of building a
    feature template went to raising it)."""
    if not text or not (text[0].isdigit() or text[0] in "-."):
        return text in ("inf", "nan")
    try:
        float(text)
        return True
    except ValueError:
        return False


def _number(text: str) -> float:
    value = float(text)
    return int(value) if value.is_integer() and "." not in text and "e" not in text else value


def _is_name(text: str) -> bool:
    return bool(_NAME.match(text))


def _join(op: str, a: str, b: str) -> str:
    """`a op b` with the identities of 0 and 1 applied (most bounds start at 0)."""
    if op == "+" and a == "0":
        return b
    if op in "+-" and b == "0":
        return a
    if op == "*" and (a == "0" or b == "0"):
        return "0"
    if op == "*" and a == "1":
        return b
    if op == "*" and b == "1":
        return a
    return f"({a} {op} {b})"


def _min4(a, b, c, d):
    return np.minimum(np.minimum(a, b), np.minimum(c, d))


def _max4(a, b, c, d):
    return np.maximum(np.maximum(a, b), np.maximum(c, d))


def _mod_inside(al, ah, c):
    c = np.maximum(c, 1)
    return (ah - al < c) & (al % c <= ah % c), c


def _mod_lo(al, ah, bl):
    inside, c = _mod_inside(al, ah, bl)
    return np.where(inside, al % c, 0)


def _mod_hi(al, ah, bl, bh):
    inside, c = _mod_inside(al, ah, bl)
    return np.where(inside, ah % c, np.maximum(bh - 1, 0))
