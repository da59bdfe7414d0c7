"""A stage's loops as lowering needs them: every iterator's extent, each root axis as an expression of
the leaf loop variables, and the guards of imperfect splits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tensortune.schedule.stage import Split, Stage
from tensortune.tasks import te
from tensortune.tasks.te import Var


@dataclass
class LoopStructure:
    """Loop extents and root-axis values of a stage for given root extents (its inferred region)."""
    extents: dict            # Var -> int, every iterator var (leaf and intermediate)
    values: dict             # root axis Var -> Expr over leaf vars
    conds: list              # guards for imperfect splits


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else te.minimum(a, b)


def _ceildiv(a, b):
    return -(-a // b) if isinstance(a, int) and isinstance(b, int) else (a + b - 1) // b


def split_lengths(rel: "Split") -> tuple:
    """The lengths a split was made with (factors of the inner pieces, or part counts)."""
    return rel.extents[1:] if rel.inner_to_outer else rel.extents[:-1]


def loop_structure(stage: Stage, root_extents: Sequence | None = None, lengths=split_lengths) -> LoopStructure:
    """Propagate root extents down the split/fuse relations (TVM's PassDownDomain: a split piece is
    min(factor, parent extent)), then express each root axis by the leaf loop variables.

    Works on ints, or on expressions when `root_extents`/`lengths(rel)` are symbolic (the feature
    templates); guards are only computed for ints."""
    roots = stage.op.axes + stage.op.reduce_axes
    ext: dict = dict(zip(roots, root_extents if root_extents is not None else [a.extent for a in roots]))
    mults: dict = {}
    for rel in stage.relations:
        if isinstance(rel, Split):
            rest = ext[rel.parent]
            lens = lengths(rel)
            if rel.inner_to_outer:      # lengths are factors of the inner pieces
                pieces = []
                for ln in reversed(lens):
                    pieces.append(_min(ln, rest))
                    rest = _ceildiv(rest, ln)
                child_ext = [rest] + pieces[::-1]
                mults[rel] = list(lens)
            else:                       # lengths are part counts of the outer pieces
                child_ext, strides = [], []
                for ln in lens:
                    child_ext.append(_min(ln, rest))
                    rest = _ceildiv(rest, ln)
                    strides.append(rest)
                child_ext.append(rest)
                mults[rel] = strides
            for c, e in zip(rel.children, child_ext):
                ext[c] = e
        else:
            ext[rel.fused] = _prod(ext[v] for v in rel.parents)
    val: dict[Var, te.Expr] = {it.var: it.var for it in stage.iters}
    conds: list[te.Expr] = []
    for rel in reversed(stage.relations):
        if isinstance(rel, Split):
            m = mults[rel]
            if rel.inner_to_outer:
                expr, top = val[rel.children[0]], ext[rel.children[0]] - 1
                for child, factor in zip(rel.children[1:], m):
                    expr = expr * factor + val[child]
                    top = top * factor + ext[child] - 1
            else:
                expr, top = val[rel.children[-1]], ext[rel.children[-1]] - 1
                for child, stride in zip(reversed(rel.children[:-1]), reversed(m)):
                    expr = expr + val[child] * stride
                    top = top + (ext[child] - 1) * stride
            val[rel.parent] = expr
            if isinstance(top, int) and isinstance(ext[rel.parent], int) and top >= ext[rel.parent]:
                conds.append(expr < ext[rel.parent])
        else:
            f, stride = val[rel.fused], 1
            for k in range(len(rel.parents) - 1, -1, -1):
                q = f // stride if not (isinstance(stride, int) and stride == 1) else f
                val[rel.parents[k]] = q if k == 0 else q % ext[rel.parents[k]]
                stride = stride * ext[rel.parents[k]]
    return LoopStructure(ext, {r: val[r] for r in roots}, conds)


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


