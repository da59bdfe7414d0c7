"""`python -m bench tune --target cuda`: tuned CUDA kernels against PyTorch (cuBLAS / cuDNN) on one GPU.

Tunes matmul 4096^3 and every distinct conv2d layer of ResNet-50 (batch 1, NCHW, fp32), re-times the
best program of each (CUDA events, TVM's protocol, median of 5 repeats of at least 200 ms), checks
it against PyTorch on the CPU, and times the same computation in PyTorch on the same GPU with TF32
off (plain fp32, as the tuned kernels compute), replayed from a CUDA graph (the library's kernels
alone) and called eagerly (with PyTorch's per-call dispatch). The tuned kernels are built and timed in worker
processes (pycuda); PyTorch runs in this one, so the two never share a CUDA context.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

from bench.common import print_table

MATMUL = ("matmul", (4096, 4096, 4096))


def resnet50_convs() -> list[tuple[tuple, int]]:
    """((N, H, W, CI, CO, KH, KW, stride, pad), how many layers have it) for ResNet-50's convs."""
    from tasks.models import make_network
    g = make_network("resnet-50")
    seen: dict[tuple, int] = {}
    for n in g.nodes:
        if n.op != "conv2d":
            continue
        N, C, H, W = g.values[n.inputs[0]].shape
        CO, _, KH, KW = g.values[n.inputs[1]].shape
        key = (N, H, W, C, CO, KH, KW, n.attrs["strides"][0], n.attrs["pads"][0])
        seen[key] = seen.get(key, 0) + 1
    return list(seen.items())


def workloads(spec: str) -> list[dict]:
    """'matmul', 'resnet50' (all convs), 'r50:i' or 'r50:i-j' (by index), comma-separated."""
    convs = resnet50_convs()
    out = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part == "matmul":
            out.append({"label": "matmul 4096^3", "workload": MATMUL[0], "args": MATMUL[1], "count": 1})
            continue
        if part == "resnet50":
            lo, hi = 0, len(convs) - 1
        elif part.startswith("r50:"):
            rng = part[4:].split("-")
            lo, hi = int(rng[0]), int(rng[-1])
        else:
            raise SystemExit(f"unknown workload {part!r}; use matmul, resnet50 or r50:i[-j]")
        for i in range(lo, hi + 1):
            (n, h, w, ci, co, kh, kw, s, p), count = convs[i]
            out.append({"label": f"r50.{i} {ci}x{h}x{w}->{co} k{kh} s{s}", "workload": "conv2d",
                        "args": (n, h, w, ci, co, kh, kw, s, p), "count": count})
    return out


# ------------------------------------------------------------------------------ worker side (pycuda)

def verify_job(payload: tuple) -> tuple[float, str]:
    """(task_json, artifact, conv (stride, pad) or None) -> (median seconds, mismatch or ''): runs
    in a worker process.

    The reference is PyTorch on the CPU in fp32 (the float64 NumPy reference of a 4096^3 matmul
    would take minutes)."""
    import numpy as np
    import torch

    from codegen.cuda_backend import CUDAKernel
    from tasks.reference import mismatch
    from tasks.search_task import SearchTask
    task_json, artifact, conv = payload
    task = SearchTask.from_json(task_json)
    dag = task.dag
    inputs = dag.random_inputs(seed=99)
    outs = [np.full(t.shape, np.nan, dtype=t.dtype) for t in dag.outputs]
    kernel = CUDAKernel(artifact)
    kernel(*inputs, *outs)
    a, b = (torch.from_numpy(x) for x in inputs)
    if conv is None:
        ref = (a @ b).numpy()
    else:
        ref = torch.nn.functional.conv2d(a, b, stride=conv[0], padding=conv[1]).numpy()
    bad = mismatch(outs[0], ref.astype(np.float64))
    dev = kernel.device_args(list(inputs) + outs)
    costs = kernel.time(dev, number=3, repeat=5, min_repeat_ms=200, warmup=3)
    return statistics.median(costs), bad or ""


# ------------------------------------------------------------------------------ PyTorch side

