"""Synthetic measure records, for the storage tests and benchmark: realistic sizes, reproducible content.

Also `row_multiset`, the exact-content fingerprint the tests use to prove that no row was lost or
duplicated (NaN-safe, order-free).
"""
from __future__ import annotations

import hashlib
import math
from collections import Counter
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pandas as pd

from tensortune.storage.schema import RECORD_COLUMNS, MeasureRecord

NETWORKS = ("resnet-50", "bert-base", "mobilenet-v2")

# About 500 characters, the size of a real Ansor step list for a tiled conv2d.
STEPS_TEMPLATE = (
    '[["CHW",2,"local"],["SP",2,0,%d,[%d,%d,%d],1],["SP",2,4,%d,[%d,%d,%d],1],'
    '["SP",2,8,%d,[%d],1],["RE",2,[0,4,1,5,8,2,6,9,3,7]],["FSP",3,0,1,3],["FSP",3,4,2,3],'
    '["RE",3,[0,4,1,5,2,6,3,7]],["CA",2,3,5],["FU",3,[0,1,2,3]],["AN",3,0,3],'
    '["PR",2,0,"auto_unroll_max_step$%d"],["AN",2,9,2],["AN",3,4,2],["SP",2,12,%d,[%d,%d],1],'
    '["FSP",3,8,13,2],["RE",2,[0,4,1,5,12,8,2,6,9,3,7,13,14]],["CI",1],["CR",2],["AN",2,14,2]]'
)


def workload_key(task: int) -> str:
    """The synthetic workload key of task number `task`."""
    return f'["conv2d_nchw_{task}",1,{64 + task},56,56,64,3,3,1,1]'


def synthetic_batch(rng: np.random.Generator, size: int, *, target: str = "llvm -mcpu=test",
                    tasks: int = 10, flow_run_id: str = "run-0", round: int = 0,
                    timestamp: datetime | None = None, error_rate: float = 0.03,
                    host: str = "synthetic") -> list[MeasureRecord]:
    """`size` records of `tasks` conv2d tasks with random schedules, latencies and a few errors."""
    timestamp = timestamp or datetime.now(timezone.utc)
    task_ids = rng.integers(0, tasks, size)
    ints = rng.integers(1, 64, (size, 12))
    latency = rng.lognormal(-7.0, 0.6, (size, 3))
    errors = np.where(rng.random(size) < error_rate, rng.integers(1, 9, size), 0)
    records = []
    for i in range(size):
        task, failed, n = int(task_ids[i]), int(errors[i]), ints[i]
        steps = STEPS_TEMPLATE % (1024, n[0], n[1], n[2], 512, n[3], n[4], n[5], 64, n[6], n[7] * 8, 256, n[8], n[9])
        records.append(MeasureRecord(
            workload_key=workload_key(task), target=target, steps=steps,
            kernel=hashlib.blake2b(steps.encode(), digest_size=16).hexdigest(),
            flow_run_id=flow_run_id, round=round, timestamp=timestamp,
            task_name=f"conv2d_nchw_{task}", task_label=f"conv2d_nchw_{task} 1x64x56x56, 64x64x3x3 -> 1x64x56x56",
            network=NETWORKS[task % len(NETWORKS)], host=host,
            latencies=[] if failed else latency[i].tolist(),
            mean_latency=math.inf if failed else math.nan,
            error_code=failed, error_msg="synthetic failure" if failed else "",
            build_seconds=0.05, run_seconds=0.01, model_version="v000001-00000000",
            predicted_score=float(n[10]) / 64, flops=2.0 * 56 * 56 * 64 * 64 * 9, num_threads=2))
    return records


def row_multiset(frame: pd.DataFrame) -> Counter:
    """Every row of a records frame as a hashable tuple, counted: equal multisets = same rows."""
    columns = [c for c in RECORD_COLUMNS if c in frame.columns]
    return Counter(tuple(_hashable(v) for v in row)
                   for row in frame[columns].itertuples(index=False, name=None))


def _hashable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(_hashable(float(v)) for v in value)
    if isinstance(value, pd.Timestamp):
        return value.value
    return value
