"""deploy/'s specs for the clusters users have, as far as this machine can run them.

- dask-jobqueue (deploy/jobqueue.yaml, deploy/jobqueue_cluster.py): the SLURM and PBS job scripts are
  dask-jobqueue's own, generated from the spec; each is then run here with bash, as the batch system
  runs it on a node, and its workers join the launcher's TLS scheduler with the measure node's
  resources (a GPU job: one worker per GPU of its allocation).
- the Dask Kubernetes operator (deploy/kubernetes.yaml): the DaskCluster and DaskWorkerGroup validate
  against the operator's CRD schemas (tests/data/dask_kubernetes_crds.json, from dask-kubernetes'
  Helm chart), unknown fields included, as `kubectl apply --validate=strict` would; then their
  scheduler and worker containers' commands run here, TLS files and addresses made local.
- one worker per GPU (flows/dask_cluster.py): a LocalCluster started with a GPU node's worker options
  gives each worker process its own CUDA_VISIBLE_DEVICES, read back from the workers (no GPU needed to
  see them); more workers than GPUs is an error.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import dask
import pytest
import yaml

import tensortune
from tensortune.flows import dask_cluster
from tensortune.flows.cluster_security import TLS_DIR_ENV, make_certificates
from tensortune.flows.dask_cluster import (
    CPU_RESOURCE,
    GPU_PRELOAD,
    GPU_RESOURCE,
    ClusterError,
    cluster_workers,
    connect,
    cpu_measure_node,
    gpu_node,
    visible_gpus,
    workers_with,
)

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CRDS = json.loads((ROOT / "tests" / "data" / "dask_kubernetes_crds.json").read_text())


def _launcher():
    """deploy/jobqueue_cluster.py, loaded as the script it is (deploy/ is not a package)."""
    spec = importlib.util.spec_from_file_location("tensortune_jobqueue_cluster", DEPLOY / "jobqueue_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def certs(tmp_path, monkeypatch):
    made = make_certificates(tmp_path / "certs", ["tensortune-scheduler"])
    monkeypatch.setenv(TLS_DIR_ENV, str(made.folder))
    return made


@pytest.fixture
def jobqueue_spec():
    """deploy/jobqueue.yaml loaded into Dask's configuration, as the launcher does; restored afterwards
    (to the configuration with dask-jobqueue's defaults, which it adds once, when first imported)."""
    import dask_jobqueue  # noqa: F401
    saved = copy.deepcopy(dask.config.config)
    launcher = _launcher()
    launcher.load_spec()
    try:
        yield launcher
    finally:
        dask.config.config.clear()
        dask.config.config.update(saved)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a worker started here, `tensortune` importable as it is here."""
    env = dict(os.environ)
    where = Path(tensortune.__file__).parent.parent
    if (where / "tensortune").exists():
        env["PYTHONPATH"] = os.pathsep.join([str(where), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return {**env, **(extra or {})}


class Processes:
    """Processes started in sessions of their own, stopped (the whole group) at the end."""

    def __init__(self, tmp_path: Path):
        self.tmp, self.procs = tmp_path, []

    def start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.tmp / f"proc-{len(self.procs)}.log", "wb")
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.tmp.glob("proc-*.log")))

    def stop(self) -> None:
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def processes(tmp_path):
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop()


def _worker_line(script: str) -> str:
    (line,) = [ln for ln in script.splitlines() if "distributed.cli.dask_worker" in ln]
    return line


def _wait_for(client, n: int, procs: Processes, timeout: float = 90) -> dict[str, dict]:
    try:
        client.wait_for_workers(n, timeout=timeout)
    except TimeoutError:
        pytest.fail(f"{n} workers did not join; their output:\n{procs.logs()}")
    return cluster_workers(client)


# ------------------------------------------------------------------ dask-jobqueue: SLURM and PBS

@pytest.mark.parametrize("system, gpus", [("slurm", 0), ("slurm", 4), ("pbs", 0), ("pbs", 4)])
def test_jobqueue_job_scripts_make_measure_nodes_with_tls(jobqueue_spec, certs, system, gpus):
    """The job script dask-jobqueue writes from the spec: the node to itself, the worker command with
    the measure node's counts and resources (flows.dask_cluster's rules), the profiler off, TLS flags
    naming the cluster's certificates, and the GPUs asked from the batch system."""
    cores = dask.config.get(f"jobqueue.{system}.cores")
    node = gpu_node(gpus, cores) if gpus else cpu_measure_node(cores)
    with jobqueue_spec.make_cluster(system, gpus_per_node=gpus, port=0, dashboard_address="127.0.0.1:0") as cluster:
        script = cluster.job_script()
        assert cluster.scheduler_address.startswith("tls://")
    command = _worker_line(script)
    assert f"--nthreads {node.nthreads}" in command
    assert (f"--nworkers {gpus}" in command) == (gpus > 1) and "--nanny" in command
    assert " ".join(node.extra_args()) in command
    assert "--protocol tls://" in command
    for flag, path in (("--tls-ca-file", certs.ca_file), ("--tls-cert", certs.cert), ("--tls-key", certs.key)):
        assert f"{flag} {path.resolve()}" in command
    assert "export DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False" in script
    node_to_itself = "#SBATCH --exclusive" if system == "slurm" else "#PBS -l place=excl"
    assert node_to_itself in script
    if gpus:
        assert (f"#SBATCH --gres=gpu:{gpus}" in script if system == "slurm"
                else f":ngpus={gpus}" in next(ln for ln in script.splitlines() if "select=1" in ln))
    else:
        assert "gres" not in script and "ngpus" not in script and f"{CPU_RESOURCE}=1" in command


