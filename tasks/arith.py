"""Integer arithmetic on index expressions: interval bounds and an affine normal form.

Lowering needs two answers about index math: "what range can this take?" (bounds checks, guards,
buffer sizes) and "is this the same as that?" (region extents that must be constants). Both come from
rewriting an expression as `sum(coef * atom) + const`, where atoms are variables or opaque
non-linear sub-expressions.
"""
from __future__ import annotations

import math
from typing import Mapping

from tensortune.tasks import te
from tensortune.tasks.te import Expr

INF = math.inf
Range = tuple  # (lo, hi), inclusive, ints or +-inf


def _floordiv_bound(v, c: int):
    return v if v in (INF, -INF) else v // c


def const_bounds(e: Expr, ranges: Mapping[te.Var, Range]) -> Range:
    """Inclusive numeric bounds of e when each var in `ranges` spans its range (others unbounded)."""
    if isinstance(e, te.Const):
        return (e.value, e.value)
    if isinstance(e, te.Var):
        return ranges.get(e, (-INF, INF))
    if isinstance(e, te.BinOp):
        (al, ah), (bl, bh) = const_bounds(e.a, ranges), const_bounds(e.b, ranges)
        op = e.op
        if op == "add":
            return (al + bl, ah + bh)
        if op == "sub":
            return (al - bh, ah - bl)
        if op == "mul":
            cands = [x * y for x in (al, ah) for y in (bl, bh) if not (x == 0 and abs(y) == INF)
                     and not (y == 0 and abs(x) == INF)] or [0]
            return (min(cands), max(cands))
        if op == "floordiv" and bl == bh and isinstance(bl, int) and bl > 0:
            return (_floordiv_bound(al, bl), _floordiv_bound(ah, bl))
        if op == "floormod" and bl == bh and isinstance(bl, int) and bl > 0:
            if al != -INF and ah != INF and al // bl == ah // bl:
                return (al % bl, ah % bl)
            return (0, bl - 1)
        if op == "min":
            return (min(al, bl), min(ah, bh))
        if op == "max":
            return (max(al, bl), max(ah, bh))
        return (-INF, INF)
    if isinstance(e, te.Select):
        (tl, th), (fl, fh) = const_bounds(e.t, ranges), const_bounds(e.f, ranges)
        return (min(tl, fl), max(th, fh))
    if isinstance(e, te.Cast):
        return const_bounds(e.value, ranges)
    if isinstance(e, (te.Cmp, te.Not)):
        return (0, 1)
    return (-INF, INF)