def torch_ms(item: dict) -> tuple[float, float]:
    """(graph ms, eager ms): median time of the same computation in PyTorch on the GPU (TF32 off),
    by CUDA events. Eager calls pay PyTorch's per-call dispatch (about 20 us), which is longer than a
    small conv: the graph replay of many calls measures the library's kernels alone."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    if item["workload"] == "matmul":
        n, m, k = item["args"]
        a, b = torch.randn(n, k, device=dev), torch.randn(k, m, device=dev)
        fn = lambda: torch.matmul(a, b)  # noqa: E731
    else:
        n, h, w, ci, co, kh, kw, s, p = item["args"]
        x, wt = torch.randn(n, ci, h, w, device=dev), torch.randn(co, ci, kh, kw, device=dev)
        fn = lambda: torch.nn.functional.conv2d(x, wt, stride=s, padding=p)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(5):
            out = fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(call, number: int) -> float:
        start.record()
        for _ in range(number):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / number

    per = timed(fn, 3)
    eager = statistics.median(timed(fn, max(3, int(200 / max(per, 1e-3)))) for _ in range(5))
    calls = int(min(max(3, 50 / max(per, 1e-3)), 2000, max(3, (2 << 30) // max(1, out.numel() * 4))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    replays = max(1, int(200 / max(timed(graph.replay, 1), 1e-3)))
    graphed = statistics.median(timed(graph.replay, replays) for _ in range(5)) / calls
    del graph
    torch.cuda.empty_cache()
    return graphed, eager


def gpu_name() -> str:
    try:
        import torch
        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        return "unknown GPU"


# ------------------------------------------------------------------------------ driver

def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench tune --target cuda")
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--trials", type=int, default=64, help="measured programs per task")
    ap.add_argument("--workloads", default="matmul,resnet50", help="matmul, resnet50, r50:i[-j] (comma-separated)")
    ap.add_argument("--per-round", type=int, default=64)
    ap.add_argument("--model", default="xgb")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-gflop", type=float, default=1000.0,
                    help="check candidates against the NumPy reference while tuning tasks up to this size")
    ap.add_argument("--run-timeout", type=float, default=10.0, help="seconds per candidate's check and timing")
    ap.add_argument("--json", help="write one JSON object per row to this file (rewritten after each task)")
    ap.add_argument("--torch-only", action="store_true", help="only time PyTorch on the workloads")
    args, _ = ap.parse_known_args(argv)
    if args.torch_only:
        rows = []
        for item in workloads(args.workloads):
            tms, eager = torch_ms(item)
            rows.append({"date": datetime.date.today().isoformat(), "gpu": gpu_name(), "task": item["label"],
                         "layers": item["count"], "torch_ms": tms, "torch_eager_ms": eager})
            print(f"  {item['label']}: torch {tms:.4f} ms (eager {eager:.4f})", flush=True)
        _write(args.json, rows)
        return 0

    from codegen.cuda_backend import device_target
    from codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
    from codegen.timing import TimingConfig
    from codegen.target import make_task
    from codegen.worker_pool import WorkerPool
    from flows.tuning import tune_task
    from search.sketch_policy import SearchParams
    from tasks.workload_registry import make_dag

    target = device_target() if args.target.strip() == "cuda" else args.target
    items = workloads(args.workloads)
    name = gpu_name()
    date = datetime.date.today().isoformat()
    print(f"{date} on {name}; target '{target}'; {args.trials} trials per task; {len(items)} tasks", flush=True)
    measurer = ProgramMeasurer(LocalBuilder(n_parallel=os.cpu_count(), timeout=60),
                               LocalRunner(timeout=args.run_timeout, config=TimingConfig(min_repeat_ms=50)))
    verifier = WorkerPool("bench.tune_cuda:verify_job", 1, timeout=600)
    rows = []
    try:
        for item in items:
            task = make_task(make_dag(item["workload"], *item["args"]), target, name=item["label"])
            measurer.runner.config = TimingConfig(min_repeat_ms=50, check_correctness=task.flops / 1e9 <= args.check_gflop)
            t0 = time.perf_counter()
            res = tune_task(task, args.trials, measurer=measurer, model=args.model, seed=args.seed,
                            params=SearchParams(num_measures_per_round=args.per_round),
                            progress=lambda log, r: print(
                                f"    round {log.round}: {log.trials} trials, best {log.best_gflops:.0f} GFLOP/s, "
                                f"{log.errors} errors; search {log.search_s + log.train_s:.1f} s, measure "
                                f"{log.measure_s:.1f} s", flush=True))
            wall = time.perf_counter() - t0
            row = {"date": date, "gpu": name, "task": item["label"], "layers": item["count"],
                   "trials": res.trials, "gflop": task.flops / 1e9, "tune_s": wall,
                   "errors": sum(r.errors for r in res.rounds)}
            ms, bad = float("nan"), "no valid program"
            if res.best_steps:
                (b,) = measurer.builder.build(task, [res.best_steps])
                if b.artifact is not None:
                    conv = None if item["workload"] == "matmul" else item["args"][7:9]
                    (r,) = verifier.map([(task.to_json(), b.artifact, conv)])
                    ms, bad = (r.value[0] * 1e3, r.value[1]) if r.ok else (float("nan"), r.error.splitlines()[0])
            tms, eager = torch_ms(item)
            row.update({"tuned_ms": ms, "torch_ms": tms, "torch_eager_ms": eager, "tuned_tflops": task.flops / ms / 1e9,
                        "torch_tflops": task.flops / tms / 1e9, "tuned/torch": tms / ms, "verified": not bad,
                        "note": bad[:120]})
            rows.append(row)
            print(f"  {item['label']}: tuned {ms:.4f} ms, torch {tms:.4f} ms (eager {eager:.4f}), {res.trials} trials, "
                  f"{wall:.0f} s{'' if not bad else ' MISMATCH ' + bad[:80]}", flush=True)
            _write(args.json, rows)
    finally:
        measurer.close()
        verifier.close()
    convs = [r for r in rows if r["task"].startswith("r50.")]
    if convs:
        tot = {"date": date, "gpu": name, "task": "ResNet-50 convs (x layers)", "layers": sum(r["layers"] for r in convs),
               "trials": sum(r["trials"] for r in convs),
               "tuned_ms": sum(r["tuned_ms"] * r["layers"] for r in convs),
               "torch_ms": sum(r["torch_ms"] * r["layers"] for r in convs),
               "torch_eager_ms": sum(r["torch_eager_ms"] * r["layers"] for r in convs)}
        tot["tuned/torch"] = tot["torch_ms"] / tot["tuned_ms"]
        rows.append(tot)
    print_table(rows, ["task", "layers", "trials", "tuned_ms", "tuned_tflops", "torch_ms", "torch_eager_ms",
                       "torch_tflops", "tuned/torch", "verified"])
    _write(args.json, rows)
    return 0


def _write(path: str | None, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
