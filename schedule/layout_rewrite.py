"""Kernel layout rewrite (Ansor's `layout_rewrite`): a constant weight stored in the order its tiled
stage's loops read it.

A multi-level-tiled conv reads kernel[co, ci, kh, kw] from loops ordered like co.0 co.1 ci.0 kh.0 kw.0
co.2 ci.1 kh.1 kw.1 co.3: the innermost (vectorised) loop co.3 walks the kernel with a stride of
CI*KH*KW elements, and every register tile touches a cache line per element. Stored instead as
[co.0, co.1, ci.0, kh.0, kw.0, co.2, ci.1, kh.1, kw.1, co.3] (the tiled pieces of the axes that index the
weight, in the loop order, innermost contiguous), the same loops read it contiguously. The weight is
constant, so the transform runs once when the network is built, never in the timed kernel.

`weight_layout(state, name)` derives that layout from a State alone (its split/reorder/fuse
relations), so a record determines both the program and the stored weight. The layout maps an index of
the original tensor to the new one piece by piece: new[j] = (orig[axis_j] // stride_j) % extent_j (no
modulo for an axis' outermost piece), which lowering emits and the index simplifier folds back to the
loop variables; `WeightLayout.transform` builds the stored array (pad, reshape, transpose) with numpy.

TVM's `ComputeDAG::RewriteLayout` rewrites the DAG (a new placeholder and body) and replays the
steps; here the DAG and the steps stay as they are and lowering reads the buffer through the layout
(**changed**), so the search, the features and the records never see a second DAG.

A weight gets no layout (None) where the rule does not apply: it is read by more than one stage, or
with different indices, or an index is not a plain loop axis of its reader (e.g. `h * 2 + kh`), or
its reader's loops come from a split of a fused loop or an outer-to-inner split.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tensortune.schedule.stage import Split, Stage
from tensortune.schedule.state import State
from tensortune.tasks import te
from tensortune.tasks.te import Expr, Load, Var


@dataclass(frozen=True)
class LayoutDim:
    """One dimension of the rewritten tensor: the piece (orig[axis] // stride) % extent of the original
    index (`outer`: the axis' outermost piece, taken without the modulo)."""
    axis: int
    stride: int
    extent: int
    outer: bool


@dataclass(frozen=True)
class WeightLayout:
    """The rewritten layout of placeholder `name` (original shape `shape`)."""
    name: str
    shape: tuple[int, ...]
    dims: tuple[LayoutDim, ...]

    @property
    def new_shape(self) -> tuple[int, ...]:
        return tuple(d.extent for d in self.dims)

    def index(self, indices: Sequence[Expr]) -> list[Expr]:
        """The rewritten tensor's indices for an access of the original at `indices`."""
        out: list[Expr] = []
        for d in self.dims:
            e = te.as_expr(indices[d.axis])
            if d.stride != 1:
                e = e // d.stride
            if not d.outer:
                e = e % d.extent
            out.append(e)
        return out

    def _axis_pieces(self) -> list[list[int]]:
        """Per original axis, the positions in `dims` of its pieces, outermost (largest stride) first."""
        per: list[list[int]] = [[] for _ in self.shape]
        for j, d in enumerate(self.dims):
            per[d.axis].append(j)
        return [sorted(p, key=lambda j: -self.dims[j].stride) for p in per]

    def transform(self, array: np.ndarray) -> np.ndarray:
        """The original weight stored in this layout (C-contiguous; zeros where an axis is padded to
        a whole number of outer pieces, which the kernel never reads)."""
        if tuple(array.shape) != self.shape:
            raise ValueError(f"{self.name}: layout of a {list(self.shape)} tensor, got {list(array.shape)}")
        pieces = self._axis_pieces()
        padded = [math.prod(self.dims[j].extent for j in p) for p in pieces]
        if any(p < s for p, s in zip(padded, self.shape)):
            raise AssertionError(f"{self.name}: layout {self} does not cover the tensor")
        if padded != list(self.shape):
            array = np.pad(array, [(0, p - s) for p, s in zip(padded, self.shape)])
        split_shape = [self.dims[j].extent for p in pieces for j in p]
        order = [j for p in pieces for j in p]         # the dims position of each reshaped axis
        reshaped = array.reshape(split_shape)
        perm = [order.index(j) for j in range(len(self.dims))]
        return np.ascontiguousarray(reshaped.transpose(perm))

    def to_json(self) -> list:
        return [self.name, list(self.shape), [[d.axis, d.stride, d.extent, int(d.outer)] for d in self.dims]]

    @staticmethod
    def from_json(data: list) -> "WeightLayout":
        name, shape, dims = data
        return WeightLayout(name, tuple(shape), tuple(LayoutDim(int(a), int(s), int(e), bool(o))
                                                      for a, s, e, o in dims))


def _pieces(stage: Stage) -> tuple[dict[Var, tuple[Var, int, int]], list[Var]] | None:
    """Each atomic piece of a root axis (a root axis or split child never split again) as (root axis,
    stride, length), and the pieces in loop order (a fused loop stands for its parents, outer first).
    None where a loop is not a product of whole pieces."""
    roots = stage.op.axes + stage.op.reduce_axes
    piece: dict[Var, tuple[Var, int, int]] = {a: (a, 1, a.extent) for a in roots}
    fused: dict[Var, tuple[Var, ...]] = {}
    for rel in stage.relations:
        if isinstance(rel, Split):
            if rel.parent not in piece or not rel.inner_to_outer or any(e is None for e in rel.extents):
                return None
            root, stride, _ = piece.pop(rel.parent)
            ext = [int(e) for e in rel.extents]          # type: ignore[arg-type]
            for k, child in enumerate(rel.children):
                piece[child] = (root, stride * math.prod(ext[k + 1:]), ext[k])
        else:
            fused[rel.fused] = rel.parents
    order: list[Var] = []
    work = [it.var for it in reversed(stage.iters)]
    while work:
        v = work.pop()
        if v in fused:
            work.extend(reversed(fused[v]))
        elif v in piece:
            order.append(v)
        else:
            return None
    return piece, order


def _reader(state: State, name: str) -> tuple[Stage, tuple[Expr, ...]] | None:
    """The one stage that reads placeholder `name` and the indices it reads it at (None: read by
    several stages, at several indices, or not at all)."""
    found: list[tuple[str, tuple[Expr, ...]]] = []
    for stage_name, body in state.effective_bodies().items():
        for n in te.walk(body):
            if isinstance(n, Load) and n.tensor.name == name:
                found.append((stage_name, tuple(n.indices)))
    if not found or len({s for s, _ in found}) != 1:
        return None
    keys = {tuple(te.structural_key(i) for i in idx) for _, idx in found}
    if len(keys) != 1:
        return None
    return state.stage_by_name(found[0][0]), found[0][1]


def weight_layout(state: State, name: str) -> WeightLayout | None:
    """The layout placeholder `name` is read in by the schedule `state` (see the module docstring);
    None where the rule does not apply (the weight keeps its plain layout)."""
    tensor = next((t for t in state.dag.inputs if t.name == name), None)
    if tensor is None:
        raise KeyError(f"{name!r} is not an input of {state.dag.name or 'the DAG'}: "
                       f"{', '.join(t.name for t in state.dag.inputs)}")
    if not state.concrete:
        raise ValueError("the state still has unfilled split lengths (a sketch); fill them first")
    found = _reader(state, name)
    if found is None:
        return None
    stage, indices = found
    shape = tuple(int(s) for s in tensor.shape)
    roots = set(stage.op.axes + stage.op.reduce_axes)
    axis_of: dict[Var, int] = {}
    for d, idx in enumerate(indices):
        if isinstance(idx, Var) and idx in roots and idx not in axis_of:
            axis_of[idx] = d
        elif not (isinstance(idx, te.Const) and shape[d] == 1):
            return None
    got = _pieces(stage)
    if got is None:
        return None
    piece, order = got
    used = [v for v in order if piece[v][0] in axis_of and piece[v][2] > 1]
    dims: dict[Var, LayoutDim] = {}
    for root, d in axis_of.items():
        mine = sorted((v for v in used if piece[v][0] is root), key=lambda v: -piece[v][1])
        for k, v in enumerate(mine):
            _, stride, length = piece[v]
            if k == 0:
                dims[v] = LayoutDim(d, stride, -(-shape[d] // stride), True)
            else:
                dims[v] = LayoutDim(d, stride, length, False)
            if k > 0 and stride * length != piece[mine[k - 1]][1]:
                return None                          # not a mixed radix: some piece is missing
        if mine and piece[mine[-1]][1] != 1 or not mine and shape[d] != 1:
            return None
    return WeightLayout(name, shape, tuple(dims[v] for v in used))


def weight_layouts(state: State, names: Sequence[str]) -> dict[str, WeightLayout]:
    """The layouts of the placeholders `names` that the rule applies to (others keep theirs)."""
    out = {}
    for name in names:
        layout = weight_layout(state, name)
        if layout is not None:
            out[name] = layout
    return out
