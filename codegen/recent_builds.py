"""The builds of the programs measured last, kept so that a program timed again is not built again.

A (task, program) should be built once, across rounds and workers. The search never proposes a program
it has already measured (SketchPolicy keeps the visited set), so the one program measured twice is a
would-be best that codegen.confirmation times again: in a second measure() call, moments after the
batch that built it. Keeping the last few batches' builds covers that and nothing more: ResNet-18's
3000-trial run re-timed 126 programs, each built twice before, a build each (0.1-0.6 s of a core).

What a measurer keeps is its own handle on a build: ProgramMeasurer a BuildResult (its artifact's
object code, 10-200 KB), DaskMeasurer the build's future, which keeps the artifact in a worker's memory
for as long as the future is held. So the cache is bounded (`size` entries, least recently used
evicted) and keyed by the task's JSON and the program's steps: the exact inputs of a build.

Only a build that succeeded is used again: ProgramMeasurer keeps a BuildResult with an artifact;
DaskMeasurer keeps a future that finished (its result stays on the worker) and drops it when the
program's result comes back with one of BUILD_ERRORS, or when the future was cancelled or lost since (a
cluster that restarted builds anew). A failed build is attempted again: a timeout may be the machine's.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

from tensortune.codegen.timing import ErrorCode

Build = TypeVar("Build")

RECENT_BUILDS = 256      # four rounds of 64: the re-timing of a batch comes right after it
# a program's result with one of these codes came from its build, not its timing
BUILD_ERRORS = frozenset({ErrorCode.INSTANTIATION_ERROR, ErrorCode.COMPILE_HOST, ErrorCode.COMPILE_DEVICE,
                          ErrorCode.BUILD_TIMEOUT})


class RecentBuilds(Generic[Build]):
    """A bounded least-recently-used map (task JSON, steps JSON) -> build. Thread-safe: the flow's
    measuring thread and its searching thread (a prebuild) may use one measurer at once."""

    def __init__(self, size: int = RECENT_BUILDS) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.size = size
        self._items: OrderedDict[tuple[str, str], Build] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, task_json: str, steps: str) -> Build | None:
        with self._lock:
            build = self._items.get((task_json, steps))
            if build is not None:
                self._items.move_to_end((task_json, steps))
            return build

    def put(self, task_json: str, steps: str, build: Build) -> None:
        with self._lock:
            self._items[(task_json, steps)] = build
            self._items.move_to_end((task_json, steps))
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def discard(self, task_json: str, steps: str) -> None:
        with self._lock:
            self._items.pop((task_json, steps), None)

    def __len__(self) -> int:
        return len(self._items)
