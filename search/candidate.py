"""A candidate program as its step list; the State is replayed only when something needs it.

Evolution changes numbers in steps thousands of times per round; most of those changes (tile sizes,
unroll depth) cannot make a program invalid, so they skip the replay.
"""
from __future__ import annotations

import json

from tensortune.schedule.state import State
from tensortune.schedule.steps import Step
from tensortune.tasks.compute_dag import ComputeDAG


class StepsKey:
    """A step list as a dict key, hashed once (step tuples are long and hashed very often)."""
    __slots__ = ("steps", "_hash")

    def __init__(self, steps: tuple):
        self.steps, self._hash = steps, hash(steps)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, StepsKey) and self._hash == other._hash and self.steps == other.steps


class Candidate:
    __slots__ = ("dag", "steps", "sketch", "_state", "_json", "structure", "_key")

    def __init__(self, dag: ComputeDAG, steps: tuple[Step, ...], sketch: int = -1, state: State | None = None,
                 structure: object = None):
        self.dag, self.steps, self.sketch = dag, tuple(steps), sketch
        self._state = state
        self._json: str | None = None
        self._key: StepsKey | None = None
        self.structure = structure          # its feature parts (FeatureExtractor.parts); kept by number-only mutations

    @staticmethod
    def of(state: State, sketch: int = -1) -> "Candidate":
        return Candidate(state.dag, state.steps, sketch, state)

    @property
    def state(self) -> State:
        if self._state is None:
            self._state = State.replay(self.dag, self.steps)
        return self._state

    @property
    def key(self) -> StepsKey:
        """The identity of a program (steps are frozen values): never measure the same key twice."""
        if self._key is None:
            self._key = StepsKey(self.steps)
        return self._key

    @property
    def steps_json(self) -> str:
        """The compact step JSON that records and workers use."""
        if self._json is None:
            self._json = json.dumps([s.to_json() for s in self.steps], separators=(",", ":"))
        return self._json

    def with_steps(self, steps: tuple[Step, ...], validated: State | None = None,
                   same_structure: bool = False) -> "Candidate":
        return Candidate(self.dag, steps, self.sketch, validated, self.structure if same_structure else None)

    def __repr__(self) -> str:
        return f"Candidate(sketch={self.sketch}, {len(self.steps)} steps)"
