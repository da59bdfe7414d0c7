"""A program built by one of the measurer's last calls is not built again (codegen.recent_builds): the
bounded cache itself, then ProgramMeasurer with the real builder and runner (every timing checked
against the NumPy reference by the runner)."""
from __future__ import annotations

import pytest

from tensortune.codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
from tensortune.codegen.recent_builds import RecentBuilds
from tensortune.codegen.target import make_task
from tensortune.codegen.timing import ErrorCode, TimingConfig
from tensortune.schedule.state import State
from tensortune.tasks.workload_registry import make_dag


class CountingBuilder(LocalBuilder):
    """The real builder, listing the programs it is asked to build."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.built: list[str] = []

    def build(self, task, steps_list, keep_source=False):
        self.built += list(steps_list)
        return super().build(task, steps_list, keep_source)


def test_the_least_recently_used_build_goes_first():
    recent: RecentBuilds[str] = RecentBuilds(size=2)
    recent.put("t", "a", "A")
    recent.put("t", "b", "B")
    assert recent.get("t", "a") == "A"          # a is now the most recent
    recent.put("t", "c", "C")
    assert recent.get("t", "b") is None and recent.get("t", "a") == "A" and recent.get("t", "c") == "C"
    assert recent.get("other task", "a") is None
    recent.discard("t", "a")
    assert recent.get("t", "a") is None and len(recent) == 1
    with pytest.raises(ValueError):
        RecentBuilds(size=-1)


def test_a_program_timed_again_in_a_later_call_is_not_built_again():
    task = make_task(make_dag("matmul", 32, 32, 32))
    tiled = State(task.dag).split("C", 1, [16]).vectorize("C", 2).steps_json()
    plain = State(task.dag).steps_json()
    broken = '[["SP", 99, 0, 32, [4], 1]]'
    builder = CountingBuilder(n_parallel=1)
    with ProgramMeasurer(builder, LocalRunner(config=TimingConfig(min_repeat_ms=2, repeat=1))) as m:
        first = m.measure(task, [tiled, plain, broken])
        again = m.measure(task, [tiled, tiled, broken])
        other = m.measure(make_task(make_dag("matmul", 48, 48, 48)), [plain])
    assert [r.ok for r in first] == [True, True, False] and [r.ok for r in again] == [True, True, False]
    assert again[2].error_code == ErrorCode.INSTANTIATION_ERROR and other[0].ok
    # the tiled program once; a failed build is tried again; the same steps of another task are built
    assert builder.built == [tiled, plain, broken, broken, plain]
