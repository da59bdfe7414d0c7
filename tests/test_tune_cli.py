"""`tensortune tune-op` tunes with a progress line and prints the best schedule and loop nest;
`tensortune show` prints the stored best; bad arguments exit with a message saying what is wrong."""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from tensortune.codegen.target import make_task
from tensortune.flows.cli import app
from tensortune.flows.tuning import apply_best
from tensortune.storage.records import RecordStore
from tensortune.tasks.reference import evaluate, mismatch
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import ctrl_c_after_first_round, start_as_from_a_terminal


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    records = str(tmp_path_factory.mktemp("cli") / "records")
    result = CliRunner().invoke(app, ["tune-op", "matmul", "--args", "48,32,40", "--trials", "8",
                                      "--per-round", "4", "--records", records])
    return records, result


def test_tune_op_prints_progress_schedule_and_loop_nest(tuned):
    records, result = tuned
    assert result.exit_code == 0, result.output
    out = result.output
    assert "8/8 trials" in out and "GFLOP/s" in out
    assert "schedule" in out and "loop nest" in out and "for " in out
    steps = out.split("steps: ", 1)[1].strip().splitlines()[0]
    assert json.loads(steps)                                  # the best program's step list
    store = RecordStore(records)
    assert len(store.read()) == 8
    task = make_task(make_dag("matmul", 48, 32, 40))
    kernel = apply_best(task, store)                          # the printed best is the stored best
    inputs = task.dag.random_inputs(3)
    c = np.empty((48, 32), np.float32)
    kernel(*inputs, c)
    assert mismatch(c, evaluate(task.dag, inputs)[0]) is None


def test_each_tune_op_run_is_a_run_of_its_own(tmp_path):
    """Two tune-op runs on one store are two runs in `history`, each with its own rounds."""
    records = str(tmp_path / "records")
    for trials in ("8", "4"):
        out = CliRunner().invoke(app, ["tune-op", "matmul", "--args", "16,16,16", "--trials", trials,
                                       "--per-round", "4", "--records", records])
        assert out.exit_code == 0, out.output
    frame = RecordStore(records).read()
    runs = frame[~frame["retiming"]].groupby("flow_run_id").size()
    assert sorted(runs.tolist()) == [4, 8] and all(r.startswith("tune-op-") for r in runs.index)
    # the second run timed the first's three best programs again before its own
    assert frame[frame["retiming"]]["flow_run_id"].tolist() == [runs.idxmin()] * 3
    assert set(frame[frame["flow_run_id"] == runs.idxmin()]["round"]) == {0}
    key = make_task(make_dag("matmul", 16, 16, 16)).workload_key
    history = CliRunner().invoke(app, ["history", "--task", key, "--records", records], env={"COLUMNS": "250"})
    assert history.exit_code == 0 and all(r[:16] in history.output for r in runs.index), history.output


def test_a_new_task_is_ranked_from_its_first_round_by_the_stores_other_tasks(tuned, tmp_path):
    """Transfer in tune-op: a task the store has never seen gets a model trained on the other tasks'
    records, so its first round already carries the model's scores (NaN while a search is random)."""
    import shutil
    records = str(tmp_path / "records")
    shutil.copytree(tuned[0], records)
    result = CliRunner().invoke(app, ["tune-op", "matmul", "--args", "40,40,40", "--trials", "4",
                                      "--per-round", "4", "--records", records])
    assert result.exit_code == 0, result.output
    assert "cost model: trained on 8 programs of 1 other task(s) in the store" in result.output
    key = make_task(make_dag("matmul", 40, 40, 40)).workload_key
    frame = RecordStore(records).read()
    first = frame[frame["workload_key"] == key]
    assert len(first) == 4 and set(first["round"]) == {0} and first["predicted_score"].notna().all()
    alone = str(tmp_path / "alone")
    result = CliRunner().invoke(app, ["tune-op", "matmul", "--args", "40,40,40", "--trials", "4",
                                      "--per-round", "4", "--records", alone])
    assert result.exit_code == 0 and "cost model: trained" not in result.output
    assert RecordStore(alone).read()["predicted_score"].isna().all()


def test_show_prints_the_stored_best(tuned):
    records, tuned_result = tuned
    best = tuned_result.output.split("steps: ", 1)[1].strip().splitlines()[0]
    result = CliRunner().invoke(app, ["show", "matmul", "--args", "48,32,40", "--records", records])
    assert result.exit_code == 0, result.output
    naive = CliRunner().invoke(app, ["show", "matmul", "--args", "48,32,40", "--records", ""])
    assert "for " in result.output and result.output != naive.output
    explicit = CliRunner().invoke(app, ["show", "matmul", "--args", "48,32,40", "--steps", best])
    assert explicit.output == result.output


@pytest.mark.parametrize("argv, message", [
    (["tune-op", "no_such_op", "--trials", "1"], "unknown workload 'no_such_op'"),
    (["tune-op", "matmul", "--args", "4,4,4,4,4,4,4", "--trials", "1"], "takes 3 sizes (N, M, K), got 7"),
    (["show", "matmul", "--args", "8,8,8", "--steps", '[["SP",2,0,8,[16],1]]'], "split lengths [16]"),
    (["show", "matmul", "--args", "8,8,8", "--steps", "[[not json"], "JSON"),
])
def test_bad_input_exits_with_a_clear_message(argv, message):
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert "error" in result.output and message.lower() in result.output.lower(), result.output


def test_version_is_the_installed_package_version():
    from importlib import metadata
    out = CliRunner().invoke(app, ["--version"])
    assert out.exit_code == 0 and out.output.strip() == f"tensortune {metadata.version('tensortune')}"


def test_ctrl_c_ends_tune_op_with_one_line_saying_what_was_stored(tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) mid-run: exit 130, one line with
    the number of this run's stored measurements, no traceback from the command or its workers."""
    import sys
    from pathlib import Path
    records = tmp_path / "records"
    script = Path(sys.executable).with_name("tensortune")
    command = [str(script)] if script.exists() else [sys.executable, "-c",
                                                      "from tensortune.flows.cli import main; main()"]
    proc = start_as_from_a_terminal([*command, "tune-op", "matmul", "--args", "64,64,64", "--trials", "100000",
                                     "--per-round", "8", "--records", str(records)])
    out, err = ctrl_c_after_first_round(proc, records, 180)
    assert proc.returncode == 130, out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted: "), err
    stored = RecordStore(str(records)).read()
    assert f"interrupted: {len(stored)} measurements of run {stored['flow_run_id'].iloc[0]} " in lines[0]
    assert len(stored) % 8 == 0 and "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
