"""The Prefect API the flow reports to: $PREFECT_API_URL when set, else a `prefect server` on loopback.

Prefect's ephemeral mode starts a throw-away server inside each process that talks to the API, and its
runs vanish with it; a real server on 127.0.0.1 keeps the runs, logs and artifacts for the UI after the
command ends. `ensure_server` reuses a healthy server on the port, or starts one with Prefect's own
`prefect server start --background` (its pid in $PREFECT_HOME/server.pid, so `prefect server stop`
stops it, as does `kill <pid>` or `PrefectServer.stop()`). Health is Prefect's client's own check,
`get_client().api_healthcheck()`, which sends PREFECT_API_AUTH_STRING to a server that asks for it.

The server `tensortune tune` starts runs on the machine that also times kernels (the embedded
LocalCluster), so it starts without the server services a local tuning run never uses (each wakes every
few seconds and queries the database):

- scheduler, late runs: they create and watch runs of deployments' schedules; the command has none;
- foreman: marks Prefect workers, work pools and deployments offline; no Prefect worker polls it;
- pause expirations: fails paused runs that time out; the flow never pauses;
- cancellation cleanup, cleanup reconciler: cancel the children of cancelled runs through workers; the
  command's run is in its own process and ends with it;
- repossessor: frees concurrency slots whose lease expired; the command takes none;
- triggers (and with them automation actions): evaluate automations; this server has none;
- analytics: the anonymous usage report Prefect sends when a server starts.

Kept, because the UI shows them: the API and the UI, the event persister (the run's events), the task
run recorder (task runs reach the server as events, this service writes them), the database vacuum
(event retention) and the live log and event streams. For deployments and schedules run a full server
(`prefect server start`, deploy/README.md); `start_server` starts one when not given `services`.

`prefect server start --background` connects its server's output to a pipe that closes when the CLI
exits, so the server is started with a logging configuration that writes its log to a file instead
(the error messages below quote its end).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 4200
SERVER_PID_FILE = "server.pid"       # where `prefect server start --background` keeps its server's pid

# Prefect settings (as environment variables) of the server `tensortune tune` starts: the services a
# local tuning run never uses are off (see the module docstring for each).
LOCAL_RUN_SERVICES: dict[str, str] = {
    "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_FOREMAN_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_PAUSE_EXPIRATIONS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_CLEANUP_RECONCILER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_REPOSSESSOR_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


class PrefectServerError(RuntimeError):
    """The Prefect API cannot be reached or a server cannot be started."""


@dataclass
class PrefectServer:
    api_url: str                 # http://127.0.0.1:4200/api
    pid: int | None = None       # the server process, when this process started it
    log_path: str = ""
    home: str = ""               # the PREFECT_HOME whose server.pid names it (started here)

    @property
    def ui_url(self) -> str:
        return self.api_url.rstrip("/").removesuffix("/api")

    def flow_run_url(self, flow_run_id: str) -> str:
        return f"{self.ui_url}/runs/flow-run/{flow_run_id}"

    @property
    def started_here(self) -> bool:
        return self.pid is not None

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the server this process started; others are left alone. Logs and events still queued in
        this process are sent first. A server whose pid file names it is stopped by `prefect server stop`
        (which also removes the file); otherwise, or if it outlives that, by signal."""
        if self.pid is None:
            return
        flush_to_api()
        pid, self.pid = self.pid, None
        if self.home and _read_pid(Path(self.home) / SERVER_PID_FILE) == pid:
            subprocess.run([sys.executable, "-m", "prefect", "server", "stop"], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120,
                           env={**os.environ, "PREFECT_HOME": self.home})
        else:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        if _alive(pid):
            _signal(pid, signal.SIGKILL)


def flush_to_api(timeout: float = 10.0) -> None:
    """Send the run logs and events this process still holds (Prefect ships them in the background)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    for service in (APILogWorker, EventsWorker):
        service.drain_all(timeout=timeout)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a server started in the background is not our child: it
    is reaped by whoever adopted it, which may be late)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def api_healthy(api_url: str, timeout: float = 2.0) -> bool:
    """True when `api_url` passes Prefect's client health check (`api_healthcheck`, with the
    PREFECT_API_AUTH_STRING credentials a server started with PREFECT_SERVER_API_AUTH_STRING asks for).
    One try: the client's retries are for a server that answered before, not for one still starting."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings
    with temporary_settings({PREFECT_API_URL: api_url, PREFECT_CLIENT_MAX_RETRIES: 0}):
        with get_client(httpx_settings={"timeout": timeout}, sync_client=True) as client:
            return client.api_healthcheck() is None


def configured_api_url() -> str | None:
    """PREFECT_API_URL from the environment or the active Prefect profile, if any."""
    from prefect.settings import PREFECT_API_URL
    return PREFECT_API_URL.value() or None


