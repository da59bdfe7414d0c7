"""deploy/: the deployments are valid for Prefect, their cron schedule is what it says, every one has a
time limit, one run at a time and typed parameters the server checks, and the failed-nightly automation
matches the states a failed run ends in, a timed-out one included (a real run past its limit); the Dask
cluster specs of the compose file start a real TLS scheduler, CPU measure worker and GPU worker that
advertise their resources and measure a batch, and refuse a client without the cluster's certificate;
nothing the compose file publishes listens beyond 127.0.0.1 or without credentials. And the local
Prefect server `tensortune tune` starts: Prefect's own `server start --background`, with the services a
local run never uses off in the running server, its stale pid file cleared, stopped by `server stop`.
(deploy/'s jobqueue and Kubernetes specs: tests/test_cluster_specs.py.)"""
from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_prefect_yaml_is_valid_and_its_entrypoints_and_parameters_load():
    from prefect.cli.deploy._models import PrefectYamlModel  # what `prefect deploy` validates with
    from prefect.flows import load_flow_from_entrypoint
    raw = load("prefect.yaml")
    project = PrefectYamlModel.model_validate(raw)
    assert {d.name for d in project.deployments} >= {"nightly"}
    for d in project.deployments:
        flow = load_flow_from_entrypoint(str(ROOT / d.entrypoint))
        assert flow.name == "tune-network"
        flow.validate_parameters(dict(d.parameters))            # every parameter exists and has its type
        assert d.work_pool.name == "tensortune"


def _flows() -> dict[str, object]:
    """Each deployment's flow, loaded from its entrypoint as `prefect deploy` and a worker load it."""
    from prefect.flows import load_flow_from_entrypoint
    return {d["name"]: load_flow_from_entrypoint(str(ROOT / d["entrypoint"]))
            for d in load("prefect.yaml")["deployments"]}


def test_every_deployment_queues_its_runs_and_pulls_the_checkout():
    """Every deployment measures, so each allows one run at a time (a second waits: ENQUEUE) and has
    the server check its parameters; the pull step puts the worker in the checkout ($TENSORTUNE_HOME,
    set by the Docker image) where its entrypoint lives."""
    from prefect.cli.deploy._models import ConcurrencyLimitSpec
    raw = load("prefect.yaml")
    for d in raw["deployments"]:
        limit = ConcurrencyLimitSpec.model_validate(d["concurrency_limit"])
        assert (limit.limit, limit.collision_strategy) == (1, "ENQUEUE"), d["name"]
        assert d["enforce_parameter_schema"] is True and d["work_pool"]["name"] == "tensortune"
    assert "set-concurrency-limit tensortune 1" in (DEPLOY / "prefect.yaml").read_text()   # across deployments
    (step,) = raw["pull"]
    assert step["prefect.deployments.steps.set_working_directory"]["directory"] == "{{ $TENSORTUNE_HOME }}"
    assert "ENV TENSORTUNE_HOME=/app" in (DEPLOY / "Dockerfile").read_text()


def test_every_deployment_has_a_time_limit_the_command_line_does_not():
    """A deployment's runs hold the measure nodes one at a time, so each has a time limit; the nightly
    one ends before the next night's run is due. `tensortune tune` calls the flow itself: no limit."""
    from prefect.server.schemas.schedules import CronSchedule

    from tensortune.flows.tune_flow import tune_network_flow
    flows = _flows()
    assert all(f.name == "tune-network" and f.timeout_seconds for f in flows.values())
    (nightly,) = [d for d in load("prefect.yaml")["deployments"] if d["name"] == "nightly"]
    (spec,) = nightly["schedules"]
    start = datetime(2026, 3, 28, 12, 0, tzinfo=timezone.utc)
    first, second = asyncio.run(CronSchedule(cron=spec["cron"], timezone=spec["timezone"]).get_dates(n=2, start=start))
    assert flows["nightly"].timeout_seconds < (second - first).total_seconds()
    assert tune_network_flow.timeout_seconds is None