def test_jobqueue_launcher_refuses_to_start_without_tls(jobqueue_spec, monkeypatch):
    monkeypatch.delenv(TLS_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match=TLS_DIR_ENV):
        jobqueue_spec.make_cluster("slurm", port=0)
    assert jobqueue_spec.main(["slurm", "--job-script", "--port", "0"]) == 2


def test_a_slurm_cpu_job_run_here_joins_as_a_measure_node(jobqueue_spec, certs, processes, tmp_path):
    """The CPU job script, run with bash as SLURM runs it on a node: one worker joins the launcher's TLS
    scheduler advertising measure-cpu=1, its profiler off (the script's prologue)."""
    with jobqueue_spec.make_cluster("slurm", port=0, dashboard_address="127.0.0.1:0") as cluster:
        job = tmp_path / "job.sh"
        job.write_text(cluster.job_script())
        processes.start(["bash", str(job)], _env())
        with connect(cluster.scheduler_address, timeout=30) as client:
            workers = _wait_for(client, 1, processes)
            assert [i["resources"] for i in workers.values()] == [{CPU_RESOURCE: 1.0}]
            profiling = client.run(lambda: dask.config.get("distributed.worker.profile.enabled"))
            assert list(profiling.values()) == [False]
        processes.stop()


def test_a_pbs_gpu_job_run_here_gives_each_worker_one_gpu(jobqueue_spec, certs, processes, tmp_path):
    """The GPU job script (2 GPUs per node), run with bash where the batch system gave the job GPUs 3
    and 5: two workers join, each advertising GPU=1 and seeing one of the two GPUs, not the same one."""
    with jobqueue_spec.make_cluster("pbs", gpus_per_node=2, port=0, dashboard_address="127.0.0.1:0") as cluster:
        job = tmp_path / "job.sh"
        job.write_text(cluster.job_script())
        processes.start(["bash", str(job)], _env({"CUDA_VISIBLE_DEVICES": "3,5"}))
        with connect(cluster.scheduler_address, timeout=30) as client:
            workers = _wait_for(client, 2, processes)
            assert all(i["resources"][GPU_RESOURCE] == 1.0 for i in workers.values())
            seen = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
            assert sorted(seen.values()) == ["3", "5"]
        processes.stop()


# ------------------------------------------------------------------ Kubernetes: the Dask operator

def _k8s() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()) if doc}


def _schema(kind: str) -> dict:
    return {**CRDS[kind], "definitions": CRDS["definitions"]}


