"""What a tuning run shows in the Prefect UI: a progress bar, the per-task table, the network estimate,
and the network built from the run's records with its measured latency beside the estimate.

Artifact keys are stable per network and target (`tune-resnet-18-llvm-progress`, ...), so the Artifacts
page keeps one series per network across nightly runs, each version linked to its flow run.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Any, Sequence, cast
from uuid import UUID

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tensortune.flows.tuned_network import GAP_WARNING, StoredLibrary, TunedNetworkTiming


def network_label(network: str) -> str:
    """A network as people name it: a built-in name, or an ONNX file's name without folder and suffix."""
    return re.sub(r"\.onnx$", "", network.rsplit("/", 1)[-1])


def artifact_key(network: str, target: str, kind: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) naming network, target kind and kind."""
    base = network_label(network).lower()
    slug = re.sub(r"[^a-z0-9]+", "-", f"tune-{base}-{target.split()[0].lower()}-{kind}").strip("-")
    return re.sub(r"-+", "-", slug)


@dataclass
class TaskRow:
    """One task's line in the per-task table."""
    index: int
    name: str
    weight: int
    flops: float
    best_latency: float          # seconds; inf when nothing ran
    trials_run: int              # measured by this run
    trials_total: int            # in the history, this run included
    default_latency: float = math.nan   # the runtime's default schedule, when measured
    # the cost model's held-out pairwise accuracy and recall@10 (the flow's model's k) on the task's
    # programs measured since the training before: the programs the search picked by that model (at the
    # first training, with no model before it, a random fifth of the task's programs held out)
    model_accuracy: float = math.nan
    model_recall: float = math.nan

    def as_dict(self) -> dict[str, Any]:
        ok = math.isfinite(self.best_latency) and self.best_latency > 0
        return {"#": self.index, "task": self.name, "weight": self.weight, "MFLOP": round(self.flops / 1e6, 3),
                "best latency (ms)": _num(self.best_latency * 1e3 if ok else math.nan, 4),
                "GFLOP/s": _num(self.flops / self.best_latency / 1e9 if ok else math.nan, 2),
                "speedup vs default": _num(self.default_latency / self.best_latency if ok else math.nan, 2),
                "trials (this run)": self.trials_run, "trials (total)": self.trials_total,
                "model accuracy (latest)": _num(self.model_accuracy, 3),
                "model recall@10 (latest)": _num(self.model_recall, 3)}


@dataclass
class RoundTiming:
    """Where one round's wall time went (a line of the round timeline): the policy's search, the builds
    and timings on the cluster (the measurer's own split; NaN for a measurer that keeps none), storing
    the records and teaching policy and scheduler, and the retrain step that followed it, if any."""
    round: int
    task: str
    programs: int
    search_s: float
    build_s: float
    timing_s: float
    learn_s: float
    retrain_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"round": self.round, "task": self.task, "programs": self.programs,
                "search s": _num(self.search_s, 3), "build s": _num(self.build_s, 3),
                "timing s": _num(self.timing_s, 3), "record+learn s": _num(self.learn_s, 3),
                "retrain s": _num(self.retrain_s, 3)}


def round_medians(rounds: Sequence[RoundTiming]) -> dict[str, float | None]:
    """The median seconds per round of each part (issue 19's bar: search <= 2 s per round of 64)."""
    out: dict[str, float | None] = {}
    for part in ("search_s", "build_s", "timing_s", "learn_s", "retrain_s"):
        values = [v for r in rounds if math.isfinite(v := getattr(r, part))]
        out[part] = statistics.median(values) if values else None
    return out


def _num(x: float, digits: int) -> float | None:
    return round(float(x), digits) if math.isfinite(x) else None       # JSON has no NaN


def estimate(weights: Sequence[int], latencies: Sequence[float], form_sets: Sequence[Sequence[int]] = ()) -> float:
    """The network's estimated latency (seconds): sum of weight x task latency; NaN when a task has none.
    Of each set of alternative forms of one group (NetworkTasks.form_sets) only the fastest counts, and
    a form without a latency is no gap while another form has one."""
    lat = [c if math.isfinite(c) and c > 0 else math.nan for c in latencies]
    for forms in form_sets:
        known = [lat[j] for j in forms if math.isfinite(lat[j])]
        for j in forms:
            lat[j] = 0.0
        lat[forms[0]] = min(known) if known else math.nan
    if any(not math.isfinite(c) for c in lat):
        return math.nan
    return float(sum(w * c for w, c in zip(weights, lat)))


def _id(created: Any) -> UUID:
    """The id Prefect's create_*_artifact returns (typed as maybe a coroutine: called from sync code, it is not)."""
    return cast(UUID, created)


