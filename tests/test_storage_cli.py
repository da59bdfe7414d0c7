"""`tensortune history` and `tensortune best` print the store's tables and fail clearly."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from tensortune.flows import history_cli
from tensortune.flows.cli import app
from tensortune.storage.records import RecordStore
from tensortune.storage.synthetic import synthetic_batch, workload_key

runner = CliRunner()
assert history_cli.app is app  # importing history_cli registered its commands on the app


def _store(root: Path) -> None:
    store = RecordStore(str(root))
    rng = np.random.default_rng(0)
    for index in range(4):
        store.append(synthetic_batch(rng, 20, tasks=3, flow_run_id=f"run-{index // 2}", round=index))


def test_best_and_history_tables(tmp_path):
    _store(tmp_path)
    best = runner.invoke(app, ["best", "--records", str(tmp_path)], env={"COLUMNS": "200"})
    assert best.exit_code == 0, best.output
    assert "best per task" in best.output and "conv2d_nchw_2" in best.output
    runs = runner.invoke(app, ["history", "--records", str(tmp_path)], env={"COLUMNS": "200"})
    assert runs.exit_code == 0 and "run-0" in runs.output and "run-1" in runs.output
    one = runner.invoke(app, ["history", "--records", str(tmp_path), "--task", "conv2d_nchw_1",
                              "--per-round"], env={"COLUMNS": "200"})
    assert one.exit_code == 0, one.output
    assert "best so far" in one.output and one.output.count("run-") == 4
    by_key = runner.invoke(app, ["history", "--records", str(tmp_path), "--task", workload_key(1),
                                 "--network", "bert-base"], env={"COLUMNS": "200"})
    assert by_key.exit_code == 0 and "run-1" in by_key.output


def test_empty_and_broken_stores(tmp_path):
    missing = runner.invoke(app, ["best", "--records", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "no record store at" in missing.output     # a typo is not an empty store
    (tmp_path / "empty").mkdir()
    empty = runner.invoke(app, ["best", "--records", str(tmp_path / "empty")])
    assert empty.exit_code == 0 and "no records" in empty.output
    _store(tmp_path)
    (tmp_path / "stray.txt").write_text("hello")
    broken = runner.invoke(app, ["best", "--records", str(tmp_path)])
    assert broken.exit_code == 1 and "stray.txt" in broken.output
    fixed = runner.invoke(app, ["history", "--records", str(tmp_path), "--quarantine"])
    assert fixed.exit_code == 0 and (tmp_path / "_quarantine" / "stray.txt").exists()
    assert "warning" in fixed.output and "moved 1 bad file" in fixed.output


def test_network_and_target_filters_show_only_their_tasks(tmp_path):
    _store(tmp_path)
    frame = RecordStore(str(tmp_path)).best_per_task()
    networks = sorted(frame["network"].unique())
    assert len(networks) >= 2                      # tasks of different networks, or the filter shows nothing
    for net in networks:
        out = runner.invoke(app, ["best", "--records", str(tmp_path), "--network", net], env={"COLUMNS": "200"})
        assert out.exit_code == 0, out.output
        for name, their in zip(frame["task_name"], frame["network"]):
            assert (name in out.output) == (their == net), (net, name, out.output)
        runs = runner.invoke(app, ["history", "--records", str(tmp_path), "--network", net], env={"COLUMNS": "200"})
        assert runs.exit_code == 0 and "run-0" in runs.output and net in runs.output
    other = runner.invoke(app, ["best", "--records", str(tmp_path), "--target", "cuda -arch=sm_90"])
    assert other.exit_code == 0 and "no records" in other.output
