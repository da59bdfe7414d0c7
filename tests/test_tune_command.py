"""The README's main command as a user runs it, on the smallest built-in network: `tensortune tune
resnet-18 --image-size 32` starts its own Prefect server and LocalCluster, tunes every task, builds and
checks the network from its best records, prints the per-task table, the estimate, the records path and
the run's page, and keeps the server for the UI. Checked against what it wrote: the records, and the
flow run read back from the server it started."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tensortune.flows.prefect_server import PrefectServer, api_healthy
from tensortune.flows.tuning import default_programs, network_tasks
from tensortune.storage.records import RecordStore
from tests.conftest import ctrl_c_after_first_round, start_as_from_a_terminal
from tests.test_flow_tune import read_back

ROOT = Path(__file__).resolve().parents[1]
# the console script pip installs; without one (a checkout run in place), the same entry point
SCRIPT = Path(sys.executable).with_name("tensortune")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-c", "from tensortune.flows.cli import main; main()"]
TRIALS = 38                 # resnet-18 has 19 tasks: each gets its default schedule and one sampled program
                            # (but the transpose: see test_the_output_matches_the_records_it_wrote)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The command's exit code, output, records path and server; the server is stopped at the end (by
    the pid the command printed: it is the one it started, in a Prefect home of its own)."""
    tmp = tmp_path_factory.mktemp("tune-command")
    records, port = str(tmp / "records"), _free_port()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp / "prefect-home")          # a fresh server database and profile
    # the code under test is this checkout's, whichever checkout the environment was installed from
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    out_path = tmp / "stdout.txt"
    with open(out_path, "w") as out:
        proc = subprocess.Popen([*COMMAND, "tune", "resnet-18", "--image-size", "32", "--trials",
                                 str(TRIALS), "--population", "16", "--records", records, "--port", str(port)],
                                cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            code = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    text = out_path.read_text()
    started = re.search(rf"Prefect API: started (http://127\.0\.0\.1:{port}/api) \(pid (\d+)\)", text)
    server = PrefectServer(started.group(1), int(started.group(2))) if started else None
    try:
        yield code, text, records, server
    finally:
        if server is not None:
            server.stop()


def test_the_command_succeeds_and_says_where_to_look(run):
    code, text, records, server = run
    assert code == 0, text[-5000:]
    assert server is not None and api_healthy(server.api_url), "the command did not start a server, or it is gone"
    assert re.search(rf"^records: +{re.escape(records)}$", text, re.M), text[-3000:]
    assert f"the Prefect server (pid {server.pid}) keeps running for the UI; stop it with `kill {server.pid}`" in text


def _table(text: str) -> list[list[str]]:
    """The per-task table's rows, cell by cell."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if line.startswith("│") and cells[0].isdigit():
            rows.append(cells)
    return rows


def test_the_output_matches_the_records_it_wrote(run):
    code, text, records, _ = run
    assert code == 0, text[-5000:]
    net, tasks = network_tasks("resnet-18", image_size=32)
    frame = RecordStore(records).read()

    # every trial is a record, of this run, spread as the warm-up does: 2 programs per task, the default
    # schedule and one sampled, but where every sampled program compiles to the default's kernel (the
    # transpose's few kernels): that task's round is 1 program, and a 20th round takes the trial (which
    # may go to that same task, then with 2 records: a fresh clone's did)
    run_id = re.search(r"Prefect UI: http://127\.0\.0\.1:\d+/runs/flow-run/([0-9a-f-]{36})", text).group(1)
    assert len(frame) == TRIALS and set(frame["flow_run_id"]) == {run_id}
    sizes = frame.groupby("workload_key").size()
    assert set(sizes.index) == {t.workload_key for t in tasks} and (sizes == 2).sum() >= len(tasks) - 2
    assert (frame.groupby("workload_key")["kernel"].nunique() == sizes).all()      # no kernel timed twice
    assert not frame.duplicated(["workload_key", "steps"]).any()
    rounds = int(re.search(rf"resnet-18 on llvm[^:]*: {TRIALS} trials in (\d+) rounds", text).group(1))
    first_round = frame["round"] == frame.groupby("workload_key")["round"].transform("min")
    short = (frame[first_round].groupby("workload_key").size() == 1).sum()
    assert rounds == len(tasks) + short == frame["round"].nunique()

    # the table: one row per task, its best latency the best of its records
    ok = frame[frame["error_code"] == 0]
    best = ok.groupby("workload_key")["mean_latency"].min()
    rows = _table(text)
    assert [int(r[0]) for r in rows] == list(range(len(tasks)))
    for task, row in zip(tasks, rows):
        n = str(sizes[task.workload_key])
        assert int(row[2]) == task.weight and row[6:8] == [n, n], row
        assert float(row[3]) == pytest.approx(best[task.workload_key] * 1e3, abs=1e-4), row

    # the estimates: the weighted sum of the best records, and of the runtime's default schedules,
    # which every task measured first, so tuning never ends slower than the defaults
    default = {t.workload_key: default_programs(t)[0].steps_json() for t in tasks}
    default_s = sum(t.weight * ok[(ok["workload_key"] == t.workload_key)
                                  & (ok["steps"] == default[t.workload_key])]["mean_latency"].item() for t in tasks)
    after_s = sum(t.weight * best[t.workload_key] for t in tasks)
    line = re.search(r"estimated latency: ([\d.]+) ms \(runtime default schedules ([\d.]+) ms, start of this run "
                     r"n/a\)", text)
    assert line, text[-3000:]
    assert float(line.group(1)) == pytest.approx(after_s * 1e3, abs=1e-4)
    assert float(line.group(2)) == pytest.approx(default_s * 1e3, abs=1e-4)
    assert after_s <= default_s

    # the network built from those records ran and matched the NumPy reference
    assert re.search(r"measured latency: +[\d.]+ ms end to end .*check against the NumPy reference: OK", text), \
        text[-3000:]


def test_the_run_is_on_the_server_with_its_artifacts(run):
    from prefect.settings import PREFECT_API_URL, temporary_settings
    code, text, _, server = run
    assert code == 0, text[-5000:]
    url = re.search(r"Prefect UI: (http://127\.0\.0\.1:\d+)/runs/flow-run/([0-9a-f-]{36})", text)
    assert url.group(1) == server.ui_url
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        flow_run, artifacts, task_runs = read_back(url.group(2))
    assert flow_run.state.is_completed() and flow_run.name.startswith("resnet-18-llvm-")
    assert {a.type for a in artifacts} >= {"progress", "table", "markdown"}
    names = [t.name for t in task_runs]
    rounds = int(re.search(r"resnet-18 on llvm[^:]*: \d+ trials in (\d+) rounds", text).group(1))
    assert rounds >= 19 and sum(n.startswith("measure-r") for n in names) == rounds
    assert any(n.startswith("build-and-time-network") for n in names)
    assert all(t.state.is_completed() for t in task_runs), [(t.name, t.state.type) for t in task_runs]


def _readme_block(after: str) -> str:
    """The first ```python block of the README after the line that starts with `after`."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```python", text.index(after)) + len("```python")
    return text[start:text.index("```", start)]


def test_the_readme_history_recipes_answer_per_shape(run):
    """The README's pandas block, run as written against the store the command wrote, answers per task
    (per shape), not per op name, which four ResNet-18 convolutions share."""
    code, text, records, _ = run
    assert code == 0, text[-5000:]
    scope: dict = {}
    block = _readme_block("The history is a hive-partitioned Parquet dataset")
    exec(block.replace('"tuning-records"', repr(records)), scope)

    net, tasks = network_tasks("resnet-18", image_size=32)
    frame = RecordStore(records).read()
    ok = frame[frame["error_code"] == 0]
    label = {t.workload_key: t.label for t in tasks}
    assert (frame["task_label"] == frame["workload_key"].map(label)).all()
    expected = {label[k]: v for k, v in ok.groupby("workload_key")["mean_latency"].min().items()}
    assert len(expected) == len(tasks) and dict(scope["best"].droplevel("target")) == pytest.approx(expected)

    convs = {t.label for t in tasks if t.name == "conv2d_nhwc_bias_relu"}
    assert len(convs) > 1
    per_run = scope["per_run"]
    assert set(per_run.index.get_level_values("task_label")) == convs
    for (shape, run_id), gflops in per_run.items():
        key = next(t.workload_key for t in tasks if t.label == shape)
        assert gflops == pytest.approx(ok[(ok["workload_key"] == key) & (ok["flow_run_id"] == run_id)]["gflops"].max())
    assert scope["errors"].sum() == len(frame)
    assert dict(scope["kernels"]) == dict(ok.groupby("task_label").size())     # no kernel was timed twice


def test_the_readme_duckdb_and_polars_recipes_agree_with_pandas(run):
    """The README's DuckDB/polars block, run as written against the store the command wrote, gives each
    task's (each shape's) best latency, as pandas does."""
    code, text, records, _ = run
    assert code == 0, text[-5000:]
    scope: dict = {}
    exec(_readme_block("The same snapshot in DuckDB and polars").replace('"tuning-records"', repr(records)), scope)
    frame = RecordStore(records).read()
    ok = frame[frame["error_code"] == 0]
    expected = {(str(t), str(label)): v for (t, label), v in
                ok.groupby(["target", "task_label"], observed=True)["mean_latency"].min().items()}
    sql = {(r.target, r.task_label): r.best_s for r in scope["best_sql"].itertuples()}
    pol = {(r["target"], r["task_label"]): r["best_s"] for r in scope["best_pl"].to_dicts()}
    assert len(expected) > 1 and sql == pytest.approx(expected) and pol == pytest.approx(expected)


@pytest.mark.slow
def test_ctrl_c_ends_the_flow_with_one_line_and_no_worker_traceback(tmp_path):
    """Ctrl-C to the command's process group mid-flow: exit 130, one `interrupted:` line counting this
    run's stored measurements, and no KeyboardInterrupt traceback from the local cluster's workers."""
    records, port = tmp_path / "records", _free_port()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    proc = start_as_from_a_terminal([*COMMAND, "tune", "resnet-18", "--image-size", "32", "--trials", "400",
                                     "--records", str(records), "--port", str(port), "--stop-server"],
                                    cwd=tmp_path, env=env)
    out, err = ctrl_c_after_first_round(proc, records, 300)
    assert proc.returncode == 130, (out + err)[-3000:]
    stored = len(RecordStore(str(records)).read())
    assert f"interrupted: {stored} measurements of this run are stored in {records}" in err
    assert "KeyboardInterrupt" not in out + err and "Traceback" not in out + err, (out + err)[-6000:]