def test_search_and_timing_are_typed_parameters():
    """`search` and `timing` are pydantic models: the deployment's schema describes their fields, a plain
    dict (what a JSON parameter is) becomes the model, an unknown field or a wrong type is refused with
    the field named, and each model holds exactly the fields of the dataclass it fills in."""
    from dataclasses import fields, replace

    from prefect.exceptions import ParameterTypeError

    from tensortune.codegen.timing import NETWORK_TIMING, TimingConfig
    from tensortune.flows.tune_flow import SearchOptions, TimingOptions, tune_network_flow
    from tensortune.search.params import SearchParams
    schema = tune_network_flow.parameters.model_dump()
    assert {"SearchOptions", "TimingOptions"} <= set(schema["definitions"])
    assert set(schema["definitions"]["SearchOptions"]["properties"]) >= {"population", "num_iters"}
    given = tune_network_flow.validate_parameters({"search": {"population": 64}, "timing": {"repeat": 3}})
    assert given["search"] == SearchOptions(population=64) and given["timing"] == TimingOptions(repeat=3)
    for bad, field in (({"search": {"populaton": 64}}, "populaton"), ({"timing": {"repeat": "many"}}, "repeat"),
                       ({"search": {"population": 0}}, "population")):
        with pytest.raises(ParameterTypeError, match=field):
            tune_network_flow.validate_parameters(bad)
    assert set(SearchOptions.model_fields) == {f.name for f in fields(SearchParams)} - {"num_measures_per_round"}
    assert set(TimingOptions.model_fields) == ({f.name for f in fields(TimingConfig)} - {"reference"}
                                              | {"build_timeout", "run_timeout"})
    assert SearchOptions(population=64).params(8) == SearchParams(population=64, num_measures_per_round=8)
    assert SearchOptions().params(64) == SearchParams()
    assert TimingOptions(repeat=5).config() == replace(NETWORK_TIMING, repeat=5)
    assert TimingOptions().config() == NETWORK_TIMING


def test_the_failed_nightly_automation_is_valid():
    """deploy/automations.yaml, with a notification block's id filled in as its header says, is an
    automation Prefect accepts, triggered by a Failed, TimedOut or Crashed run tagged nightly."""
    import uuid

    from prefect.automations import AutomationCore
    text = (DEPLOY / "automations.yaml").read_text().replace("${NOTIFY_BLOCK_ID}", str(uuid.uuid4()))
    (spec,) = yaml.safe_load(text)["automations"]
    automation = AutomationCore.model_validate(spec)
    assert set(automation.trigger.expect) == {"prefect.flow-run.Failed", "prefect.flow-run.TimedOut",
                                              "prefect.flow-run.Crashed"}
    assert automation.actions[0].type == "send-notification"
    (nightly,) = [d for d in load("prefect.yaml")["deployments"] if d["name"] == "nightly"]
    assert "nightly" in nightly["tags"]                  # what the trigger's match_related names


def test_a_run_past_its_time_limit_ends_in_a_state_the_automation_expects(local_server):
    """A real flow run with a time limit, on a real server: it ends Failed under the name TimedOut, and
    the state event Prefect emits for it (prefect.flow-run.<state name>) is one the automation expects."""
    from prefect import flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    @flow(timeout_seconds=1)
    def hangs() -> None:
        time.sleep(60)

    with temporary_settings({PREFECT_API_URL: local_server.api_url}):
        state = hangs(return_state=True)
    assert state.is_failed() and state.name == "TimedOut"
    (spec,) = load("automations.yaml")["automations"]
    assert f"prefect.flow-run.{state.name}" in spec["trigger"]["expect"]


def test_nightly_cron_schedule_runs_every_night_at_two_utc():
    from prefect.server.schemas.schedules import CronSchedule
    (nightly,) = [d for d in load("prefect.yaml")["deployments"] if d["name"] == "nightly"]
    (spec,) = nightly["schedules"]
    assert spec["active"] is True and nightly["concurrency_limit"]["limit"] == 1
    schedule = CronSchedule(cron=spec["cron"], timezone=spec["timezone"])
    start = datetime(2026, 3, 28, 12, 0, tzinfo=timezone.utc)
    dates = asyncio.run(schedule.get_dates(n=4, start=start))
    first = datetime(2026, 3, 29, 2, 0, tzinfo=timezone.utc)
    assert [d.astimezone(timezone.utc) for d in dates] == [first + timedelta(days=k) for k in range(4)]
    with pytest.raises(ValueError):
        CronSchedule(cron="0 2 * *", timezone="UTC")             # a broken cron line is rejected


def test_compose_wires_the_pool_the_cluster_and_the_records():
    compose = load("compose.yaml")
    services = compose["services"]
    worker = services["prefect-worker"]
    assert "--pool tensortune" in worker["command"]
    assert worker["environment"]["TENSORTUNE_CLUSTER"] == "tls://dask-scheduler:8786"
    assert worker["environment"]["TENSORTUNE_TLS_DIR"] == "/certs"
    assert any(v.endswith(":/app/tuning-records") for v in worker["volumes"])
    assert "--resources measure-cpu=1" in services["cpu-worker"]["command"]
    assert "--resources GPU=1" in services["gpu-worker"]["command"]
    assert services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "constraints.txt" in dockerfile and "libgomp1" in dockerfile


