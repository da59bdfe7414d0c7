"""The default schedule of an NHWC Winograd convolution: the transforms and the batched product fused
per block of output tiles, so the transformed tiles never leave the cache.

Scheduled stage by stage at the root (the generic default, and what the search had found), an F(2)
conv of 56² x 64 -> 64 runs three passes over memory: `data_pack` writes 16 transformed values per
input value (3.2 MB), `bgemm` reads them and writes as many, `inverse` reads those back. Timed as
separate kernels (Zen 5, 2 threads, warm) the pack took 0.144 ms and the inverse 0.052 of the
conv's 0.55; the search's best programs ran 0.43-0.49 ms, no faster than ONNX Runtime's direct conv
(0.45). Fused, the whole conv ran 0.30 ms (28² x 128: 0.33 against 0.51 root by root; 14² x 256:
0.38 against 0.59; a scratch sweep of this file's parameters, outputs identical).

The padding is inlined into the input transform: the transform reads the unpadded input, its
out-of-image taps are zeros (on an image of one tile, where the tile is known, they fold to constant
products, which the code generator emits once each).

The nest, per parallel block of output rows (`rows` rows of m x m tiles) and output channels (`kc`):

    output[b, y, x, k]         (the fused epilogue: bias, residual, relu inlined; the reindex too)
      inverse[vh, vw, p, k]    for the block's tiles: A^T M A, vh and vw unrolled, k vectorised
        bgemm[eps, nu, p, k]   for the block: per point a (tiles x CI) by (CI x kc) product, with a
                               register tile of `pt` tiles x `kt` channels (the reduction outside it)
          data_pack[...]       for the block's tiles, every input channel: B^T d B, the padding
                               inlined, eps and nu unrolled, channels vectorised

`pt` is the largest divisor of the tiles per row up to 8 (an exact split: a guard inside the
register tile costs 2-3x), `kt` two vectors (7 x 32: 14 accumulators). Each block reads the slice
of the transformed weight U (alpha² x CI x kc) its channels need: blocks of tile rows read all of U
each, blocks of channels read disjoint slices but transform every input tile each. So a block is a
row of tiles where there are at least as many tiles as output channels (U is no larger than the
transformed input), else all tiles and an eighth of the channels. Timed cold, as networks time
kernels (the network's footprint flushed first; Zen 5, 2 threads): 14² x 256 0.47 ms by channels
against 0.56 by rows; 56² x 64 0.33 by rows. These are starting points: the search measures this
program first and mutates its split lengths like any other program's.
"""
from __future__ import annotations

from tensortune.schedule.state import State
from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.winograd import output_tiles

LANES = 16               # float32 lanes of the vectors the default schedules assume
MAX_TILE_POINTS = 8      # tiles in the register tile, at most
CHANNEL_BLOCKS = 8       # blocks of output channels, where a block takes every tile


def winograd_nhwc_schedule(dag: ComputeDAG, rows: int | None = None, kc: int | None = None,
                           pt: int | None = None, kt: int | None = None) -> State | None:
    """The fused schedule of an NHWC Winograd conv DAG (tasks.winograd.conv2d_winograd_nhwc and the
    epilogue fused after it); None for any other DAG, or channel counts that are not whole vectors.
    rows, kc, pt, kt: the block and register tile (None: chosen as the module docstring says)."""
    named = {t.name: t for t in dag.tensors}
    pack, bgemm, inverse = named.get("data_pack"), named.get("bgemm"), named.get("inverse")
    if pack is None or bgemm is None or inverse is None or len(dag.outputs) != 1:
        return None
    out = dag.outputs[0]
    alpha = bgemm.shape[0]
    m = alpha - 2
    if len(out.shape) != 4 or len(bgemm.shape) != 4 or tuple(inverse.shape[:2]) != (m, m):
        return None                     # the NCHW form keeps the generic default
    n, oh, ow, co = out.shape
    ci = pack.shape[3]
    nh, nw, tiles = output_tiles(n, oh, ow, m)
    if tuple(bgemm.shape) != (alpha, alpha, tiles, co) or co % LANES or ci % LANES:
        return None
    pt = pt or max(d for d in range(1, MAX_TILE_POINTS + 1) if nw % d == 0)
    kt = kt or (2 * LANES if co % (2 * LANES) == 0 else LANES)
    auto_rows, auto_kc = (1, co) if tiles >= co else (nh, max(kt, co // CHANNEL_BLOCKS))
    rows, kc = rows or auto_rows, kc or auto_kc
    if co % kc or kc % LANES:
        kc = co

    s = State(dag)
    keep = {pack.name, bgemm.name, inverse.name, out.name}
    for t in dag.tensors:
        if not t.is_placeholder and t.name not in keep:
            s = s.compute_inline(t.name)          # the padding, the NHWC reindex, bias / residual / relu
    o = out.name
    # output (b, y, x, k) -> parallel (b, y.0, k.0), then y.1, x, k.1, k.2 (vector)
    s = s.split(o, 1, [min(m * rows, oh)]).split(o, 4, [kc // LANES, LANES])
    s = s.reorder(o, [0, 1, 4, 2, 3, 5, 6]).fuse(o, [0, 1, 2]).parallel(o, 0).vectorize(o, 4)
    # inverse (vh, vw, p, k) -> p.0 (one: the block's tiles), p.1, k.0, vh, vw, k.1 (vector)
    s = s.compute_at(inverse.name, o, 0)
    s = s.split(inverse.name, 3, [LANES]).split(inverse.name, 2, [tiles])
    s = s.reorder(inverse.name, [2, 3, 4, 0, 1, 5])
    s = s.unroll(inverse.name, 3).unroll(inverse.name, 4).vectorize(inverse.name, 5)
    # bgemm (eps, nu, p, k, rc) -> eps.0 (one), eps.1, nu, p.0, k.0, rc, p.1, k.1 (vector)
    s = s.compute_at(bgemm.name, inverse.name, 0)
    s = s.split(bgemm.name, 2, [pt]).split(bgemm.name, 4, [kt])
    s = s.reorder(bgemm.name, [0, 1, 2, 4, 6, 3, 5]).unroll(bgemm.name, 5).vectorize(bgemm.name, 6)
    s = s.split(bgemm.name, 0, [alpha])
    # data_pack (eps, nu, p, c) -> p, c.0, eps, nu, c.1 (vector)
    s = s.compute_at(pack.name, bgemm.name, 0)
    s = s.split(pack.name, 3, [LANES]).reorder(pack.name, [2, 3, 0, 1, 4])
    return s.unroll(pack.name, 2).unroll(pack.name, 3).vectorize(pack.name, 4)
