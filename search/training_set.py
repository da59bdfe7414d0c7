"""What a retrain trains the cost model on: each task's best and newest programs, at most so many a task.

The flow retrains the model after every round from the whole record store, and a nightly store only
grows, so a model trained on every stored program made every round's retrain slower with every night.
The model keeps every program (a benchmark cross-validates whole histories from it); `fit` trains on
`training_rows` of each task. The bound is plain Python with no imports beyond typing, so the command
line can show its default without loading the model's modules.
"""
from __future__ import annotations

from typing import Sequence, TypeVar

Program = TypeVar("Program")

# The most programs of a task the search is tuning that `fit` trains on (training_rows: its best quarter,
# then its newest). A round's retrain on two network stores' 3 000 programs took 1.0 s, repeated as
# 12 000 (four nights) 2.1 s, as 48 000 6.9 s; bounded 1.0, 1.45, 1.46 s (Zen 4, `python -m bench retrain`).
# More than this many programs of one task did not order its next round better: online on a 2 048-program
# conv history (the model before each of rounds 17-32 ordering that round's programs, seeds 0-1) all
# programs 0.760, at most 1024 0.770, 512 0.758, 256 0.759, 128 0.749, 64 0.748; a model of all programs
# but a round old (retraining less often) 0.755, four rounds old 0.738 (docs/performance.md, "A bounded
# training history").
TASK_PROGRAMS = 256
# ... of a task the search is not tuning (the model's `focus`), whose programs teach the model what
# programs of other tasks are worth (transfer). Each of 50 network tasks left out whole in turn, ranked by
# a model of the other tasks' programs (two 1500-trial stores, 45-128 programs a task): all of them 0.661,
# at most 64 a task 0.655, 48 0.644, 32 0.638 (the best quarter and the newest; the best quarter and
# programs spread over the task's history instead: 32 0.651, 48 0.646, 64 0.651)
OTHER_TASK_PROGRAMS = 64


def training_rows(rows: Sequence[tuple[Program, float]], limit: int | None) -> list[tuple[Program, float]]:
    """At most `limit` (None: all) of one task's (program, throughput) rows, in record order: the best
    quarter by throughput, then the newest. The best keep the top of the order the model must get right,
    the newest are the region the search is in now. A program left out never comes back: new programs
    only push it down the order, and where the newest begin only moves on (a new program entering the
    best quarter pushes an older one out of it), so a task's training set changes only at its ends."""
    if limit is None or len(rows) <= limit:
        return list(rows)
    keep = set(sorted(range(len(rows)), key=lambda i: -rows[i][1])[:limit // 4])
    for i in range(len(rows) - 1, -1, -1):
        if len(keep) == limit:
            break
        keep.add(i)
    return [rows[i] for i in sorted(keep)]


def training_bounds(task_programs: int) -> tuple[int | None, int | None]:
    """The bounds of XGBModel(task_programs=, other_task_programs=) from one figure, the flow's
    `train_programs`: `task_programs` of a task the search tunes, a quarter as many (at least one) of any
    other, as TASK_PROGRAMS and OTHER_TASK_PROGRAMS are; 0 bounds neither (every stored program trains)."""
    if task_programs < 0:
        raise ValueError(f"train_programs must be 0 (every program) or more, got {task_programs}")
    return (task_programs, max(1, task_programs // 4)) if task_programs else (None, None)