def start_server(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, timeout: float = 90.0,
                 log_path: str | None = None, env: dict[str, str] | None = None,
                 services: dict[str, str] | None = None) -> PrefectServer:
    """`prefect server start --background` on host:port; returns once the server passes its health
    check. env: extra variables for the server (e.g. PREFECT_HOME for a database of its own); services:
    Prefect settings that switch server services off (LOCAL_RUN_SERVICES; default: all services run)."""
    from prefect.settings import PREFECT_HOME
    api_url = f"http://{host}:{port}/api"
    child_env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    child_env["PREFECT_UI_API_URL"] = api_url              # the UI in the browser calls this URL
    child_env.update(services or {})
    child_env.update(env or {})
    home = Path(child_env.get("PREFECT_HOME") or PREFECT_HOME.value()).expanduser()
    child_env["PREFECT_HOME"] = str(home)
    if log_path is None:
        log_path = str(home / f"tensortune-server-{port}.log")
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    child_env["PREFECT_LOGGING_SETTINGS_PATH"] = _logging_config(log_path)
    _clear_stale_pid_file(home, port)
    command = [sys.executable, "-m", "prefect", "--no-prompt", "server", "start", "--background",
               "--host", host, "--port", str(port)]
    with open(log_path, "ab") as log:
        # a session of its own: Ctrl-C of the tuning run does not reach the server it leaves running
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=child_env, start_new_session=True, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    pid = _read_pid(home / SERVER_PID_FILE)
    if code != 0 or pid is None:
        raise PrefectServerError(f"`prefect server start --background --port {port}` failed ("
                                 + (f"exit code {code}" if code is not None else f"no answer in {timeout:.0f} s")
                                 + f"); its log ({log_path}) ends with:\n{_tail(log_path)}")
    server = PrefectServer(api_url, pid, log_path, str(home))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            (home / SERVER_PID_FILE).unlink(missing_ok=True)
            raise PrefectServerError(f"the Prefect server on {host}:{port} (pid {pid}) exited before answering; "
                                     f"its log ({log_path}) ends with:\n{_tail(log_path)}")
        if api_healthy(api_url, timeout=1.0):
            return server
        time.sleep(0.3)
    server.stop()
    raise PrefectServerError(f"the Prefect server on {host}:{port} did not pass its health check within "
                             f"{timeout:.0f} s; its log ({log_path}) ends with:\n{_tail(log_path)}")


def _logging_config(log_path: str) -> str:
    """A Prefect logging configuration (PREFECT_LOGGING_SETTINGS_PATH) sending the server's log to
    `log_path`: Uvicorn's and FastAPI's lines, Prefect's, and warnings from anything else; not one line
    per request. Written beside the log; JSON is YAML, and `$` is escaped for Prefect's templating."""
    handler = {"class": "logging.FileHandler", "filename": log_path, "formatter": "plain"}
    quiet = {"handlers": ["file"], "propagate": False}
    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"}},
        "handlers": {"file": handler},
        "loggers": {"uvicorn": {"level": "INFO", **quiet}, "uvicorn.access": {"level": "WARNING", **quiet},
                    "fastapi": {"level": "INFO", **quiet}, "prefect": {"level": "INFO", **quiet}},
        "root": {"level": "WARNING", "handlers": ["file"]},
    }
    path = Path(log_path).with_suffix(".logging.yml")
    path.write_text(json.dumps(config, indent=1).replace("$", "$$"))
    return str(path)


def _clear_stale_pid_file(home: Path, port: int) -> None:
    """Prefect starts one background server per PREFECT_HOME and refuses while its pid file exists. A
    file left by a server that is gone (stopped with `kill`, or a reboot) is removed; a live one is a
    clear error naming its port."""
    pid_file = home / SERVER_PID_FILE
    pid = _read_pid(pid_file)
    if not pid_file.exists():
        return
    command = _command_line(pid) if pid is not None and _alive(pid) else None
    if command is None or (command and "prefect.server.api.server:create_app" not in command):
        pid_file.unlink(missing_ok=True)
        return
    its_port = command[command.index("--port") + 1] if "--port" in command[:-1] else "another port"
    raise PrefectServerError(
        f"a Prefect server started with `prefect server start --background` from {home} already runs (pid "
        f"{pid}, port {its_port}), and Prefect keeps one per PREFECT_HOME: use its port (--port {its_port}), "
        "or stop it with `prefect server stop`")


def _command_line(pid: int) -> list[str]:
    """The process's arguments ([] where /proc cannot tell)."""
    try:
        return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def ensure_server(port: int = DEFAULT_PORT, host: str = DEFAULT_HOST) -> PrefectServer:
    """The configured API when PREFECT_API_URL is set (checked), else a loopback server on `port`
    (an already running one is reused; a new one runs without the services a local run never uses)."""
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
    return start_server(host, port, services=LOCAL_RUN_SERVICES)


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
