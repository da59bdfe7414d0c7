"""What a program is where the layers meet: a schedule of a task's DAG, as its step list.

A `schedule.State` is one, and so is a search `Candidate` (which replays its State only when something
needs it). Cost models score programs and features are computed of them; records and workers carry a
program's steps as JSON.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tensortune.schedule.steps import Step
    from tensortune.tasks.compute_dag import ComputeDAG


class Program(Protocol):
    @property
    def dag(self) -> ComputeDAG: ...

    @property
    def steps(self) -> tuple[Step, ...]: ...