def create_progress(network: str, target: str, total: int) -> UUID:
    return _id(create_progress_artifact(0.0, key=artifact_key(network, target, "progress"),
                                        description=f"Tuning {network_label(network)} on {target}: 0/{total} trials"))


def update_progress(artifact_id: UUID, done: int, total: int, text: str) -> None:
    update_progress_artifact(artifact_id, min(100.0, 100.0 * done / max(1, total)), description=text)


def publish_task_table(network: str, target: str, rows: Sequence[TaskRow]) -> UUID:
    return _id(create_table_artifact([r.as_dict() for r in rows], key=artifact_key(network, target, "tasks"),
                                     description=f"Best program per task of {network_label(network)} on {target}"))


def publish_round_timeline(network: str, target: str, rounds: Sequence[RoundTiming]) -> UUID:
    return _id(create_table_artifact([r.as_dict() for r in rounds], key=artifact_key(network, target, "rounds"),
                                     description=f"Where each round of tuning {network_label(network)} on {target} "
                                                 "spent its time: search, builds, timings, records, retraining"))


def publish_estimate(network: str, target: str, rows: Sequence[TaskRow], before: Sequence[float],
                     records_url: str, model_version: str, form_sets: Sequence[Sequence[int]] = ()) -> UUID:
    """Markdown: estimated end-to-end latency with default schedules, at the start of the run, after it."""
    weights = [r.weight for r in rows]
    default = estimate(weights, [r.default_latency for r in rows], form_sets)
    start = estimate(weights, before, form_sets)
    after = estimate(weights, [r.best_latency for r in rows], form_sets)

    def ms(x: float) -> str:
        return f"{x * 1e3:.4f} ms" if math.isfinite(x) else "n/a (a task has no valid program)"

    def speedup(x: float) -> str:
        return f"{x / after:.2f}x" if math.isfinite(x) and math.isfinite(after) else "-"

    name = network_label(network)
    lines = [f"## {name} on `{target}`: estimated end-to-end latency",
             "", "Sum over tasks of weight x best measured latency of the task's kernel.", "",
             "| | estimated latency | speedup of the result |", "|---|---|---|",
             f"| runtime default schedules | {ms(default)} | {speedup(default)} |",
             f"| start of this run (stored best) | {ms(start)} | {speedup(start)} |",
             f"| **after this run** | **{ms(after)}** | |", "",
             f"Records: `{records_url}`; cost model: `{model_version or 'random (not trained yet)'}`."]
    return _id(create_markdown_artifact("\n".join(lines), key=artifact_key(network, target, "estimate"),
                                        description=f"{name} on {target}: estimated latency before and after"))


def publish_network_timing(network: str, target: str, timing: TunedNetworkTiming) -> UUID:
    """Markdown: the network built from the run's best records, estimated beside measured latency, the
    check against the NumPy reference, and a warning when the two latencies are far apart."""
    def ms(x: float) -> str:
        return f"{x * 1e3:.3f} ms" if math.isfinite(x) else "n/a"

    name = network_label(network)
    lines = [f"## {name} on `{timing.target}`: the tuned network, built and timed", "",
             "| estimated (sum of task bests) | measured end to end | gap | tasks from records | check |",
             "|---|---|---|---|---|",
             f"| {ms(timing.estimate_s)} | **{ms(timing.measured_s)}** (median of {timing.runs}) | "
             f"{timing.gap:+.0%} | {timing.tuned}/{len(timing.tasks)} | {timing.check} |".replace("+nan%", "n/a"),
             "", f"Timed on `{timing.host}`."]
    if timing.gap_too_large:
        lines += ["", f"**Warning:** measured and estimated latency differ by {timing.gap:+.0%} (more than "
                      f"{GAP_WARNING:.0%}): the kernels run differently inside the network than when tuned "
                      "alone (cold weights, caches), or the network is not timed in the tuned configuration."]
    if not timing.passed:
        lines += ["", "**The network's outputs do not match the NumPy reference.**"]
    lines += ["", "| task | weight | estimated ms (weight x best) | in the network ms | schedule |",
              "|---|---|---|---|---|"]
    lines += [f"| {t.name} | {t.weight} | {ms(t.weight * t.estimate_s)} | {ms(t.measured_s)} | {t.source} |"
              for t in timing.tasks]
    return _id(create_markdown_artifact("\n".join(lines), key=artifact_key(network, target, "network"),
                                        description=f"{name} on {target}: estimated and measured latency"))


def publish_library(network: str, target: str, library: StoredLibrary) -> UUID:
    """A link to the folder of the network library compiled from the run's records."""
    link = library.folder if "://" in library.folder else "file://" + library.folder
    return _id(create_link_artifact(link, link_text=f"{network_label(network)} library ({library.tuned}/"
                                    f"{library.kernels} kernels tuned)", key=artifact_key(network, target, "library"),
                                    description=library.line()))
