"""The queries answer what they promise, on records small enough to check by hand."""
from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest

from tensortune.storage.records import MeasureRecord, RecordStore, TrainingRow

T0 = datetime(2026, 5, 1, tzinfo=timezone.utc)


def _r(key: str, latency: float, *, target: str = "llvm", network: str = "bert", run: str = "run-1",
       round: int = 0, minutes: int = 0, error: int = 0, steps: str | None = None,
       retiming: bool = False) -> MeasureRecord:
    return MeasureRecord(workload_key=key, task_name=f"task-{key}", target=target, network=network,
                         flow_run_id=run, round=round, timestamp=T0 + timedelta(minutes=minutes),
                         steps=steps or f"[{key},{latency},{minutes},{error}]",
                         latencies=[] if error else [latency], error_code=error,
                         mean_latency=math.inf if error else math.nan, flops=1e9, retiming=retiming)


@pytest.fixture
def store(tmp_path) -> RecordStore:
    store = RecordStore(str(tmp_path), auto_compact=None)
    store.append([_r("a", 3e-3, minutes=0), _r("a", 2e-3, minutes=1), _r("a", 1, error=4, minutes=2),
                  _r("b", 5e-3, network="resnet", minutes=3), _r("e", 1, error=6, minutes=4)])
    store.append([_r("a", 1e-3, network="resnet", run="run-2", round=0, minutes=60),
                  _r("a", 4e-3, run="run-2", round=1, minutes=61),
                  _r("b", 6e-3, run="run-2", round=1, minutes=62)])
    store.append([_r("a", 0.5e-3, target="cuda", run="run-3", minutes=120)])
    return store


def test_training_rows_come_oldest_first_whatever_the_order_of_the_files(tmp_path):
    """Part files are listed in no time order (named by uuid): the newest programs a trainer keeps
    (search.training_set.training_rows) must be the newest measured. Records of one time keep their order."""
    store = RecordStore(str(tmp_path), auto_compact=None)
    for minutes in (50, 10, 40, 0, 30, 20):                 # one file each, appended out of time order
        store.append([_r("a", 1e-3, minutes=minutes, steps=f"[{minutes},first]"),
                      _r("a", 2e-3, minutes=minutes, steps=f"[{minutes},second]")])
    steps = list(store.training_frame(target="llvm")["steps"])
    assert steps == [f"[{m},{which}]" for m in (0, 10, 20, 30, 40, 50) for which in ("first", "second")]


def test_best_per_task(store):
    best = store.best_per_task()
    table = {(row.target, row.workload_key): row for row in best.itertuples()}
    assert set(table) == {("cuda", "a"), ("llvm", "a"), ("llvm", "b")}  # "e" only ever failed
    assert table[("llvm", "a")].mean_latency == 1e-3 and table[("llvm", "a")].flow_run_id == "run-2"
    assert (table[("llvm", "a")].n_records, table[("llvm", "a")].n_errors) == (5, 1)
    assert table[("llvm", "a")].gflops == pytest.approx(1000.0)
    assert table[("llvm", "b")].mean_latency == 5e-3
    bert = store.best_per_task(network="bert")
    assert bert.set_index("workload_key")["mean_latency"].to_dict() == {"a": 2e-3, "b": 6e-3}
    assert store.best_per_task(target="cuda")["mean_latency"].tolist() == [0.5e-3]
    assert store.best_per_task(target="vulkan").empty


def test_history_per_run_and_round(store):
    runs = store.history("a", target="llvm")
    assert runs["flow_run_id"].tolist() == ["run-1", "run-2"]
    assert runs["best_latency"].tolist() == [2e-3, 1e-3]
    assert runs["best_so_far"].tolist() == [2e-3, 1e-3]
    assert runs["n_records"].tolist() == [3, 2] and runs["n_errors"].tolist() == [1, 0]
    rounds = store.history("task-a", target="llvm", per="round")  # by task name too
    assert list(zip(rounds["flow_run_id"], rounds["round"], rounds["best_so_far"])) == [
        ("run-1", 0, 2e-3), ("run-2", 0, 1e-3), ("run-2", 1, 1e-3)]
    everywhere = store.history("a")
    assert set(everywhere["target"]) == {"llvm", "cuda"}
    assert store.history("nothing").empty
    with pytest.raises(ValueError, match="per="):
        store.history("a", per="day")


def test_error_counts_and_runs(store):
    errors = store.error_counts()
    assert errors.to_dict("records") == [
        {"target": "cuda", "error_code": 0, "error_name": "NO_ERROR", "count": 1},
        {"target": "llvm", "error_code": 0, "error_name": "NO_ERROR", "count": 6},
        {"target": "llvm", "error_code": 4, "error_name": "RUNTIME_DEVICE", "count": 1},
        {"target": "llvm", "error_code": 6, "error_name": "BUILD_TIMEOUT", "count": 1},
    ]
    per_task = store.error_counts(target="llvm", per_task=True)
    assert per_task[per_task["workload_key"] == "e"]["error_name"].tolist() == ["BUILD_TIMEOUT"]
    runs = store.runs()
    assert runs["flow_run_id"].tolist() == ["run-1", "run-2", "run-3"]
    assert runs["n_records"].tolist() == [5, 3, 1]
    assert runs.iloc[1]["networks"] == "bert,resnet"


