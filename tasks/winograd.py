"""Winograd convolution F(m x m, 3 x 3) for 3x3, stride-1 NCHW convolutions (TVM's conv2d_winograd).

Why: most FLOPs of ResNet are 3x3 stride-1 convolutions, and the direct form already runs near the
FMA peak; Winograd does fewer multiplications. Per output tile of m x m and per (ci, co) the direct
conv does 9 m^2 multiply-adds, Winograd (m + 2)^2: 2.25x fewer at m = 2, 4x fewer at m = 4.

    Y = A^T [ sum_ci (G g G^T) . (B^T d B) ] A

The stages are the ones the search schedules (TVM's names):

- `data_pad`: the input, zero padded so every tile of (m + 2)^2 values is in bounds;
- `data_pack[eps, nu, ci, p]`: each input tile transformed by B (tile p of the N x nH x nW tiles);
- `bgemm[eps, nu, co, p]`: one matrix product per point (eps, nu) of the alpha x alpha transformed
  tile, a reduction over ci: where the FLOPs are, multi-level tiled by the search;
- `inverse[co, p, vh, vw]`: the inverse transform by A back to an m x m output tile;
- `conv2d_winograd[n, co, h, w]`: the output in NCHW, so a fused bias / relu / residual chain reads
  it as it reads the direct conv.

The weight enters already transformed (`transform_weight`: U = G g G^T, shape (alpha, alpha, CO, CI)),
as Ansor does with a constant kernel: a network computes U once at build time.

**How B and A enter (changed from TVM).** TVM writes the transforms as reductions over a constant
matrix (`const_matrix`, a select chain on the indices) and relies on the TIR simplifier to fold the
zeros and ones once the loops are unrolled. Our DSL and code generator do not fold `x * 0.0` (without
fast-math it is not an identity for inf/NaN), so the transforms are written out here: a select
chain over the transformed point (eps, nu) whose branches are the sparse sums of the tile's values
with their nonzero coefficients only. Once the sketch rule (or the default schedule) unrolls eps and
nu, every condition is a constant and the code generator emits only the taken branch: the same
straight-line arithmetic TVM's folding leaves. The stages carry `simplify_const_tensor_indices`
(TVM's attribute) naming those axes, which is what the sketch rule looks for.

The transform matrices are Cook-Toom's for the interpolation points of Barabasz et al. (2018,
"Error analysis and improving the accuracy of Winograd convolution"), as TVM's winograd_util uses:
A^T and G from the points (Vandermonde rows, G scaled by 1 / prod(a_j - a_l)), and B^T solved from
the bilinear identity, so that identity holds by construction (checked in `winograd_matrices`).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Callable

import numpy as np

from tensortune.tasks import ops, te
from tensortune.tasks.te import Expr, Tensor

# finite interpolation points per alpha (the point at infinity is the last row/column)
_POINTS: dict[int, tuple[float, ...]] = {
    4: (0.0, -1.0, 1.0),
    6: (0.0, -1.0, 1.0, 0.5, -2.0),
}
TILE_SIZES = (2, 4)
CONST_INDICES_ATTR = "simplify_const_tensor_indices"


@dataclass(frozen=True)
class WinogradMatrices:
    """The transforms of F(m, r): Y = A_T (G g G^T . B_T d B_T^T) A_T^T (2-D: applied on both sides)."""
    m: int
    r: int
    A_T: np.ndarray      # (m, alpha)
    B_T: np.ndarray      # (alpha, alpha)
    G: np.ndarray        # (alpha, r)

    @property
    def alpha(self) -> int:
        return self.m + self.r - 1


def _rational(x: float) -> float:
    """Snap a solved coefficient to the small fraction it is (lstsq leaves ~1e-16 noise)."""
    return float(Fraction(x).limit_denominator(1024))


@lru_cache(maxsize=None)
def winograd_matrices(m: int, r: int = 3) -> WinogradMatrices:
    """A^T, B^T and G of F(m x m, r x r) (computed in float64; m in TILE_SIZES, r = 3)."""
    alpha = m + r - 1
    if r != 3 or alpha not in _POINTS:
        raise ValueError(f"Winograd F({m}, {r}) is not supported; use r = 3 and m in {TILE_SIZES}")
    a = _POINTS[alpha]
    n = alpha - 1
    A_T = np.zeros((m, alpha))
    G = np.zeros((alpha, r))
    for j in range(n):
        f = float(np.prod([a[j] - a[k] for k in range(n) if k != j]))
        A_T[:, j] = [a[j] ** i for i in range(m)]
        G[j] = [a[j] ** k / f for k in range(r)]
    A_T[m - 1, alpha - 1] = 1.0
    G[alpha - 1, r - 1] = 1.0
    # y_i = sum_k g_k d_{i+k} = sum_j A_T[i, j] (G g)_j (B_T d)_j for all d, g: for each column l of
    # B_T a linear system over the (i, k) pairs
    M = np.array([[A_T[i, j] * G[j, k] for j in range(alpha)] for i in range(m) for k in range(r)])
    B_T = np.zeros((alpha, alpha))
    for col in range(alpha):
        rhs = np.array([1.0 if col == i + k else 0.0 for i in range(m) for k in range(r)])
        B_T[:, col] = [_rational(x) for x in np.linalg.lstsq(M, rhs, rcond=None)[0]]
    check = np.einsum("ij,jk,jl->ikl", A_T, G, B_T)
    want = np.array([[[1.0 if col == i + k else 0.0 for col in range(alpha)] for k in range(r)] for i in range(m)])
    if not np.allclose(check, want, rtol=0, atol=1e-12):
        raise ArithmeticError(f"the Cook-Toom matrices of F({m}, {r}) do not satisfy the convolution identity")
    return WinogradMatrices(m, r, A_T, B_T, G)


def transform_weight(weight: np.ndarray, m: int) -> np.ndarray:
    """U = G g G^T of an OIHW 3x3 weight, laid out (alpha, alpha, CO, CI) as bgemm reads it; float64
    arithmetic, the weight's dtype out. A network does this once, at build time."""
    w = np.asarray(weight)
    if w.ndim != 4 or w.shape[2:] != (3, 3):
        raise ValueError(f"Winograd needs a (CO, CI, 3, 3) weight, got shape {list(w.shape)}")
    G = winograd_matrices(m).G
    u = np.einsum("ek,oikl,nl->enoi", G, w.astype(np.float64), G)
    return np.ascontiguousarray(u.astype(w.dtype))


