"""SearchTask: one tuning task — a DAG, the target it is tuned for, and that target's limits.

A task crosses process and node boundaries as plain JSON (`to_json`), so workers rebuild the DAG
instead of unpickling objects.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from tensortune.tasks.compute_dag import ComputeDAG


@dataclass(frozen=True)
class HardwareParams:
    """TVM's HardwareParams: the limits the search space respects."""
    num_cores: int = 1
    vector_unit_bytes: int = 64
    cache_line_bytes: int = 64
    max_shared_memory_per_block: int = 0
    max_local_memory_per_block: int = 0
    max_threads_per_block: int = 0
    max_vthread_extent: int = 0
    warp_size: int = 0


@dataclass
class SearchTask:
    dag: ComputeDAG
    target: str                         # "llvm -mcpu=znver4", "cuda -arch=sm_90"
    hardware: HardwareParams = field(default_factory=HardwareParams)
    name: str = ""
    weight: int = 1
    # Inputs that are constant weights the task's kernel may take in the layout its schedule reads them
    # in (schedule.layout_rewrite), rewritten once at network build time; network extraction names them,
    # a stand-alone workload has none and keeps its plain layouts. Measuring such a task times the
    # rewritten kernel, as the network runs it.
    layout_rewrite: tuple[str, ...] = ()

    @property
    def workload_key(self) -> str:
        return self.dag.workload_key

    @property
    def label(self) -> str:
        """What a person reads in the history: the op name and its shapes (the workload key is a hash)."""
        return f"{self.name or self.dag.name} {self.dag.shape_signature}".strip()

    @property
    def target_kind(self) -> str:
        return self.target.split()[0]

    @property
    def flops(self) -> float:
        return self.dag.flop_ct

    def to_json(self) -> str:
        d = {"dag": self.dag.to_json(), "target": self.target, "hardware": asdict(self.hardware),
             "name": self.name, "weight": self.weight}
        if self.layout_rewrite:
            d["layout_rewrite"] = list(self.layout_rewrite)
        return json.dumps(d, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "SearchTask":
        d = json.loads(text)
        return SearchTask(ComputeDAG.from_json(d["dag"]), d["target"], HardwareParams(**d["hardware"]),
                          d.get("name", ""), d.get("weight", 1), tuple(d.get("layout_rewrite", ())))

    def __repr__(self) -> str:
        return f"SearchTask({self.name or self.dag.name}, {self.target}, key={self.workload_key})"