class Affine:
    """sum(coef * atom) + const over integers; atoms are Vars or opaque expressions (by structure)."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: dict | None = None, const: int = 0):
        self.terms: dict[tuple, tuple[Expr, int]] = terms or {}
        self.const = const

    @staticmethod
    def atom(e: Expr) -> "Affine":
        return Affine({te.structural_key(e): (e, 1)})

    def is_const(self) -> bool:
        return not self.terms

    def __add__(self, o: "Affine") -> "Affine":
        terms = dict(self.terms)
        for k, (a, c) in o.terms.items():
            nc = terms[k][1] + c if k in terms else c
            if nc:
                terms[k] = (a, nc)
            else:
                terms.pop(k, None)
        return Affine(terms, self.const + o.const)

    def scale(self, s: int) -> "Affine":
        if s == 0:
            return Affine()
        return Affine({k: (a, c * s) for k, (a, c) in self.terms.items()}, self.const * s)

    def __sub__(self, o: "Affine") -> "Affine":
        return self + o.scale(-1)

    def to_expr(self) -> Expr:
        def order(item):
            a, c = item
            return (0 if isinstance(a, te.Var) else 1, getattr(a, "name", ""), -abs(c))
        out: Expr | None = None
        for a, c in sorted(self.terms.values(), key=order):
            term = a if c == 1 else te.binary("mul", a, c) if c > 0 else te.binary("mul", a, -c)
            if out is None:
                out = term if c > 0 else te.binary("sub", te.const(0), term)
            else:
                out = te.binary("add" if c > 0 else "sub", out, term)
        if out is None:
            return te.const(self.const)
        if self.const > 0:
            return te.binary("add", out, self.const)
        if self.const < 0:
            return te.binary("sub", out, -self.const)
        return out


def to_affine(e: Expr, ranges: Mapping[te.Var, Range] | None = None) -> Affine:
    """Normal form of an integer expression; `ranges` (var -> (lo, hi)) enables div/mod folding."""
    ranges = ranges or {}
    if isinstance(e, te.Const):
        return Affine(const=int(e.value))
    if isinstance(e, te.Var):
        return Affine() if ranges.get(e) == (0, 0) else Affine.atom(e)
    if isinstance(e, te.BinOp) and not te.is_float(e.dtype):
        if e.op in ("add", "sub"):
            a, b = to_affine(e.a, ranges), to_affine(e.b, ranges)
            return a + b if e.op == "add" else a - b
        if e.op == "mul":
            a, b = to_affine(e.a, ranges), to_affine(e.b, ranges)
            if b.is_const():
                return a.scale(b.const)
            if a.is_const():
                return b.scale(a.const)
            return Affine.atom(te.binary("mul", a.to_expr(), b.to_expr()))
        if e.op in ("floordiv", "floormod") and isinstance(e.b, te.Const) and e.b.value > 0:
            c = int(e.b.value)
            x = to_affine(e.a, ranges)
            whole = Affine({k: (a, co // c) for k, (a, co) in x.terms.items() if co % c == 0})
            rest = Affine({k: (a, co) for k, (a, co) in x.terms.items() if co % c != 0}, x.const)
            if rest.is_const():
                return whole + Affine(const=rest.const // c) if e.op == "floordiv" else Affine(const=rest.const % c)
            lo, hi = const_bounds(rest.to_expr(), ranges)
            if e.op == "floordiv":
                if lo != -INF and hi != INF and lo // c == hi // c:
                    return whole + Affine(const=lo // c)
                return whole + Affine.atom(te.binary("floordiv", rest.to_expr(), c))
            if lo != -INF and hi != INF and lo // c == hi // c:
                return rest + Affine(const=-(lo // c) * c)
            return Affine.atom(te.binary("floormod", rest.to_expr(), c))
        if e.op in ("min", "max"):
            a, b = to_affine(e.a, ranges), to_affine(e.b, ranges)
            d = a - b
            if d.is_const():
                return (a if d.const <= 0 else b) if e.op == "min" else (a if d.const >= 0 else b)
            return Affine.atom(te.binary(e.op, a.to_expr(), b.to_expr()))
    return Affine.atom(e)


def _merge_divmod(a: Affine, ranges) -> Affine:
    """(x // c) * c + x % c == x: undo the div/mod pairs that fusing then splitting leaves behind."""
    changed = True
    while changed:
        changed = False
        for key, (atom, coef) in list(a.terms.items()):
            if not (isinstance(atom, te.BinOp) and atom.op == "floordiv" and isinstance(atom.b, te.Const)):
                continue
            c = int(atom.b.value)
            if coef % c:
                continue
            mod = te.binary("floormod", atom.a, c)
            mkey = te.structural_key(mod)
            if mkey in a.terms and a.terms[mkey][1] * c == coef:
                terms = dict(a.terms)
                del terms[key], terms[mkey]
                a = Affine(terms, a.const) + to_affine(atom.a, ranges).scale(coef // c)
                changed = True
                break
    return a


def simplify(e: Expr, ranges: Mapping[te.Var, Range] | None = None) -> Expr:
    """Canonical, folded form of an integer index expression (other expressions are returned as is)."""
    if te.is_float(e.dtype) or e.dtype == "bool":
        return e
    return _merge_divmod(to_affine(e, ranges), ranges).to_expr()


def symbolic_bounds(e: Expr, ranging: Mapping[te.Var, Range]) -> tuple[Affine, Affine] | None:
    """Bounds of e as affine expressions of the vars NOT in `ranging` (those are held fixed).

    Returns None when a non-linear part depends on a ranging var in a way we cannot bound.
    """
    a = to_affine(e, ranging)
    lo, hi = Affine(const=a.const), Affine(const=a.const)
    for atom, coef in a.terms.values():
        if isinstance(atom, te.Var):
            if atom in ranging:
                rl, rh = ranging[atom]
                lo = lo + Affine(const=coef * (rl if coef > 0 else rh))
                hi = hi + Affine(const=coef * (rh if coef > 0 else rl))
            else:
                lo, hi = lo + Affine.atom(atom).scale(coef), hi + Affine.atom(atom).scale(coef)
            continue
        if not (te.free_vars(atom) & set(ranging)):
            lo, hi = lo + Affine.atom(atom).scale(coef), hi + Affine.atom(atom).scale(coef)
            continue
        sub = _atom_bounds(atom, ranging)
        if sub is None:
            return None
        al, ah = sub
        if coef > 0:
            lo, hi = lo + al.scale(coef), hi + ah.scale(coef)
        else:
            lo, hi = lo + ah.scale(coef), hi + al.scale(coef)
    return lo, hi


def _atom_bounds(atom: Expr, ranging: Mapping[te.Var, Range]) -> tuple[Affine, Affine] | None:
    if isinstance(atom, te.BinOp) and isinstance(atom.b, te.Const) and atom.b.value > 0:
        c = int(atom.b.value)
        inner = symbolic_bounds(atom.a, ranging)
        if inner is None:
            return None
        il, ih = inner
        if atom.op == "floordiv":
            if il.is_const() and ih.is_const():
                return Affine(const=il.const // c), Affine(const=ih.const // c)
            return (to_affine(te.binary("floordiv", il.to_expr(), c)),
                    to_affine(te.binary("floordiv", ih.to_expr(), c)))
        if atom.op == "floormod":
            if il.is_const() and ih.is_const() and il.const // c == ih.const // c:
                return Affine(const=il.const % c), Affine(const=ih.const % c)
            return Affine(const=0), Affine(const=c - 1)
    if isinstance(atom, te.BinOp) and atom.op in ("min", "max"):
        a, b = symbolic_bounds(atom.a, ranging), symbolic_bounds(atom.b, ranging)
        if a is None or b is None:
            return None
        pick = affine_min if atom.op == "min" else affine_max
        lo, hi = pick(a[0], b[0]), pick(a[1], b[1])
        return (lo, hi) if lo is not None and hi is not None else None
    lo, hi = const_bounds(atom, ranging)
    if lo == -INF or hi == INF:
        return None
    return Affine(const=int(lo)), Affine(const=int(hi))


def affine_min(a: Affine, b: Affine) -> Affine | None:
    """The smaller of two affine forms when their difference is a constant, else None."""
    d = a - b
    return (a if d.const <= 0 else b) if d.is_const() else None


def affine_max(a: Affine, b: Affine) -> Affine | None:
    d = a - b
    return (a if d.const >= 0 else b) if d.is_const() else None