def _sparse_sum(terms: list[tuple[float, Expr]]) -> Expr:
    """sum(c * v) without the zero terms; c = 1 and -1 need no multiplication."""
    out: Expr | None = None
    for c, v in terms:
        if c == 0.0:
            continue
        if out is None:
            out = v if c == 1.0 else (-v if c == -1.0 else v * c)
        elif c == 1.0:
            out = out + v
        elif c == -1.0:
            out = out - v
        else:
            out = out + v * c
    if out is None:
        raise ArithmeticError("a transform row without nonzero coefficients")
    return out


def _two_sided(mat: np.ndarray, i: Expr, j: Expr, value: Callable[[int, int], Expr]) -> Expr:
    """sum_{a, b} mat[i, a] mat[j, b] value(a, b) as a select chain over the constant rows (i, j)."""
    rows, cols = mat.shape
    out: Expr | None = None
    for ri in reversed(range(rows)):
        inner: Expr | None = None
        for rj in reversed(range(rows)):
            v = _sparse_sum([(float(mat[ri, a] * mat[rj, b]), value(a, b)) for a in range(cols) for b in range(cols)])
            inner = v if inner is None else te.if_then_else(j == rj, v, inner)
        assert inner is not None
        out = inner if out is None else te.if_then_else(i == ri, inner, out)
    assert out is not None
    return out


def _two_sided_flops(mat: np.ndarray) -> int:
    """Float operations of `_two_sided` over all rows² branches (each element runs one branch)."""
    rows, cols = mat.shape
    total = 0
    for ri in range(rows):
        for rj in range(rows):
            cs = [float(mat[ri, a] * mat[rj, b]) for a in range(cols) for b in range(cols)]
            nz = [c for c in cs if c != 0.0]
            total += 2 * len(nz) - 1 - sum(1 for c in nz if c in (1.0, -1.0))
    return total