def _unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Fields the schema does not declare (the API server would drop them silently; `kubectl apply
    --validate=strict` refuses them): typos, or fields in the wrong place."""
    if "$ref" in schema:
        schema = CRDS["definitions"][schema["$ref"].rsplit("/", 1)[1]]
    found = []
    if isinstance(value, dict) and "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        for key, item in value.items():
            if key not in schema["properties"]:
                found.append(f"{path}.{key}")
            else:
                found += _unknown_fields(item, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            found += _unknown_fields(item, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += _unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def _problems(doc: dict) -> list[str]:
    import jsonschema
    assert doc["apiVersion"] == "kubernetes.dask.org/v1"
    validator = jsonschema.Draft7Validator(_schema(doc["kind"]))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    return errors + _unknown_fields(doc["spec"], CRDS[doc["kind"]]["properties"]["spec"], "spec")


def test_kubernetes_specs_are_valid_for_the_operator():
    specs = _k8s()
    assert set(specs) == {"DaskCluster", "DaskWorkerGroup"}
    for doc in specs.values():
        assert _problems(doc) == [], doc["kind"]
    assert specs["DaskWorkerGroup"]["spec"]["cluster"] == specs["DaskCluster"]["metadata"]["name"]


def test_the_kubernetes_validation_catches_mistakes():
    """The check above can fail: a misspelt field, one in the wrong place, and a wrong type."""
    cluster = _k8s()["DaskCluster"]
    typo = copy.deepcopy(cluster)
    typo["spec"]["worker"]["replica"] = typo["spec"]["worker"].pop("replicas")
    assert _problems(typo) == ["spec.worker.replica"]
    misplaced = copy.deepcopy(cluster)
    misplaced["spec"]["worker"]["spec"]["containers"][0]["limits"] = {"cpu": "1"}
    assert _problems(misplaced) == ["spec.worker.spec.containers[0].limits"]
    wrong = copy.deepcopy(cluster)
    wrong["spec"]["worker"]["replicas"] = "two"
    assert any("replicas" in p and "integer" in p for p in _problems(wrong))


def _container(pod_spec: dict) -> dict:
    (container,) = pod_spec["containers"]
    return container


def _tls_paths(pod_spec: dict) -> dict[str, str]:
    """The certificate files a container names, checked to come from the cluster's TLS Secret."""
    container = _container(pod_spec)
    args = container["args"]
    (mount,) = container["volumeMounts"]
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "tensortune-dask-tls" and mount["readOnly"]
    paths = {flag: args[args.index(flag) + 1] for flag in ("--tls-ca-file", "--tls-cert", "--tls-key")}
    assert all(p.startswith(mount["mountPath"] + "/") for p in paths.values())
    return paths


