"""The target is the measuring machines', not the flow's.

A bare `llvm` means "this CPU, all its cores" where it is parsed. The flow process (a Prefect worker) is
often not a measure node, so parsed there it named the wrong CPU, vector width or core count for every
kernel the measure nodes compile and time. Here each CPU measure worker says which target it is
(`worker_target`: its host's CPU and the cores its process may use, or what its operator set in
TENSORTUNE_MEASURE_TARGET), and the flow tunes for that:

- a target without `-mcpu` takes the measure nodes' CPU and thread count, which must all agree; nodes
  that differ are an error listing each node's target and asking for an explicit one;
- a target with `-mcpu` is timed only on the nodes of that CPU (an error when there is none).

CUDA targets name their architecture explicitly and go to GPU workers as before.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from distributed import Client

from tensortune.codegen.target import Target, parse_target
from tensortune.flows.dask_cluster import CPU_RESOURCE, ClusterError, workers_with

TARGET_ENV = "TENSORTUNE_MEASURE_TARGET"     # set on a measure node to state its target instead of detecting it


def worker_target() -> str:
    """Runs on a measure worker: the target it compiles and times for, with its CPU's features (the
    flow's search sizes vectors by them; records name the CPU and threads only)."""
    return _with_features(parse_target(os.environ.get(TARGET_ENV) or "llvm"))


def _with_features(t: Target, threads: int | None = None) -> str:
    features = f" -mattr={t.features}" if t.features else ""
    return f"llvm -mcpu={t.cpu}{features} -num-threads={threads or t.num_threads}"


@dataclass(frozen=True)
class MeasureTarget:
    """The target to tune for and the measure workers that may time it (empty: any with the resource)."""
    target: str
    workers: tuple[str, ...] = ()


def measure_node_targets(client: Client) -> dict[str, str]:
    """worker address -> the target it reports, for every CPU measure worker."""
    workers = workers_with(client, CPU_RESOURCE)
    if not workers:
        return {}
    return dict(client.run(worker_target, workers=workers))


def _explicit(text: str, option: str) -> bool:
    return any(part.startswith(option) for part in text.split())


def resolve_measure_target(target: str, nodes: dict[str, str]) -> MeasureTarget:
    """The target for `target` as the flow was given it, on the measure nodes `nodes` (address ->
    target); see the module docstring for the rules."""
    given = parse_target(target)
    if given.kind != "llvm" or not nodes:
        return MeasureTarget(str(given))
    parsed = {addr: parse_target(t) for addr, t in nodes.items()}
    listing = "; ".join(f"{addr}: {t}" for addr, t in sorted(nodes.items()))
    if _explicit(target, "-mcpu="):
        eligible = tuple(sorted(a for a, t in parsed.items() if t.cpu == given.cpu))
        if not eligible:
            raise ClusterError(f"no measure worker has the CPU of target {given} (the measure workers: {listing})")
        return MeasureTarget(str(given), eligible)
    kinds = {(t.cpu, t.num_threads) for t in parsed.values()}
    if len(kinds) > 1:
        raise ClusterError(f"the measure workers are different machines ({listing}); name the one to tune for "
                           "with an explicit target, e.g. --target 'llvm -mcpu=CPU -num-threads=N'")
    node = next(iter(parsed.values()))
    threads = given.num_threads if _explicit(target, "-num-threads=") or _explicit(target, "-num-cores=") else None
    return MeasureTarget(_with_features(node, threads), tuple(sorted(parsed)))