def output_tiles(n: int, oh: int, ow: int, m: int) -> tuple[int, int, int]:
    """(tiles along H, tiles along W, all tiles P = N * nH * nW)."""
    nh, nw = -(-oh // m), -(-ow // m)
    return nh, nw, n * nh * nw


def conv2d_winograd_nchw(data: Tensor, U: Tensor, padding=1, name: str = "conv2d_winograd") -> Tensor:
    """3x3, stride-1, dilation-1, groups-1 conv2d of NCHW `data` with the transformed kernel
    U (alpha, alpha, CO, CI) (see `transform_weight`); m = alpha - 2. Output NCHW."""
    ops._check_rank(data, 4, "conv2d_winograd", "NCHW")
    ops._check_rank(U, 4, "conv2d_winograd", "alpha alpha CO CI")
    alpha = U.shape[0]
    m = alpha - 2
    if U.shape[1] != alpha or m not in TILE_SIZES:
        raise ValueError(f"conv2d_winograd: U must be (alpha, alpha, CO, CI) with alpha in "
                         f"{[t + 2 for t in TILE_SIZES]}, got {list(U.shape)}")
    n, ci, h, w = data.shape
    co = U.shape[2]
    if U.shape[3] != ci:
        raise ValueError(f"conv2d_winograd: data has {ci} channels but U expects {U.shape[3]}")
    ph, pw = ops._pair(padding)
    oh = ops._out_size(h, 3, 1, ph, ph, 1, "conv2d_winograd height")
    ow = ops._out_size(w, 3, 1, pw, pw, 1, "conv2d_winograd width")
    nh, nw, P = output_tiles(n, oh, ow, m)
    mats = winograd_matrices(m)
    # pad so that the last tile's (m + 2) rows and columns exist: nH * m + 2 in all
    data_pad = ops.pad(data, (0, 0, ph, pw), (0, 0, nh * m + 2 - h - ph, nw * m + 2 - w - pw), name="data_pad")

    def pack(eps, nu, c, p):
        b, y, x = p // (nh * nw), p // nw % nh, p % nw
        return _two_sided(mats.B_T, eps, nu, lambda ra, rb: data_pad[b, c, y * m + ra, x * m + rb])

    data_pack = te.compute((alpha, alpha, ci, P), pack, name="data_pack",
                           attrs={CONST_INDICES_ATTR: "eps,nu", "FLOP": float(_two_sided_flops(mats.B_T) * ci * P)})
    rc = te.reduce_axis(ci, "rc")
    bgemm = te.compute((alpha, alpha, co, P), lambda eps, nu, k, p: te.sum(
        U[eps, nu, k, rc] * data_pack[eps, nu, rc, p], axis=[rc]), name="bgemm")

    def inv(k, p, vh, vw):
        return _two_sided(mats.A_T, vh, vw, lambda ra, rb: bgemm[ra, rb, k, p])

    inverse = te.compute((co, P, m, m), inv, name="inverse",
                         attrs={CONST_INDICES_ATTR: "vh,vw", "FLOP": float(_two_sided_flops(mats.A_T) * co * P)})
    return te.compute((n, co, oh, ow), lambda b, k, y, x: inverse[
        k, b * (nh * nw) + y // m * nw + x // m, y % m, x % m], name=name)


def transform_weight_hwio(weight: np.ndarray, m: int) -> np.ndarray:
    """U of an HWIO 3x3 weight (an NHWC conv's), laid out (alpha, alpha, CI, CO) as the NHWC bgemm
    reads it: output channels innermost, the axis its register tile vectorises."""
    w = np.asarray(weight)
    if w.ndim != 4 or w.shape[:2] != (3, 3):
        raise ValueError(f"Winograd needs a (3, 3, CI, CO) weight, got shape {list(w.shape)}")
    G = winograd_matrices(m).G
    u = np.einsum("ek,klio,nl->enio", G, w.astype(np.float64), G)
    return np.ascontiguousarray(u.astype(w.dtype))


def conv2d_winograd_nhwc(data: Tensor, U: Tensor, pads=(1, 1, 1, 1), name: str = "conv2d_winograd") -> Tensor:
    """The NHWC form (TVM's conv2d_winograd_nhwc): NHWC `data`, U (alpha, alpha, CI, CO) from
    `transform_weight_hwio`, pads (top, left, bottom, right), output NHWC. The stages are those of
    the NCHW form with channels innermost: data_pack[eps, nu, p, ci], bgemm[eps, nu, p, co] (per
    point a (P x CI) by (CI x CO) matrix product, vectorised over co as an NHWC conv is),
    inverse[vh, vw, p, co]."""
    ops._check_rank(data, 4, "conv2d_winograd", "NHWC")
    ops._check_rank(U, 4, "conv2d_winograd", "alpha alpha CI CO")
    alpha = U.shape[0]
    m = alpha - 2
    if U.shape[1] != alpha or m not in TILE_SIZES:
        raise ValueError(f"conv2d_winograd: U must be (alpha, alpha, CI, CO) with alpha in "
                         f"{[t + 2 for t in TILE_SIZES]}, got {list(U.shape)}")
    n, h, w, ci = data.shape
    co = U.shape[3]
    if U.shape[2] != ci:
        raise ValueError(f"conv2d_winograd: data has {ci} channels but U expects {U.shape[2]}")
    pt, pl, pb, pr = pads
    oh = ops._out_size(h, 3, 1, pt, pb, 1, "conv2d_winograd height")
    ow = ops._out_size(w, 3, 1, pl, pr, 1, "conv2d_winograd width")
    nh, nw, P = output_tiles(n, oh, ow, m)
    mats = winograd_matrices(m)
    data_pad = ops.pad(data, (0, pt, pl, 0), (0, nh * m + 2 - h - pt, nw * m + 2 - w - pl, 0), name="data_pad")

    def pack(eps, nu, p, c):
        b, y, x = p // (nh * nw), p // nw % nh, p % nw
        return _two_sided(mats.B_T, eps, nu, lambda ra, rb: data_pad[b, y * m + ra, x * m + rb, c])

    data_pack = te.compute((alpha, alpha, P, ci), pack, name="data_pack",
                           attrs={CONST_INDICES_ATTR: "eps,nu", "FLOP": float(_two_sided_flops(mats.B_T) * ci * P)})
    rc = te.reduce_axis(ci, "rc")
    bgemm = te.compute((alpha, alpha, P, co), lambda eps, nu, p, k: te.sum(
        data_pack[eps, nu, p, rc] * U[eps, nu, rc, k], axis=[rc]), name="bgemm")

    def inv(vh, vw, p, k):
        return _two_sided(mats.A_T, vh, vw, lambda ra, rb: bgemm[ra, rb, p, k])

    inverse = te.compute((m, m, P, co), inv, name="inverse",
                         attrs={CONST_INDICES_ATTR: "vh,vw", "FLOP": float(_two_sided_flops(mats.A_T) * co * P)})
    return te.compute((n, oh, ow, co), lambda b, y, x, k: inverse[
        y % m, x % m, b * (nh * nw) + y // m * nw + x // m, k], name=name)


def parse_tiles(text: str | None) -> tuple[int, ...]:
    """A `--winograd` value: "2,4" -> (2, 4), "" or None -> (); ValueError naming what is wrong."""
    if not text:
        return ()
    try:
        tiles = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise ValueError(f"--winograd takes tile sizes separated by commas (e.g. 2,4), got {text!r}") from None
    if not tiles or any(t not in TILE_SIZES for t in tiles):
        raise ValueError(f"--winograd tile sizes must be among {', '.join(map(str, TILE_SIZES))}, got {text!r}")
    return tiles


def eligible(kernel_shape: tuple[int, ...], strides, dilations, groups: int) -> bool:
    """Whether a conv2d can take the Winograd form: 3x3, stride 1, dilation 1, groups 1."""
    return (len(kernel_shape) == 4 and tuple(kernel_shape[2:]) == (3, 3) and tuple(ops._pair(strides)) == (1, 1)
            and tuple(ops._pair(dilations)) == (1, 1) and groups == 1)