def test_kubernetes_workers_follow_the_measure_node_rules():
    specs = _k8s()
    cluster, gpus = specs["DaskCluster"], specs["DaskWorkerGroup"]
    scheduler = cluster["spec"]["scheduler"]
    assert scheduler["spec"]["containers"][0]["args"][:4] == ["dask", "scheduler", "--protocol", "tls"]
    _tls_paths(scheduler["spec"])
    assert scheduler["service"]["type"] == "ClusterIP"
    name = cluster["metadata"]["name"]

    cpu_pod = cluster["spec"]["worker"]["spec"]
    cpu = _container(cpu_pod)
    cores = int(cpu["resources"]["requests"]["cpu"])
    assert cpu["resources"]["limits"]["cpu"] == cpu["resources"]["requests"]["cpu"]
    assert " ".join(cpu_measure_node(cores).args()) in " ".join(cpu["args"])
    (rule,) = cpu_pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    assert rule["labelSelector"]["matchLabels"] == cluster["spec"]["worker"]["metadata"]["labels"]

    gpu = _container(gpus["spec"]["worker"]["spec"])
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert " ".join(gpu_node(1, int(gpu["resources"]["requests"]["cpu"])).args()) in " ".join(gpu["args"])
    for container, pod in ((cpu, cpu_pod), (gpu, gpus["spec"]["worker"]["spec"])):
        _tls_paths(pod)
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["DASK_SCHEDULER_ADDRESS"] == f"tls://{name}-scheduler:8786"
        assert env["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] == "False"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_here(container: dict, certs, replace: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """A container's command and environment for this machine: the Secret's files are `certs`', the
    operator's variables and the given values substituted, the dashboard off."""
    args = [replace.get(a, a).replace("/certs/", f"{certs.folder}/") for a in container["args"]]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    if "--dashboard-address" in args:
        i = args.index("--dashboard-address")
        args[i:i + 2] = ["--no-dashboard"]
    assert args[0] == "dask"
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    return [str(Path(sys.executable).with_name("dask"))] + args[1:], env


def test_the_kubernetes_containers_run_here_as_a_tls_cluster(certs, processes):
    """The scheduler, CPU worker and GPU worker containers' commands, run here with the cluster's
    certificates: the workers join over TLS with their resources; the GPU worker, in a pod the device
    plugin gave one GPU (here: CUDA_VISIBLE_DEVICES=6), sees that GPU."""
    specs = _k8s()
    port = _free_port()
    address = f"tls://127.0.0.1:{port}"
    scheduler = _container(specs["DaskCluster"]["spec"]["scheduler"]["spec"])
    values = {"8786": str(port), "$(DASK_SCHEDULER_ADDRESS)": address}
    args, env = _run_here(scheduler, certs, values)
    processes.start(args + ["--host", "127.0.0.1"], _env(env))
    time.sleep(1.0)
    workers = (("cpu", specs["DaskCluster"]["spec"]["worker"]["spec"], {}),
               ("gpu", specs["DaskWorkerGroup"]["spec"]["worker"]["spec"], {"CUDA_VISIBLE_DEVICES": "6"}))
    for name, pod, extra in workers:
        args, env = _run_here(_container(pod), certs, {**values, "$(DASK_WORKER_NAME)": name})
        processes.start(args, _env({**env, **extra}))
    with connect(address, timeout=60) as client:
        found = {i["name"]: (addr, i["resources"]) for addr, i in _wait_for(client, 2, processes).items()}
        assert found["cpu"][1] == {CPU_RESOURCE: 1.0} and found["gpu"][1][GPU_RESOURCE] == 1.0
        seen = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"), workers=[found["gpu"][0]])
        assert list(seen.values()) == ["6"]
        profiling = client.run(lambda: dask.config.get("distributed.worker.profile.enabled"))
        assert set(profiling.values()) == {False}


# ------------------------------------------------------------------ one worker per GPU

def test_visible_gpus_reads_the_allocation():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0, 1,,3"}) == ["0", "1", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8a1f,GPU-77c2"}) == ["GPU-8a1f", "GPU-77c2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []          # the allocation holds none


def test_gpu_node_worker_options():
    node = gpu_node(4, 32)
    assert node.args() == ["--nworkers", "4", "--nthreads", "8", "--resources", "GPU=1,nvcc=8",
                           "--preload-nanny", GPU_PRELOAD]
    assert node.resource_amounts() == {"GPU": 1.0, "nvcc": 8.0}
    assert cpu_measure_node(16).args() == ["--nworkers", "1", "--nthreads", "16", "--resources", "measure-cpu=1"]
    with pytest.raises(ValueError):
        gpu_node(0, 8)


def test_a_local_cluster_with_a_gpu_nodes_options_gives_each_worker_its_own_gpu(monkeypatch):
    """A LocalCluster standing in for a 2-GPU node (its worker options from gpu_node): each worker
    process sees one GPU of the node's two; closing the cluster frees them for the next."""
    from distributed import Client, LocalCluster
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,7")
    node = gpu_node(2, 2)
    for _ in range(2):
        with LocalCluster(n_workers=node.nworkers, threads_per_worker=node.nthreads, processes=True,
                          resources=node.resource_amounts(), preload_nanny=list(node.preload_nanny),
                          dashboard_address="127.0.0.1:0", host="127.0.0.1") as cluster, Client(cluster) as client:
            seen = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
            assert sorted(seen.values()) == ["2", "7"]
            assert len(workers_with(client, GPU_RESOURCE)) == 2
        assert dask_cluster._GPU_HELD == {}


def test_more_gpu_workers_than_gpus_is_an_error(monkeypatch):
    from distributed import Nanny
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    nannies = [Nanny("tcp://127.0.0.1:1", name=f"gpu-{i}") for i in range(3)]
    try:
        dask_cluster.dask_setup(nannies[0])
        dask_cluster.dask_setup(nannies[1])
        assert [n.env["CUDA_VISIBLE_DEVICES"] for n in nannies[:2]] == ["0", "1"]
        with pytest.raises(ClusterError, match=r"no GPU left for worker 'gpu-2'.*--nworkers 2"):
            dask_cluster.dask_setup(nannies[2])
        dask_cluster.dask_teardown(nannies[0])                  # a worker gone: its GPU is free again
        dask_cluster.dask_setup(nannies[2])
        assert nannies[2].env["CUDA_VISIBLE_DEVICES"] == "0"
    finally:
        for n in nannies:
            dask_cluster.dask_teardown(n)
