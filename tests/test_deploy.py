"""deploy/: the nightly deployment is valid for Prefect and its cron schedule is what it says; the Dask
cluster specs of the compose file start a real TLS scheduler, CPU measure worker and GPU worker that
advertise their resources and measure a batch, and refuse a client without the cluster's certificate;
nothing the compose file publishes listens beyond 127.0.0.1 or without credentials."""
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


def test_every_deployment_queues_its_runs_and_pulls_the_checkout():
    """Every deployment measures, so each allows one run at a time; the pull step puts the worker in the
    checkout ($TENSORTUNE_HOME, set by the Docker image) where its flows/ entrypoint lives."""
    raw = load("prefect.yaml")
    assert all(d["concurrency_limit"] == 1 for d in raw["deployments"])
    (step,) = raw["pull"]
    assert step["prefect.deployments.steps.set_working_directory"]["directory"] == "{{ $TENSORTUNE_HOME }}"
    assert "ENV TENSORTUNE_HOME=/app" in (DEPLOY / "Dockerfile").read_text()


def test_the_failed_nightly_automation_is_valid():
    """deploy/automations.yaml, with a notification block's id filled in as its header says, is an
    automation Prefect accepts, triggered by a Failed or Crashed run tagged nightly."""
    import uuid

    from prefect.automations import AutomationCore
    text = (DEPLOY / "automations.yaml").read_text().replace("${NOTIFY_BLOCK_ID}", str(uuid.uuid4()))
    (spec,) = yaml.safe_load(text)["automations"]
    automation = AutomationCore.model_validate(spec)
    assert set(automation.trigger.expect) == {"prefect.flow-run.Failed", "prefect.flow-run.Crashed"}
    assert automation.actions[0].type == "send-notification"
    (nightly,) = [d for d in load("prefect.yaml")["deployments"] if d["name"] == "nightly"]
    assert "nightly" in nightly["tags"]                  # what the trigger's match_related names


def test_nightly_cron_schedule_runs_every_night_at_two_utc():
    from prefect.server.schemas.schedules import CronSchedule
    (nightly,) = [d for d in load("prefect.yaml")["deployments"] if d["name"] == "nightly"]
    (spec,) = nightly["schedules"]
    assert spec["active"] is True and nightly["concurrency_limit"] == 1
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
    from tensortune.flows.dask_cluster import connect, workers_with
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
            names = {info["name"]: addr for addr, info in client.scheduler_info(n_workers=-1)["workers"].items()}
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
