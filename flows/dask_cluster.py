"""Where the flow's Dask workers come from: an existing cluster by address, or a LocalCluster it starts.

The flow holds a plain `distributed.Client` (Prefect task runs stay in the flow process; see
docs/architecture.md §7). Workers advertise resources: `measure-cpu=1` on CPU measure nodes (one timing
at a time per node) and `GPU=1` on GPU nodes; a task's measurements only go to workers holding its
resource, so a cluster without one is an error named before any work is submitted. CUDA builds need
nvcc, so they go only to workers advertising `nvcc=N` (N builds at once; GPU images have it).

How a node's workers start (deploy/README.md; the jobqueue and Kubernetes specs in deploy/ follow these):
a CPU measure node runs one worker with all its cores (`cpu_measure_node`: two timings on one machine
disturb each other); a GPU node runs one worker per GPU, each seeing only its own GPU through
CUDA_VISIBLE_DEVICES (`gpu_node`). That is one `dask worker --nworkers <GPUs>` with this module as its
nanny preload: before a nanny starts its worker process, `dask_setup` gives that worker one of the
node's GPUs that no other nanny of the process holds.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping

import dask
from distributed import Client, LocalCluster, Nanny

from tensortune.flows.cluster_security import client_security

CLUSTER_ENV = "TENSORTUNE_CLUSTER"          # the address to join when no --cluster is given
CLUSTER_VARIABLE = "tensortune_cluster"     # the same, as a Prefect Variable (for deployments)
CPU_RESOURCE = "measure-cpu"
GPU_RESOURCE = "GPU"
NVCC_RESOURCE = "nvcc"
# Dask's statistical profiler samples every worker thread's stack every 10 ms. A measure node's cores
# belong to the kernel being timed, so its workers run without it (deploy/ sets the same variable).
WORKER_CONFIG = {"distributed.worker.profile.enabled": False}
GPU_PRELOAD = "tensortune.flows.dask_cluster"   # `--preload-nanny` of GPU nodes' workers: one GPU each
CUDA_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


class ClusterError(RuntimeError):
    """The Dask cluster cannot be reached or cannot run what the flow needs."""


def measure_resource(target_kind: str) -> str:
    """The worker resource a task's timings need: GPU nodes for CUDA, CPU measure nodes otherwise."""
    return GPU_RESOURCE if target_kind == "cuda" else CPU_RESOURCE


def build_resource(target_kind: str) -> str | None:
    """The worker resource a task's builds need (None: any worker can build)."""
    return NVCC_RESOURCE if target_kind == "cuda" else None


def local_resources(target_kind: str = "llvm") -> dict[str, float]:
    """What the embedded LocalCluster's worker advertises: this machine is one measure node."""
    res = {CPU_RESOURCE: 1.0}
    if target_kind == "cuda":
        res[GPU_RESOURCE] = 1.0
        res[NVCC_RESOURCE] = float(os.cpu_count() or 1)
    return res


@dataclass(frozen=True)
class NodeWorkers:
    """How one node's Dask workers start: how many, with how many threads and which resources each, and
    the nanny preloads they need. `args()` are the `dask worker` options; `extra_args()` leave out the
    counts, for launchers that write those themselves (dask-jobqueue's `processes` and `cores`)."""
    nworkers: int
    nthreads: int
    resources: str
    preload_nanny: tuple[str, ...] = ()

    def extra_args(self) -> list[str]:
        args = ["--resources", self.resources]
        for module in self.preload_nanny:
            args += ["--preload-nanny", module]
        return args

    def args(self) -> list[str]:
        return ["--nworkers", str(self.nworkers), "--nthreads", str(self.nthreads), *self.extra_args()]

    def resource_amounts(self) -> dict[str, float]:
        """The resources as a LocalCluster takes them ({"GPU": 1.0, "nvcc": 8.0})."""
        return {name: float(amount) for name, amount in (r.split("=") for r in self.resources.split(","))}


def cpu_measure_node(cores: int) -> NodeWorkers:
    """A CPU measure node: one worker (two timings on one machine disturb each other), all cores for
    builds, one timing at a time."""
    return NodeWorkers(1, max(1, cores), f"{CPU_RESOURCE}=1")


