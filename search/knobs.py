"""The schedule's own numbers, in step order: what AutoTVM's cost model called knob features.

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
"""
from __future__ import annotations

import math
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

# numbers a program keeps, the rest dropped: a conv's sketches have 30, a matmul's 17
KNOBS = 64
# what a slot holds when the program has fewer numbers (and a split factor left open)
MISSING = -1.0


def knob_vector(steps: Sequence[Step]) -> np.ndarray:
    """[KNOBS] float32: in step order, each split's factors (log2), each compute-at's loop, each unroll
    pragma's depth, each followed split's number of parts, each fuse's loop count and each annotation's kind."""
    out: list[float] = []
    for s in steps:
        if isinstance(s, SplitStep):
            out += [math.log2(v) if v else MISSING for v in s.lengths]
        elif isinstance(s, ComputeAtStep):
            out.append(s.target_iter_id)
        elif isinstance(s, PragmaStep):
            value = s.pragma.rpartition("$")[2]
            out.append(float(value) if value.isdigit() else MISSING)
        elif isinstance(s, FollowSplitStep):
            out.append(s.n_split)
        elif isinstance(s, FuseStep):
            out.append(len(s.fused_ids))
        elif isinstance(s, AnnotationStep):
            out.append(ANNOTATIONS.index(s.annotation))
        if len(out) >= KNOBS:
            break
    row = np.full(KNOBS, MISSING, np.float32)
    row[:min(len(out), KNOBS)] = out[:KNOBS]
    return row
