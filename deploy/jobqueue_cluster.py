"""tensortune's Dask cluster on a SLURM or PBS system (dask-jobqueue), kept running for the flow.

    python deploy/jobqueue_cluster.py slurm --jobs 4                    # 4 CPU measure nodes
    python deploy/jobqueue_cluster.py pbs --jobs 2 --gpus-per-node 4    # 2 GPU nodes, a worker per GPU
    python deploy/jobqueue_cluster.py slurm --job-script                # print the job script, submit nothing

The scheduler runs in this process, on the login node where the batch commands work; each batch job is
one node whose workers join it. deploy/jobqueue.yaml holds the node's site settings (cores, memory,
walltime, queue, the node to itself); what makes a job a measure node comes from flows/dask_cluster.py
(`cpu_measure_node`, `gpu_node`), as for every other way of starting workers. The scheduler and the
workers speak TLS with the certificates in $TENSORTUNE_TLS_DIR (a scheduler on the cluster's network
without it would run anyone's code on the nodes), named in the job script, so they must be on a
filesystem the nodes share. Point the flow at the printed address; Ctrl-C cancels the jobs and stops
the scheduler.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import dask
import yaml

from tensortune.flows.cluster_security import TLS_DIR_ENV, ClusterCertificates
from tensortune.flows.dask_cluster import CLUSTER_ENV, NodeWorkers, cpu_measure_node, gpu_node

SPEC = Path(__file__).with_name("jobqueue.yaml")
SYSTEMS = ("slurm", "pbs")


def load_spec(path: Path = SPEC) -> None:
    """The spec file over dask-jobqueue's defaults (importing dask_jobqueue registers those first)."""
    import dask_jobqueue  # noqa: F401
    dask.config.update(dask.config.config, yaml.safe_load(path.read_text()), priority="new")


def node_workers(system: str, gpus_per_node: int) -> NodeWorkers:
    cores = int(dask.config.get(f"jobqueue.{system}.cores"))
    return gpu_node(gpus_per_node, cores) if gpus_per_node else cpu_measure_node(cores)


def job_options(system: str, gpus_per_node: int) -> dict[str, Any]:
    """The jobqueue keyword arguments that make a job a measure node (over the spec's site settings)."""
    node = node_workers(system, gpus_per_node)
    key = f"jobqueue.{system}"
    options: dict[str, Any] = {
        "processes": node.nworkers,                          # jobqueue writes --nworkers and --nthreads
        "worker_extra_args": list(dask.config.get(f"{key}.worker-extra-args") or []) + node.extra_args(),
    }
    if gpus_per_node and system == "slurm":
        options["job_extra_directives"] = (list(dask.config.get(f"{key}.job-extra-directives") or [])
                                           + [f"--gres=gpu:{gpus_per_node}"])
    elif gpus_per_node:
        from dask.utils import parse_bytes
        from dask_jobqueue.pbs import pbs_format_bytes_ceil
        spec = dask.config.get(f"{key}.resource-spec") or (
            f"select=1:ncpus={dask.config.get(f'{key}.cores')}"
            f":mem={pbs_format_bytes_ceil(parse_bytes(dask.config.get(f'{key}.memory')))}")
        options["resource_spec"] = f"{spec}:ngpus={gpus_per_node}"
    return options


def make_cluster(system: str, *, gpus_per_node: int = 0, port: int = 8786, tls_dir: str | None = None,
                 dashboard_address: str = "127.0.0.1:8787"):
    """The jobqueue cluster (its scheduler started here, no job submitted yet: `scale(jobs=N)` does)."""
    from dask_jobqueue import PBSCluster, SLURMCluster
    if system not in SYSTEMS:
        raise ValueError(f"unknown batch system {system!r}: choose one of {', '.join(SYSTEMS)}")
    folder = tls_dir or os.environ.get(TLS_DIR_ENV)
    if not folder:
        raise ValueError(f"set {TLS_DIR_ENV} to the folder of the cluster's certificates (`tensortune make-certs "
                         "DIR --host LOGIN_NODE`) on a filesystem the nodes share")
    security = ClusterCertificates(Path(folder).resolve()).security()
    cls = SLURMCluster if system == "slurm" else PBSCluster
    return cls(security=security, protocol="tls://",
               scheduler_options={"port": port, "dashboard_address": dashboard_address},
               **job_options(system, gpus_per_node))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python deploy/jobqueue_cluster.py", description=__doc__.splitlines()[0])
    ap.add_argument("system", choices=SYSTEMS)
    ap.add_argument("--jobs", type=int, default=1, help="nodes to keep (one batch job each)")
    ap.add_argument("--gpus-per-node", type=int, default=0, help="GPU nodes: one worker per GPU (0: CPU nodes)")
    ap.add_argument("--port", type=int, default=8786, help="the scheduler's port")
    ap.add_argument("--spec", default=str(SPEC), help="the jobqueue configuration (default: deploy/jobqueue.yaml)")
    ap.add_argument("--job-script", action="store_true", help="print the job script and exit")
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.gpus_per_node < 0:
        ap.error("--jobs must be at least 1 and --gpus-per-node at least 0")
    try:
        load_spec(Path(args.spec))
        cluster = make_cluster(args.system, gpus_per_node=args.gpus_per_node, port=args.port)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with cluster:
        if args.job_script:
            print(cluster.job_script())
            return 0
        cluster.scale(jobs=args.jobs)
        print(f"scheduler {cluster.scheduler_address}; {args.jobs} job(s) submitted. For the flow:\n"
              f"  export {CLUSTER_ENV}={cluster.scheduler_address} {TLS_DIR_ENV}={os.environ[TLS_DIR_ENV]}",
              flush=True)
        try:
            while True:
                time.sleep(60)
        except KeyboardInterrupt:
            print("stopping: cancelling the jobs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
