"""End to end (slow): `prefect server` on loopback, `tensortune tune` as a user runs it, the run and its
artifacts read back and photographed in the UI with headless Chromium, and the deployments of
deploy/prefect.yaml created on that server: the nightly cron schedules runs, and a process worker runs an
on-demand run of the same flow to Completed."""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tensortune.flows.artifacts import artifact_key
from tensortune.flows.prefect_server import start_server
from tests.test_flow_tune import read_back, two_task_onnx

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium() -> str:
    """Debian's chromium, installed here when missing (needs root and the package mirror)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "chromium"], env=env, capture_output=True, timeout=900)
        found = shutil.which("chromium")
    if found is None:
        pytest.skip("chromium is missing and `apt-get install -y chromium` was not possible here")
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    srv = start_server(port=_free_port(), log_path=str(home / "server.log"),
                       env={"PREFECT_HOME": str(home), "PREFECT_API_SERVICES_SCHEDULER_LOOP_SECONDS": "5"})
    yield srv
    srv.stop()


def _env(server) -> dict[str, str]:
    """The environment of the CLI and of a worker: the worker's pull step goes to $TENSORTUNE_HOME, the
    checkout (deploy/README.md: export TENSORTUNE_HOME=$PWD), to load the deployments' entrypoints."""
    return {**os.environ, "PREFECT_API_URL": server.api_url, "TENSORTUNE_HOME": str(ROOT)}


def _read_back(server, run_id: str):
    from prefect.settings import PREFECT_API_URL, temporary_settings
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        return read_back(run_id)


def test_tune_command_runs_the_flow_and_the_ui_shows_its_artifacts(server, tmp_path):
    network = two_task_onnx(str(tmp_path / "mlp.onnx"))
    records = str(tmp_path / "records")
    proc = subprocess.run([str(BIN / "tensortune"), "tune", network, "--trials", "24", "--per-round", "8",
                           "--population", "64", "--records", records],
                          env=_env(server), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"records:    {records}" in proc.stdout
    match = re.search(r"Prefect UI: (http://127\.0\.0\.1:\d+/runs/flow-run/([0-9a-f-]{36}))", proc.stdout)
    assert match, proc.stdout[-3000:]
    url, run_id = match.groups()
    flow_run, found, _ = _read_back(server, run_id)
    assert flow_run.state.is_completed()
    assert {a.type for a in found} >= {"progress", "table", "markdown"}

    shot = Path(os.environ.get("TENSORTUNE_E2E_SCREENSHOT", str(tmp_path / "flow-run-artifacts.png")))
    shot.parent.mkdir(parents=True, exist_ok=True)
    with Chromium(chromium(), url) as page:          # the tab opens by a click: ?tab= loses a race with the data
        assert page.wait_for("document.getElementById('artifacts')?.offsetParent != null"), "no Artifacts tab"
        page.js("document.getElementById('artifacts').click()")
        keys = [artifact_key(network, "llvm", k) for k in ("progress", "tasks", "estimate")]
        assert page.wait_for(" && ".join(f"document.body.innerText.includes('{k}')" for k in keys)), \
            "the Artifacts tab does not list the run's artifacts:\n" + str(page.js("document.body.innerText"))[-2000:]
        time.sleep(1.0)                              # let the cards finish their transition
        page.screenshot(shot)
    assert shot.stat().st_size > 20_000
    print(f"screenshot of {url} (Artifacts tab): {shot}")


class Chromium:
    """Headless Chromium driven over the DevTools protocol: evaluate JavaScript, wait, screenshot."""

    def __init__(self, exe: str, url: str, size: tuple[int, int] = (1400, 1000)):
        from websockets.sync.client import connect
        self.profile = tempfile.mkdtemp(prefix="chromium-")
        port = _free_port()
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={self.profile}",
             f"--remote-debugging-port={port}", "--remote-allow-origins=*", f"--window-size={size[0]},{size[1]}", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as r:
                    target = next(t for t in json.load(r) if t["type"] == "page")
                break
            except (OSError, StopIteration, ValueError):
                if time.monotonic() > deadline:
                    self.close()
                    raise
                time.sleep(0.3)
        self.ws = connect(target["webSocketDebuggerUrl"], max_size=None)
        self.calls = 0

    def call(self, method: str, **params):
        self.calls += 1
        self.ws.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.calls:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def js(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.js(expression):
                return True
            time.sleep(0.25)
        return False

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _prefect(server, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(BIN / "prefect"), *args], env=_env(server), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"prefect {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_deployments_nightly_cron_schedules_runs_and_a_worker_runs_one(server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings
    _prefect(server, "work-pool", "create", "tensortune", "--type", "process")
    _prefect(server, "--no-prompt", "deploy", "--all", "--prefect-file", "deploy/prefect.yaml")
    with temporary_settings({PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name("tune-network/nightly")
        (sched,) = nightly.schedules
        assert sched.schedule.cron == "0 2 * * *" and sched.active
        deadline = time.monotonic() + 120
        scheduled = []
        while not scheduled and time.monotonic() < deadline:
            scheduled = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[nightly.id])))
            time.sleep(2)
        assert scheduled and all(r.state.is_scheduled() for r in scheduled)
        assert all(r.expected_start_time.hour == 2 and r.expected_start_time.minute == 0 for r in scheduled)

    network = two_task_onnx(str(tmp_path / "mlp.onnx"))
    params = {"network": network, "trials": 8, "per_round": 8, "records": str(tmp_path / "records"),
              "search": {"population": 64, "sample_init_population": 64, "num_iters": 1}}
    out = _prefect(server, "deployment", "run", "tune-network/on-demand", "--params", json.dumps(params))
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)
    _prefect(server, "worker", "start", "--pool", "tensortune", "--run-once", timeout=600)
    flow_run, found, _ = _read_back(server, run_id)
    assert flow_run.state.is_completed(), flow_run.state
    assert {a.type for a in found} >= {"progress", "table", "markdown"}