def test_compose_is_secure_by_default():
    """Published ports bind the host's loopback only; Dask speaks TLS with certificates on every process;
    the Prefect API asks for credentials (compose refuses to start without them)."""
    services = load("compose.yaml")["services"]
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    for name in ("dask-scheduler", "cpu-worker", "gpu-worker"):
        command = services[name]["command"]
        assert "tcp://" not in command and all(f in command for f in ("--tls-ca-file", "--tls-cert", "--tls-key"))
        assert "./certs:/certs:ro" in services[name]["volumes"]
    assert "--protocol tls" in services["dask-scheduler"]["command"]
    server = services["prefect-server"]["environment"]
    assert server["PREFECT_SERVER_API_AUTH_STRING"].startswith("${PREFECT_API_AUTH_STRING:?")
    assert services["prefect-worker"]["environment"]["PREFECT_API_AUTH_STRING"].startswith("${PREFECT_API_AUTH_STRING")
    assert "deploy/certs/" in (ROOT / ".gitignore").read_text().split()      # private keys never committed


def _tls_without_certificate_refused(port: int, ca_file: Path) -> bool:
    """Complete a TLS handshake with the scheduler without a client certificate, then send: True when the
    scheduler refuses (TLS 1.3 sends its 'certificate required' alert at the first read)."""
    context = ssl.create_default_context(cafile=str(ca_file))
    context.check_hostname = False
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="dask-scheduler") as tls:
                tls.sendall(b"\0" * 16)
                return tls.recv(1) == b""
        except (ssl.SSLError, ConnectionError):
            return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dask_args(command: str, scheduler: str, port: int, certs: Path) -> list[str]:
    """A compose `dask ...` command run here: the scheduler's address and ports made local, the
    certificates' mount (/certs) this test's folder."""
    args = shlex.split(command.replace("tls://dask-scheduler:8786", scheduler).replace("/certs/", f"{certs}/"))
    assert args[0] == "dask"
    args = [a.replace("8786", str(port)).replace("0.0.0.0", "127.0.0.1") for a in args]
    if "--dashboard-address" in args:
        i = args.index("--dashboard-address")
        args[i:i + 2] = ["--no-dashboard"]
    return [str(Path(sys.executable).with_name("dask"))] + args[1:]


def test_the_compose_cluster_specs_start_a_real_cluster_that_measures(tmp_path):
    from distributed import Client
    from distributed.security import Security

    from tensortune.codegen.target import make_task
    from tensortune.codegen.timing import TimingConfig
    from tensortune.flows.cluster_security import TLS_DIR_ENV, make_certificates
    from tensortune.flows.dask_cluster import cluster_workers, connect, workers_with
    from tensortune.flows.dask_measure import DaskMeasurer
    from tensortune.schedule.state import State
    from tensortune.tasks.workload_registry import make_dag
    services = load("compose.yaml")["services"]
    port = _free_port()
    scheduler = f"tls://127.0.0.1:{port}"
    certs = make_certificates(tmp_path / "certs", ["dask-scheduler"])       # what deploy/README says to run
    strangers = make_certificates(tmp_path / "other-ca", ["dask-scheduler"])
    procs = []
    try:
        for name in ("dask-scheduler", "cpu-worker", "gpu-worker"):
            args = _dask_args(services[name]["command"], scheduler, port, certs.folder)
            if name != "dask-scheduler":
                args += ["--no-dashboard"]
            procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
            if name == "dask-scheduler":
                time.sleep(1.0)
        os.environ[TLS_DIR_ENV] = str(certs.folder)
        with connect(scheduler, timeout=60) as client:                    # the flow's way in
            client.wait_for_workers(2, timeout=90)
            # refused by the scheduler: a client that trusts it but shows another CA's certificate, one
            # that shows none (TLS straight from Python's ssl), and plain TCP
            impostor = Security(tls_ca_file=str(certs.ca_file), tls_client_cert=str(strangers.cert),
                                tls_client_key=str(strangers.key), require_encryption=True)
            with pytest.raises((OSError, TimeoutError)):
                Client(scheduler, timeout=5, set_as_default=False, security=impostor)
            assert _tls_without_certificate_refused(port, certs.ca_file)
            with pytest.raises((OSError, TimeoutError)):
                Client(f"tcp://127.0.0.1:{port}", timeout=5, set_as_default=False)
            names = {info["name"]: addr for addr, info in cluster_workers(client).items()}
            assert workers_with(client, "measure-cpu") == [names["cpu-0"]]
            assert workers_with(client, "GPU") == [names["gpu-0"]]
            task = make_task(make_dag("matmul", 32, 32, 32))
            results = DaskMeasurer(client, timing=TimingConfig(min_repeat_ms=2)).measure(
                task, [State(task.dag).steps_json(), State(task.dag).split("C", 1, [16]).steps_json()])
            assert all(r.ok for r in results), [r.error_msg for r in results]
    finally:
        os.environ.pop(TLS_DIR_ENV, None)
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