def test_resume_and_training_rows(store):
    steps = store.measured_steps("a", "llvm")
    assert len(steps) == 5 and "[a,0.001,60,0]" in steps
    assert store.measured_steps("a", "cuda") == {"[a,0.0005,120,0]"}
    assert store.measured_steps("zzz", "llvm") == set()
    frame = store.training_frame(target="llvm")
    assert list(frame.columns) == ["workload_key", "steps", "mean_latency", "flops", "error_code"]
    assert len(frame) == 8
    rows = list(store.iter_training_rows(target="llvm", workload_keys=["b"]))
    assert all(isinstance(r, TrainingRow) for r in rows) and len(rows) == 2
    key, steps_json, latency, flops, code = rows[0]
    assert (key, flops, code) == ("b", 1e9, 0) and latency in (5e-3, 6e-3)
    records = store.load_records(flow_run_id="run-2")
    assert [r.round for r in records] == [0, 1, 1]


def test_a_tasks_records_before_its_newest_retiming_no_longer_compete_for_its_best(tmp_path):
    """A night that times a task's stored bests again (slower: a slow hour of the VM) makes them, and
    what it measures after, the candidates for the task's best; the older, faster figures are history.
    The same answer from part files, from a compacted file (whose leaders are all older), and with a
    newer part file beside it; tasks never timed again keep their best; a failed re-timing still counts."""
    store = RecordStore(str(tmp_path), auto_compact=None)
    store.append([_r("a", 1.0e-3, minutes=0, steps="p"), _r("a", 1.2e-3, minutes=1, steps="q"),
                  _r("a", 3.0e-3, minutes=2, steps="s"), _r("b", 2e-3, minutes=3), _r("c", 1e-3, minutes=4, steps="u")])
    store.append([_r("a", 1.6e-3, minutes=60, steps="p", run="run-2", retiming=True),
                  _r("a", 1.7e-3, minutes=60, steps="q", run="run-2", retiming=True),
                  _r("a", 1.5e-3, minutes=61, steps="r", run="run-2"),
                  _r("c", 1, minutes=60, steps="u", run="run-2", error=4, retiming=True)])

    def best() -> dict[str, tuple[str, float]]:
        frame = store.best_per_task()
        return {r.workload_key: (r.steps, r.mean_latency) for r in frame.itertuples()}
    expected = {"a": ("r", 1.5e-3), "b": ("[b,0.002,3,0]", 2e-3)}      # "c": its only program failed tonight
    assert best() == expected
    assert store.best_per_task(network="bert")["workload_key"].tolist() == ["a", "b"]
    assert store.compact().output_files == 1
    assert best() == expected
    store.append([_r("a", 1.55e-3, minutes=62, steps="t", run="run-2"), _r("c", 2e-3, minutes=63, steps="v",
                                                                          run="run-2")])
    assert best() == {**expected, "c": ("v", 2e-3)}
    # the history's best so far starts anew with the night that timed the stored bests again
    runs = store.history("a")
    assert runs["best_latency"].tolist() == [1.0e-3, 1.5e-3] and runs["best_so_far"].tolist() == [1.0e-3, 1.5e-3]
    assert store.history("b")["best_so_far"].tolist() == [2e-3]
    # the counts still count every record
    counts = store.best_per_task().set_index("workload_key")
    assert counts.loc["a", "n_records"] == 7 and counts.loc["c", "n_errors"] == 1
    # a re-timing made by another network's run sets the cut-off in this network's view too: bert's
    # record of "b" is from the older night, the same program timed again under resnet is tonight's
    store.append([_r("b", 2.5e-3, minutes=70, steps="[b,0.002,3,0]", network="resnet", run="run-3", retiming=True)])
    assert store.best_per_task().set_index("workload_key").loc["b", "mean_latency"] == 2.5e-3
    assert store.best_per_task(network="bert")["workload_key"].tolist() == ["a", "c"]
    # and in its history: a bert run after resnet's re-timing counts its best from there
    store.append([_r("b", 2.2e-3, minutes=80, steps="w", run="run-4")])
    bert = store.history("b", network="bert")
    assert bert["flow_run_id"].tolist() == ["run-1", "run-4"] and bert["best_so_far"].tolist() == [2e-3, 2.2e-3]
    assert store.best_per_task(network="bert").set_index("workload_key").loc["b", "mean_latency"] == 2.2e-3


def test_since_finds_records_stamped_after_the_day_their_file_was_written(tmp_path):
    """Partitions are the day a file was written; a record's own timestamp can be later (another host's
    clock, imported records), and `since` must still find it."""
    store = RecordStore(str(tmp_path), auto_compact=None)
    late = datetime(2030, 1, 2, tzinfo=timezone.utc)
    store.append([_r("a", 1e-3), MeasureRecord(workload_key="a", task_name="task-a", target="llvm", steps="[late]",
                                               timestamp=late, latencies=[2e-3], flops=1e9)])
    found = store.read(since=datetime(2030, 1, 1, tzinfo=timezone.utc))
    assert found["steps"].tolist() == ["[late]"]
    assert len(store.read(until=datetime(2030, 1, 1, tzinfo=timezone.utc))) == 1
