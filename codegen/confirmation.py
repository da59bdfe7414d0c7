"""Timing a program again before it becomes its task's best, so a best is not the luckiest timing.

A task's best is the minimum over every program measured for it, and each program is timed once. The
timings are noisy (a cold network timing on a shared 2-vCPU VM varies by 10-40 % between calls), and
late in a search hundreds of programs are nearly equal, so the minimum is the luckiest draw among them
rather than the fastest program: ResNet-18's 14² Winograd conv recorded 0.269 ms and re-timed at 0.34,
0.47 and 0.46 ms by the same measurer (Zen 5; docs/performance.md, network rows). The estimate built from such bests
ran 15-20 % below the measured network, and the search kept comparing against a figure no program
reaches again.

So a program whose first timing would make it the best is timed `timings` more times before the result
is handed on, and its result carries every timing: its mean (the figure records store and rank by)
then holds one selected, possibly lucky draw among `timings` + 1, and a program that only looked fast
usually no longer beats the best. The re-timings are part of the program's one record (never a second
record, never a rewritten one): they happen before anything is stored.

Under interleaved passes (codegen.timing.OPERATOR_TIMING) a program's figure is its fastest timing, and
re-timings join its passes: they can no longer outvote a lucky draw, only confirm that the program
still runs and answers right. Warm timings there have no lucky draws to outvote: the machine only
ever slows a kernel down.

Only programs that would move the best are re-timed, a few a round, so the cost is small against the
round's own timings. `time_again` times a resumed task's best stored programs the same number of times,
so a stored best carried into a new night weighs as much as a best confirmed in it. This file needs
nothing but the Measurer protocol: the local measurer and the cluster's time the confirmations as they
time everything else.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from tensortune.codegen.measure import Measurer, MeasureResult
from tensortune.tasks.search_task import SearchTask

CONFIRM_TIMINGS = 2      # timings added to a would-be best (3 in all: one lucky draw weighs a third)
CONFIRM_PER_PASS = 2     # would-be bests re-timed together in one measure() call
CONFIRM_PASSES = 3       # calls at most: a program that fails its re-timing lets the next one try
# a resumed task's best stored programs timed again (time_again) before its run measures anything of
# it (0: trust the stored timings, as TVM does); flows.tuning.retime_stored_bests says why
RETIME_PROGRAMS = 3


def confirm_new_bests(measurer: Measurer, task: SearchTask, steps_list: Sequence[str],
                      results: list[MeasureResult], best: float, *, timings: int = CONFIRM_TIMINGS,
                      per_pass: int = CONFIRM_PER_PASS, passes: int = CONFIRM_PASSES) -> list[MeasureResult]:
    """`results` (one per program of `steps_list`, as measured once) with every program that would beat
    `best` (seconds; the task's best before this batch) timed `timings` more times.

    Each pass re-times the fastest `per_pass` programs that are unconfirmed and faster than the best so
    far, counting the confirmed ones; it stops when none is left, so the batch's fastest result is a
    confirmed one unless `passes` ran out. A re-timing that fails makes the program's result that
    failure (its earlier timings kept in `costs`): a program that crashes or answers wrongly when run
    again must not become the best. A re-timing call that raises (DaskMeasurer's ClusterError: the
    cluster went away) ends the confirmation: the batch's results, already measured, must still be
    recorded, and the tuner's next measure() raises the same error. A measurer with `stats`
    (DaskMeasurer: what its last call cost, a dataclass that adds) reports the sum of all its calls.
    timings=0 turns confirmation off."""
    out = list(results)
    if timings < 1 or not out:
        return out
    spent: Any = getattr(measurer, "stats", None)
    confirmed: set[int] = set()
    for _ in range(passes):
        current = min([best] + [out[k].latency for k in confirmed])
        todo = sorted((k for k, r in enumerate(out) if r.ok and k not in confirmed and r.latency < current),
                      key=lambda k: out[k].latency)[:per_pass]
        if not todo:
            break
        try:
            again = measurer.measure(task, [steps_list[k] for k in todo for _ in range(timings)])
        except Exception:  # noqa: BLE001 - the batch's results outrank a re-timing; the next measure() raises it
            break
        if spent is not None:
            spent = spent + measurer.stats          # type: ignore[attr-defined]
        for n, k in enumerate(todo):
            out[k] = _merged(out[k], again[n * timings:(n + 1) * timings])
            confirmed.add(k)
    if spent is not None:
        setattr(measurer, "stats", spent)
    return out


def time_again(measurer: Measurer, task: SearchTask, steps_list: Sequence[str],
               timings: int = CONFIRM_TIMINGS) -> list[MeasureResult]:
    """Each program of `steps_list` timed 1 + `timings` times in one measure() call (the measurers build
    a program listed more than once once), one result each holding all its timings: a stored program
    timed again weighs as much as a confirmed best, so the two compare alike."""
    n = 1 + max(timings, 0)
    results = measurer.measure(task, [s for s in steps_list for _ in range(n)])
    return [_merged(results[k * n], results[k * n + 1:(k + 1) * n], "timed again")
            for k in range(len(steps_list))]


def _merged(first: MeasureResult, again: Sequence[MeasureResult],
            why: str = "timed again before it became the best") -> MeasureResult:
    """One program's result from its first timing and its re-timings: all costs, the first failure. A
    timing the measuring lost (MeasureResult.lost) counts for nothing: a cluster that lost a
    confirmation must not record a program that ran well as failed. Lost when all of them were lost."""
    ran = [r for r in (first, *again) if not r.lost]
    if not ran:
        return first
    first, again = ran[0], ran[1:]
    costs = list(first.costs) + [c for r in again for c in r.costs]
    failed = next((r for r in again if not r.ok), None)
    run_seconds = first.run_seconds + sum(r.run_seconds for r in again)
    if failed is not None:
        return replace(first, costs=costs, error_code=failed.error_code, run_seconds=run_seconds,
                       error_msg=f"{why}: {failed.error_msg}")
    return replace(first, costs=costs, run_seconds=run_seconds)

