"""bench retrain: a round's retrain on a stored history repeated as nights, with the training bound and without."""
from __future__ import annotations

import json
import random

import pytest

from bench.retrain import main
from tensortune.codegen.measure import MeasureResult
from tensortune.flows.tuning import network_tasks, to_records
from tensortune.search.sketch_policy import SketchPolicy
from tensortune.storage.records import RecordStore


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["--history", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --history {tmp_path / 'missing'}: no such folder"
    assert main(["--history", str(tmp_path), "--repeats", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --repeats must be at least 1, got 0"
    assert main(["--history", str(tmp_path), "--per-round", "1"]) == 2       # one new program is not ranked
    assert capsys.readouterr().err.strip() == "error: --per-round must be at least 2, got 1"
    assert main(["--history", str(tmp_path), "--image-size", "32"]) == 2           # an empty store
    assert capsys.readouterr().err.strip().startswith("error: no records of resnet-18's tasks for ")
    with pytest.raises(SystemExit):
        main(["--history", str(tmp_path), "--nights", "0"])
    assert "--nights must each be at least 1" in capsys.readouterr().err


def test_the_bound_keeps_a_tasks_programs_however_many_nights_and_every_program_grows(tmp_path, capsys):
    """Two of the main job's network's tasks with 40 and 20 stored programs: bounded at 8 a task, a
    retrain trains on 16 programs on one night and on three; unbounded on 60, then 180."""
    _, tasks = network_tasks("resnet-18", "llvm -num-threads=2", image_size=32)
    store = RecordStore(str(tmp_path / "records"))
    rng = random.Random(0)
    for task, n in ((tasks[1], 40), (tasks[2], 20)):
        programs = SketchPolicy(task, seed=3).sample(n)
        store.append(to_records(task, programs, [MeasureResult([rng.uniform(1e-4, 1e-3)], 0) for _ in programs],
                                round_=0))
    out = tmp_path / "retrain.json"
    assert main(["--history", str(tmp_path / "records"), "--image-size", "32", "--nights", "1,3",
                 "--train-programs", "8", "--per-round", "10", "--repeats", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["round_task"] == tasks[1].name
    got = [(r["nights"], r["history_programs"], r["training"], r["trained_programs"]) for r in doc["rows"]]
    assert got == [(1, 60, "8 a task", 16), (1, 60, "every program", 60),
                   (3, 180, "8 a task", 16), (3, 180, "every program", 180)]
    assert all(len(r["retrain_s_runs"]) == 2 and min(r["retrain_s_runs"]) > 0 for r in doc["rows"])
    # each timed retrain ranked the round's 10 programs (the flow's path), not a held-out split of both tasks
    assert all(r["ranked_programs"] == {tasks[1].name: 10} for r in doc["rows"]), doc["rows"]
    assert "3 night(s): 8 a task" in capsys.readouterr().out


def test_a_history_too_small_to_time_is_one_line(tmp_path, capsys):
    """One stored program: no retrain to time (fit needs MIN_FIT_PROGRAMS, and two of the round's task)."""
    _, tasks = network_tasks("resnet-18", "llvm -num-threads=2", image_size=32)
    programs = SketchPolicy(tasks[1], seed=3).sample(1)
    RecordStore(str(tmp_path / "records")).append(to_records(tasks[1], programs, [MeasureResult([1e-4], 0)],
                                                             round_=0))
    assert main(["--history", str(tmp_path / "records"), "--image-size", "32"]) == 2
    assert capsys.readouterr().err.strip().endswith("are too few to time a retrain on (at least 8, two of them "
                                                    "of one of resnet-18's tasks)")