# ------------------------------------------------------------------ the local server of `tensortune tune`

@pytest.fixture(scope="module")
def local_server(tmp_path_factory):
    """The server `tensortune tune` starts (LOCAL_RUN_SERVICES), in a Prefect home of its own that holds
    a pid file left by a server that is gone: Prefect would refuse to start while it is there."""
    from tensortune.flows.prefect_server import LOCAL_RUN_SERVICES, SERVER_PID_FILE, start_server
    home = tmp_path_factory.mktemp("prefect-home")
    gone = subprocess.Popen(["true"])
    gone.wait()
    (home / SERVER_PID_FILE).write_text(str(gone.pid))
    server = start_server(port=_free_port(), env={"PREFECT_HOME": str(home)}, services=LOCAL_RUN_SERVICES)
    yield server
    server.stop()


def test_the_local_server_is_prefects_background_server(local_server):
    from tensortune.flows.prefect_server import SERVER_PID_FILE, _command_line, api_healthy
    home = Path(local_server.home)
    assert (home / SERVER_PID_FILE).read_text().strip() == str(local_server.pid)    # `prefect server stop` finds it
    assert "prefect.server.api.server:create_app" in _command_line(local_server.pid)
    assert api_healthy(local_server.api_url)
    assert "Uvicorn running on" in Path(local_server.log_path).read_text()          # its log, in the file


def test_the_local_server_runs_without_the_services_a_local_run_never_uses(local_server):
    """The running server's own settings (GET /admin/settings): every service LOCAL_RUN_SERVICES names
    is off (each name is a real setting), the ones the UI needs are on."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, Settings, temporary_settings

    from tensortune.flows.prefect_server import LOCAL_RUN_SERVICES
    with temporary_settings({PREFECT_API_URL: local_server.api_url}), get_client(sync_client=True) as client:
        settings = Settings.model_validate(client._client.get("/admin/settings").json())
    services = settings.server.services
    off = {"SCHEDULER": services.scheduler, "LATE_RUNS": services.late_runs, "FOREMAN": services.foreman,
           "PAUSE_EXPIRATIONS": services.pause_expirations, "CANCELLATION_CLEANUP": services.cancellation_cleanup,
           "CLEANUP_RECONCILER": services.cleanup_reconciler, "REPOSSESSOR": services.repossessor,
           "TRIGGERS": services.triggers}
    assert set(LOCAL_RUN_SERVICES) == {f"PREFECT_SERVER_SERVICES_{k}_ENABLED" for k in off} | {
        "PREFECT_SERVER_ANALYTICS_ENABLED"}
    assert not any(s.enabled for s in off.values()) and not settings.server.analytics_enabled
    assert services.event_persister.enabled and services.task_run_recorder.enabled and settings.server.ui.enabled


def test_tensortune_reuses_a_healthy_server_and_names_a_live_background_one(local_server):
    """ensure_server on the port of a running server uses it (and would not stop it); a second
    background server in the same Prefect home is refused with the running one's port."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tensortune.flows.prefect_server import PrefectServerError, _clear_stale_pid_file, ensure_server
    port = int(local_server.ui_url.rsplit(":", 1)[1])
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        reused = ensure_server(port)
    assert reused.api_url == local_server.api_url and not reused.started_here
    with pytest.raises(PrefectServerError, match=rf"already runs \(pid {local_server.pid}, port {port}\)"):
        _clear_stale_pid_file(Path(local_server.home), port + 1)


def test_a_server_that_cannot_start_is_one_error_quoting_its_log(tmp_path):
    """`prefect server start --background` refusing (its port is taken) is a PrefectServerError that
    quotes the end of the log, where Prefect said why; no pid file is left behind."""
    from tensortune.flows.prefect_server import SERVER_PID_FILE, PrefectServerError, start_server
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PrefectServerError, match=rf"(?s)--port {port}` failed \(exit code 1\).*already in use"):
            start_server(port=port, env={"PREFECT_HOME": str(tmp_path)}, timeout=60)
    assert not (tmp_path / SERVER_PID_FILE).exists()


def test_stopping_the_local_server_uses_prefect_server_stop(local_server):
    """Last in this module: the server stops, its pid file is gone (Prefect's `server stop` removes it),
    and the port answers no more."""
    from tensortune.flows.prefect_server import SERVER_PID_FILE, _alive, api_healthy
    pid = local_server.pid
    local_server.stop()
    assert not _alive(pid) and not local_server.started_here
    assert not (Path(local_server.home) / SERVER_PID_FILE).exists()
    assert not api_healthy(local_server.api_url, timeout=1.0)
