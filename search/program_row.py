"""What the cost model sees of a program: one row, its main stage's features beside the sum of the rest,
and the schedule's own numbers (search.knobs).

Ansor scores a program as the sum of per-stage scores (pack-sum: one feature row a stage, each stage's
prediction added). A stage's worth then cannot depend on the other stages: a conv's register tile is
scored the same whether its kernel is copied into a packed buffer above it, inside it, or not at all,
and the copy is scored the same whatever tile reads it. On the 512-program NHWC conv histories of the
Zen 4 VM (three seeds, 2026-11-29) that left held-out pairwise accuracy at 0.773-0.801; one row a
program, the main stage's 164 features and the sum of the other stages' 164, ordered the same held-out
programs at 0.800-0.811 (the same folds, the same XGBoost; docs/performance.md, "One row a program").

The main stage is the one with the most floating-point operations (the `ops` group's float fields,
their counts taken back out of the features' log scale and added), the first of them on a tie: the conv
or matmul, Winograd's batched product, a pool's reduction. It fills the first half on every task, so one
model serves all tasks as pack-sum's did; what the other stages do (packing copies, padding, epilogues,
Winograd's transforms) is summed into the second half, as pack-sum summed them into the score.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from tensortune.search.feature_layout import N_FEATURES, OFFSET, OP_FIELDS
from tensortune.search.knobs import KNOBS

PROGRAM_FEATURES = 2 * N_FEATURES + KNOBS
_FLOAT_OPS = np.array([OFFSET["ops"] + i for i, f in enumerate(OP_FIELDS) if f.startswith("float_")])


def program_rows(feats: Sequence[np.ndarray], knobs: np.ndarray) -> np.ndarray:
    """[programs, PROGRAM_FEATURES]: for each program's feature matrix (a row per stage), its main stage's
    row and the sum of its other rows (zeros for a program without rows), then its knob vector (`knobs`
    [programs, KNOBS], search.knobs). Vectorised over the batch (a search generation scores thousands of
    programs a call)."""
    out = np.zeros((len(feats), PROGRAM_FEATURES), np.float32)
    out[:, 2 * N_FEATURES:] = knobs
    counts = np.array([len(f) for f in feats], dtype=np.int64)
    some = np.flatnonzero(counts)
    if not len(some):
        return out
    x = np.concatenate([feats[int(i)] for i in some]).astype(np.float32, copy=False)
    n = counts[some]
    starts = np.concatenate(([0], np.cumsum(n)[:-1]))
    owner = np.repeat(np.arange(len(some)), n)
    ops = np.exp2(x[:, _FLOAT_OPS].astype(np.float64)).sum(axis=1)     # sum of 2**log2(1 + count): the counts' order
    top = ops == np.maximum.reduceat(ops, starts)[owner]
    candidates = np.flatnonzero(top)
    main = candidates[np.unique(owner[candidates], return_index=True)[1]]    # the first top row of each
    rest = x.copy()
    rest[main] = 0.0
    out[some, :N_FEATURES] = x[main]
    out[some, N_FEATURES:2 * N_FEATURES] = np.add.reduceat(rest, starts, axis=0)
    return out
