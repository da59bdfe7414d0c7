"""The Prefect API the flow reports to: $PREFECT_API_URL when set, else a `prefect server` on loopback.

Prefect's ephemeral mode starts a throw-away server inside each process that talks to the API, and its
runs vanish with it; a real server on 127.0.0.1 keeps the runs, logs and artifacts for the UI after the
command ends. `ensure_server` reuses a healthy server on the port, or starts one in its own session
(so Ctrl-C of the tuning run does not kill it) and says how to stop it: `PrefectServer.stop()` or
`kill <pid>`.
"""
from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 4200


class PrefectServerError(RuntimeError):
    """The Prefect API cannot be reached or a server cannot be started."""


@dataclass
class PrefectServer:
    api_url: str                 # http://127.0.0.1:4200/api
    pid: int | None = None       # the server process, when this process started it
    log_path: str = ""

    @property
    def ui_url(self) -> str:
        return self.api_url.rstrip("/").removesuffix("/api")

    def flow_run_url(self, flow_run_id: str) -> str:
        return f"{self.ui_url}/runs/flow-run/{flow_run_id}"

    @property
    def started_here(self) -> bool:
        return self.pid is not None

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the server this process started (its process group, by pid); others are left alone.
        Logs and events still queued in this process are sent first."""
        if self.pid is None:
            return
        flush_to_api()
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            self.pid = None
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(self.pid):
            time.sleep(0.2)
        if _alive(self.pid):
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.pid = None


def flush_to_api(timeout: float = 10.0) -> None:
    """Send the run logs and events this process still holds (Prefect ships them in the background)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    for service in (APILogWorker, EventsWorker):
        service.drain_all(timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)   # reap our own child; raises for a foreign pid
        return done == 0
    except ChildProcessError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def api_healthy(api_url: str, timeout: float = 2.0) -> bool:
    """True when `api_url` answers Prefect's health check (with PREFECT_API_AUTH_STRING's basic auth,
    the credentials a server started with PREFECT_SERVER_API_AUTH_STRING asks for, when it is set)."""
    from prefect.settings import PREFECT_API_AUTH_STRING
    request = urllib.request.Request(f"{api_url.rstrip('/')}/health")
    auth = PREFECT_API_AUTH_STRING.value()
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status == 200 and json.loads(response.read() or b"null") is True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def configured_api_url() -> str | None:
    """PREFECT_API_URL from the environment or the active Prefect profile, if any."""
    from prefect.settings import PREFECT_API_URL
    return PREFECT_API_URL.value() or None


def start_server(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, timeout: float = 90.0,
                 log_path: str | None = None, env: dict[str, str] | None = None) -> PrefectServer:
    """Start `prefect server start` on host:port in a new session; returns once /api/health answers.
    env: extra variables for the server (e.g. PREFECT_HOME for a database of its own)."""
    api_url = f"http://{host}:{port}/api"
    if log_path is None:
        from prefect.settings import PREFECT_HOME
        log_path = str(Path(PREFECT_HOME.value()) / f"tensortune-server-{port}.log")
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
           "PREFECT_UI_API_URL": api_url, **(env or {})}            # the UI in the browser calls this URL
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", host,
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    server = PrefectServer(api_url, proc.pid, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PrefectServerError(f"`prefect server start --port {port}` exited with code {proc.returncode} "
                                     f"before answering; its log ({log_path}) ends with:\n{_tail(log_path)}")
        if api_healthy(api_url, timeout=1.0):
            return server
        time.sleep(0.3)
    server.stop()
    raise PrefectServerError(f"the Prefect server on {host}:{port} did not answer {api_url}/health within "
                             f"{timeout:.0f} s; its log ({log_path}) ends with:\n{_tail(log_path)}")


def ensure_server(port: int = DEFAULT_PORT, host: str = DEFAULT_HOST) -> PrefectServer:
    """The configured API when PREFECT_API_URL is set (checked), else a loopback server on `port`
    (an already running one is reused)."""
    url = configured_api_url()
    if url:
        if not api_healthy(url, timeout=5.0):
            raise PrefectServerError(
                f"PREFECT_API_URL={url} does not answer its health check. Start that server "
                f"(`prefect server start`), fix the URL, or unset PREFECT_API_URL to let tensortune start "
                f"one on {host}:{port}")
        return PrefectServer(url)
    api_url = f"http://{host}:{port}/api"
    if api_healthy(api_url):
        return PrefectServer(api_url)
    if _port_in_use(host, port):
        raise PrefectServerError(f"port {port} on {host} is taken by something that is not a Prefect server; "
                                 "pass another --port or set PREFECT_API_URL")
    return start_server(host, port)


def _port_in_use(host: str, port: int) -> bool:
    import socket
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def _tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