def gpu_node(gpus: int, cores: int) -> NodeWorkers:
    """A node with `gpus` GPUs: one worker per GPU (GPU=1: one timing at a time on it), the cores shared
    out for builds (nvcc=N: N CUDA builds at once each), and the nanny preload that gives each worker
    its own GPU (`dask_setup`)."""
    if gpus < 1:
        raise ValueError(f"a GPU node needs at least one GPU, got {gpus}")
    share = max(1, cores // gpus)
    return NodeWorkers(gpus, share, f"{GPU_RESOURCE}=1,{NVCC_RESOURCE}={share}", (GPU_PRELOAD,))


def visible_gpus(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs this node gives its workers: CUDA_VISIBLE_DEVICES where it is set (a batch system's
    allocation, or the operator's choice), else every GPU `nvidia-smi -L` lists, else none."""
    given = environ.get(CUDA_DEVICES_ENV)
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, _ in enumerate(row for row in out.splitlines() if row.startswith("GPU "))]


_GPU_HELD: dict[int, str] = {}          # id(nanny) -> the GPU its worker was given, in this process


def dask_setup(nanny: Nanny) -> None:
    """Nanny preload (`dask worker ... --nworkers <GPUs> --preload-nanny tensortune.flows.dask_cluster`):
    the worker this nanny is about to start sees one GPU of the node, the first that no other nanny of
    this process holds. The nannies of one `dask worker` command start in one process, so N workers get
    N different GPUs; the worker a nanny restarts keeps its GPU. More workers than GPUs is an error."""
    if not isinstance(nanny, Nanny):
        raise ClusterError(f"{GPU_PRELOAD} gives each worker a GPU before its process starts: pass it as "
                           f"--preload-nanny, not --preload")
    gpus = visible_gpus()
    held = set(_GPU_HELD.values())
    free = [g for g in gpus if g not in held]
    if not free:
        raise ClusterError(f"no GPU left for worker {nanny.name!r}: this node gives {len(gpus)} GPU(s) "
                           f"({', '.join(gpus) or 'none found'}) and its other workers hold {len(held)}; start one "
                           f"worker per GPU (`--nworkers {len(gpus)}`)")
    _GPU_HELD[id(nanny)] = free[0]
    nanny.env[CUDA_DEVICES_ENV] = free[0]


def dask_teardown(nanny: Nanny) -> None:
    """The nanny closed: its GPU is free for another."""
    _GPU_HELD.pop(id(nanny), None)


def resolve_address(address: str | None) -> str | None:
    """The cluster to join: the argument, else $TENSORTUNE_CLUSTER, else None (start a LocalCluster).
    ("local" or "" also mean a LocalCluster.)"""
    address = address if address is not None else os.environ.get(CLUSTER_ENV)
    if not address or address.strip().lower() == "local":
        return None
    return address.strip()


def connect(address: str, timeout: float = 10.0) -> Client:
    """A client of the running cluster at `address`, or a ClusterError saying what to do. A tls://
    address is joined with the certificates in $TENSORTUNE_TLS_DIR (flows/cluster_security.py)."""
    if "://" not in address:
        raise ClusterError(f"cluster address {address!r} has no scheme: write tls://HOST:8786 or tcp://HOST:8786 "
                           "(or leave --cluster out to start a local cluster)")
    try:
        security = client_security(address)
    except (OSError, ValueError) as err:
        raise ClusterError(str(err)) from None
    try:
        return Client(address, timeout=timeout, set_as_default=False, security=security)
    except (OSError, TimeoutError) as err:
        raise ClusterError(
            f"cannot reach the Dask scheduler at {address} within {timeout:.0f} s ({type(err).__name__}: {err}). "
            "Start one (`dask scheduler --port 8786`, workers with `dask worker ADDRESS --resources "
            "measure-cpu=1`; see deploy/README.md), fix the address, or leave --cluster out to start "
            "a local cluster") from None


@contextmanager
def dask_client(address: str | None = None, *, n_workers: int = 1, threads_per_worker: int | None = None,
                resources: dict[str, float] | None = None, processes: bool = True,
                timeout: float = 10.0) -> Iterator[Client]:
    """A client for the flow: joins `address` (left running afterwards) or starts a LocalCluster of
    `n_workers` measure nodes with `resources` (closed afterwards). One worker with one thread per core
    is the default: builds run in parallel, timings one at a time."""
    address = resolve_address(address)
    if address is not None:
        client = connect(address, timeout)
        try:
            yield client
        finally:
            client.close()
        return
    threads = threads_per_worker or max(1, (os.cpu_count() or 1) // max(1, n_workers))
    with dask.config.set(WORKER_CONFIG), _children_ignore_ctrl_c():   # the nannies hand this config on
        cluster = LocalCluster(n_workers=n_workers, threads_per_worker=threads, processes=processes,
                               resources=resources or local_resources(), dashboard_address=None,
                               host="127.0.0.1")
    client = Client(cluster, set_as_default=False)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


@contextmanager
def _children_ignore_ctrl_c() -> Iterator[None]:
    """Processes started inside ignore SIGINT for good (an interpreter started with SIGINT ignored never
    installs its KeyboardInterrupt handler). Ctrl-C reaches a terminal's whole process group; the local
    cluster's worker processes then printed their own KeyboardInterrupt tracebacks while the flow, which
    owns them, was already closing the cluster."""
    if threading.current_thread() is not threading.main_thread():
        yield                                 # only the main thread may change signal handlers
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def cluster_workers(client: Client) -> dict[str, dict]:
    """The workers the scheduler knows now (address -> its identity: host, resources, ...), asked of
    the scheduler itself. Not `client.scheduler_info(n_workers=-1)`: that call updates the client's
    cached identity and then reads the cache, which the client's own 2-second refresh (run on its event
    loop, asking for no workers) may have overwritten in between; it then says the cluster has no
    workers. Under load that happened (a prebuild found no build node beside a running timing)."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def workers_with(client: Client, resource: str) -> list[str]:
    """Addresses of the workers advertising `resource`."""
    workers = cluster_workers(client)
    return [addr for addr, info in workers.items() if info.get("resources", {}).get(resource, 0) > 0]


def require_resource(client: Client, resource: str, wait: float = 0.0) -> None:
    """Fail early, with the fix, when no worker can run timings that need `resource`."""
    import time
    deadline = time.monotonic() + wait
    while not workers_with(client, resource):
        if time.monotonic() >= deadline:
            n = len(cluster_workers(client))
            flag = f"--resources {resource}=" + ("4" if resource == NVCC_RESOURCE else "1")
            where = {GPU_RESOURCE: " on a GPU node", NVCC_RESOURCE: " on a node with the CUDA toolkit"}
            raise ClusterError(
                f"no worker of the Dask cluster at {client.scheduler.address} advertises the resource "
                f"{resource!r} ({n} workers connected), so work that needs it would wait forever. "
                f"Start a worker with `dask worker {client.scheduler.address} {flag}`"
                + where.get(resource, "") + " (see deploy/README.md)")
        time.sleep(0.2)
