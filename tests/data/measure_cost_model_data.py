"""Regenerate cost_model_matmul.json.gz, the measured programs tests/test_cost_model.py learns from.

    python tests/data/measure_cost_model_data.py          # from the repository root, a few minutes

192 random programs of a 128x128x128 matmul from the sketch policy (seed 3), built and timed once by the
library's measurer with one thread per kernel (compiled into the target: the ranking signal is the same
and the timings shift less on a busy machine). The file keeps each program's steps, its timings (or
its error), how they were taken, and on what machine and when. The tests are deterministic on it;
after re-measuring, update the accuracy the test's comment reports.
"""
from __future__ import annotations

import gzip
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

PATH = Path(__file__).with_name("cost_model_matmul.json.gz")
WORKLOAD, ARGS, TARGET, SEED, N = "matmul", [128, 128, 128], "llvm -num-threads=1", 3, 192
TIMING = {"min_repeat_ms": 10, "repeat": 3}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    import llvmlite
    import numpy as np

    from tensortune.codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
    from tensortune.codegen.target import make_task
    from tensortune.codegen.timing import TimingConfig
    from tensortune.search.sketch_policy import SketchPolicy
    from tensortune.tasks.workload_registry import make_dag
    task = make_task(make_dag(WORKLOAD, *ARGS), TARGET)
    cands = SketchPolicy(task, seed=SEED).sample(N)
    with ProgramMeasurer(LocalBuilder(), LocalRunner(config=TimingConfig(**TIMING))) as m:
        results = m.measure(task, [c.steps_json for c in cands])
    data = {
        "workload": WORKLOAD, "args": ARGS, "target": TARGET, "resolved_target": task.target,
        "sample_seed": SEED, "timing": TIMING,
        "measured": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": _cpu(),
                     "python": sys.version.split()[0], "numpy": np.__version__, "llvmlite": llvmlite.__version__},
        "programs": [{"steps": c.steps_json, "costs": list(r.costs) if r.ok else None, "error_code": int(r.error_code)}
                     for c, r in zip(cands, results)],
    }
    with gzip.open(PATH, "wt", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"))
    ok = sum(p["costs"] is not None for p in data["programs"])
    print(f"{PATH}: {len(cands)} programs, {ok} timed, {PATH.stat().st_size} bytes")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
