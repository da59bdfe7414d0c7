"""The schedule's own numbers, in step order, and the tiles they make: what AutoTVM's cost model called
knob features.

Ansor's features describe the loop nest a program lowers to (loop extents, strides, reuse, arithmetic
per buffer access), log-scaled and summed per stage. A search's late rounds measure hundreds of programs
within a few percent of each other (on the Zen 4 VM's 512-trial conv histories, a fifth to a half of all
pairs lie within 5 %, and a second timing orders 72-79 % of those pairs alike), and there the features
tell too little apart: the model ordered such pairs at 0.52-0.69. Beside the features, the numbers that
made the program (each split's factors, each compute-at position, each unroll depth) lifted held-out
pairwise accuracy on stored 512-trial histories (up or even in twelve of twelve: conv 0.721-0.811 to
0.734-0.823, matmul 0.792-0.854 to 0.816-0.859) and left a network's small tasks where they were
(docs/performance.md, "The schedule's numbers beside the features").

Positions mean the same thing across the programs of one sketch (their steps differ only in numbers),
which is where the model needs them; across sketches and tasks they do not, and the features say which
sketch and task a row is, so the trees can split on those first.

A tile's size is a product of factors (a matmul's register tile is the innermost factors of its two
spatial splits multiplied), which trees can only approximate by splitting on each factor in turn. So the vector also
holds each split's tile at each level (the log2 of its factors multiplied from the innermost outward)
and, per level from the innermost, the sum over every split (the log2 of the tile's volume at that
level, and at that level and all inside it). On the same twelve histories that lifted held-out accuracy
again in ten (matmul mean 0.833 → 0.840, conv 0.798 → 0.807, two XGBoost seeds alike), and a MobileNet-V2
task never seen by one model over the others from 0.590 to 0.623 (docs/performance.md, "Tile sizes
beside the schedule's numbers").
"""
from __future__ import annotations

import math
from itertools import accumulate
from typing import Sequence

import numpy as np

from tensortune.schedule.stage import ANNOTATIONS
from tensortune.schedule.steps import (
    AnnotationStep,
    ComputeAtStep,
    FollowSplitStep,
    FuseStep,
    PragmaStep,
    SplitStep,
    Step,
)

# numbers a program keeps in step order, the rest dropped: a conv's sketches have 30, a matmul's 17
STEP_NUMBERS = 64
# each split's tiles, innermost outward, in split order: a conv's sketches have 15, a matmul's 7
SPLIT_TILES = 32
# loop levels, from the innermost, whose tiles are multiplied over every split
LEVELS = 4
KNOBS = STEP_NUMBERS + SPLIT_TILES + 2 * LEVELS
# what a slot holds when the program has fewer numbers (and a split factor left open)
MISSING = -1.0


def knob_vector(steps: Sequence[Step]) -> np.ndarray:
    """[KNOBS] float32: first (STEP_NUMBERS), in step order, each split's factors (log2), each compute-at's
    loop, each unroll pragma's depth, each followed split's number of parts, each fuse's loop count and
    each annotation's kind; then (SPLIT_TILES) each split's tile at each of its levels, innermost outward,
    as log2 of the factors multiplied so far; then (LEVELS) at each level from the innermost the sum of
    every split's log2 factor there, and (LEVELS) those sums added up from the innermost. An open split
    factor is MISSING among the numbers and counts as 1 in the tiles; empty slots are MISSING."""
    numbers: list[float] = []
    tiles: list[float] = []
    levels = [0.0] * LEVELS
    for s in steps:
        if isinstance(s, SplitStep):
            numbers += [math.log2(v) if v else MISSING for v in s.lengths]
            tile = 0.0
            for level, v in enumerate(reversed(s.lengths)):
                if v:
                    tile += math.log2(v)
                    if level < LEVELS:
                        levels[level] += math.log2(v)
                tiles.append(tile)
        elif isinstance(s, ComputeAtStep):
            numbers.append(s.target_iter_id)
        elif isinstance(s, PragmaStep):
            value = s.pragma.rpartition("$")[2]
            numbers.append(float(value) if value.isdigit() else MISSING)
        elif isinstance(s, FollowSplitStep):
            numbers.append(s.n_split)
        elif isinstance(s, FuseStep):
            numbers.append(len(s.fused_ids))
        elif isinstance(s, AnnotationStep):
            numbers.append(ANNOTATIONS.index(s.annotation))
    row = np.full(KNOBS, MISSING, np.float32)
    row[:min(len(numbers), STEP_NUMBERS)] = numbers[:STEP_NUMBERS]
    row[STEP_NUMBERS:STEP_NUMBERS + min(len(tiles), SPLIT_TILES)] = tiles[:SPLIT_TILES]
    row[STEP_NUMBERS + SPLIT_TILES:] = levels + list(accumulate(levels))
    return row
