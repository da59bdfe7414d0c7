"""`python -m bench tune --target cuda`: tuned CUDA kernels against PyTorch (cuBLAS / cuDNN) on one GPU.

Tunes matmul 4096^3 and every distinct conv2d layer of ResNet-50 (batch 1, NCHW, fp32) -- a 3x3
stride-1 layer also in its Winograd form F(m x m, 3 x 3) when asked (`r50w4:i`, `r50w2:i`: the weight
transformed once beforehand, as a network's constant weight is) -- re-times the best program of each,
checks it against PyTorch on the CPU, and times it against the same computation in PyTorch on the same
GPU with TF32 off (plain fp32, as the tuned kernels compute), replayed from a CUDA graph (the library's
kernels alone) and called eagerly (with PyTorch's per-call dispatch). The three are timed in
alternating pairs (bench.common.compare), each by the same protocol with CUDA events (median of 5
batches of >= 200 ms): PyTorch by bench.common.measure with bench.common.cuda_clock in this process,
the tuned kernel by CUDAKernel.time in a worker process (pycuda), so the two never share a CUDA
context. A row whose output failed its check has no speedup (its kernel is not timed) and is left out
of the ResNet-50 total.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
from typing import Callable

from bench.common import (
    PAIRS,
    Comparison,
    Stopwatch,
    compare,
    cuda_clock,
    environment,
    fmt_ratio,
    measure,
    print_table,
    write_json,
)
from tensortune.search.cost_model import DEFAULT_MODEL, MODEL_OBJECTIVES
from tensortune.tasks import winograd

MATMUL = ("matmul", (4096, 4096, 4096))
GPU_BATCHES, GPU_MIN_BATCH_MS = 5, 200.0      # both sides: median of 5 batches of >= 200 ms


def resnet50_convs() -> list[tuple[tuple, int]]:
    """((N, H, W, CI, CO, KH, KW, stride, pad), how many layers have it) for ResNet-50's convs."""
    from tensortune.tasks.models import make_network
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
    """'matmul', 'resnet50' (all convs), 'r50:i' or 'r50:i-j' (by index), and 'r50w4:i[-j]' /
    'r50w2:i[-j]' (the 3x3 stride-1 layers among them in Winograd form F(4x4) / F(2x2); the others
    in the range are left out), comma-separated. Every conv item keeps the direct conv's arguments
    under "conv": PyTorch runs that conv, and the Winograd kernel is checked against it."""
    convs = resnet50_convs()
    out = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part == "matmul":
            out.append({"label": "matmul 4096^3", "workload": MATMUL[0], "args": MATMUL[1], "count": 1})
            continue
        form = re.fullmatch(r"r50(?:w([24]))?:(\d+)(?:-(\d+))?", part)
        if part == "resnet50":
            lo, hi, m = 0, len(convs) - 1, 0
        elif form:
            lo, hi, m = int(form[2]), int(form[3] or form[2]), int(form[1] or 0)
        else:
            raise SystemExit(f"unknown workload {part!r}; use matmul, resnet50, r50:i[-j] or r50w4:i[-j] / r50w2:i[-j]")
        if not 0 <= lo <= hi < len(convs):
            raise SystemExit(f"{part!r}: ResNet-50 has convs 0-{len(convs) - 1}")
        for i in range(lo, hi + 1):
            conv, count = convs[i]
            n, h, w, ci, co, kh, kw, s, p = conv
            label = f"r50.{i} {ci}x{h}x{w}->{co} k{kh} s{s}"
            if not m:
                out.append({"label": label, "workload": "conv2d", "args": conv, "conv": conv, "count": count})
            elif winograd.eligible((co, ci, kh, kw), s, 1, 1):
                out.append({"label": f"{label} winograd F{m}", "workload": "conv2d_winograd",
                            "args": (n, h, w, ci, co, p, m), "conv": conv, "winograd_m": m, "count": count})
    if not out:
        raise SystemExit(f"no workload in {spec!r} (Winograd forms take only 3x3 stride-1 convs)")
    return out


# ------------------------------------------------------------------------------ worker side (pycuda)

def verify_job(payload: tuple) -> tuple[float, str]:
    """(task_json, artifact, conv (stride, pad, winograd m or 0) or None, check) -> (median seconds or
    NaN, mismatch or ''): runs in a worker process. With `check`, the output is compared with PyTorch on
    the CPU in fp32 (the float64 NumPy reference of a 4096^3 matmul would take minutes) and not timed; a
    Winograd kernel gets U transformed from a random weight and is compared with the direct conv of that
    weight. Without `check`, the kernel is timed (one side of one pair of bench.common.compare)."""
    import numpy as np

    from tensortune.codegen.cuda_backend import CUDAKernel
    from tensortune.tasks.reference import mismatch
    from tensortune.tasks.search_task import SearchTask
    task_json, artifact, conv, check = payload
    task = SearchTask.from_json(task_json)
    dag = task.dag
    inputs, reference = checked_inputs(dag, conv)
    outs = [np.full(t.shape, np.nan, dtype=t.dtype) for t in dag.outputs]
    kernel = CUDAKernel(artifact)
    if check:
        kernel(*inputs, *outs)
        return math.nan, mismatch(outs[0], reference().astype(np.float64)) or ""
    dev = kernel.device_args(list(inputs) + outs)
    # bench.common's protocol, run in this worker: CUDA events, median of batches of >= 200 ms
    costs = kernel.time(dev, number=3, repeat=GPU_BATCHES, min_repeat_ms=GPU_MIN_BATCH_MS, warmup=3)
    return statistics.median(costs), ""


def checked_inputs(dag, conv: tuple | None) -> tuple[list, Callable]:
    """(the kernel's inputs, a function computing the expected output with PyTorch on the CPU in fp32)
    for a matmul (conv None) or a conv (stride, pad, winograd m or 0). A Winograd kernel takes U, made
    here from a random weight, and is expected to compute the direct conv of that weight."""
    import numpy as np
    inputs = dag.random_inputs(seed=99)
    weight = inputs[1]
    if conv is not None and conv[2]:
        co, ci = weight.shape[2:]
        weight = np.random.default_rng(98).uniform(-1.0, 1.0, (co, ci, 3, 3)).astype(np.float32)
        inputs[1] = winograd.transform_weight(weight, conv[2]).astype(np.float32)

    def reference():
        import torch
        a, b = torch.from_numpy(inputs[0]), torch.from_numpy(weight)
        if conv is None:
            return (a @ b).numpy()
        return torch.nn.functional.conv2d(a, b, stride=conv[0], padding=conv[1]).numpy()
    return inputs, reference


def tuned_side(verifier, task, artifact, conv) -> Callable[[], float]:
    """The tuned kernel as a side of bench.common.compare: milliseconds per run, timed in the worker."""
    payload = (task.to_json(), artifact, conv, False)

    def side() -> float:
        (r,) = verifier.map([payload])
        if not r.ok:
            raise RuntimeError(r.error.strip().splitlines()[-1] if r.error.strip() else "worker failed")
        return r.value[0] * 1e3
    return side


# ------------------------------------------------------------------------------ PyTorch side

def torch_sides(item: dict) -> tuple[dict[str, Callable[[], float]], Callable[[], None]]:
    """({"torch": graph replay, "torch_eager": eager call}, release): the same computation in PyTorch
    on the GPU (TF32 off) as sides of bench.common.compare, each returning ms per call by
    bench.common.measure with CUDA events. Eager calls pay PyTorch's per-call dispatch (about 20 us),
    which is longer than a small conv: the graph replay of many calls measures the library's kernels
    alone. `release` frees the graph once the row is timed."""
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
        n, h, w, ci, co, kh, kw, s, p = item["conv"]
        x, wt = torch.randn(n, ci, h, w, device=dev), torch.randn(co, ci, kh, kw, device=dev)
        fn = lambda: torch.nn.functional.conv2d(x, wt, stride=s, padding=p)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(5):
            out = fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    clock = cuda_clock(torch)

    def eager() -> float:
        return measure(fn, min_batch_ms=GPU_MIN_BATCH_MS, batches=GPU_BATCHES, clock=clock).ms

    # one graph of many calls (enough for ~50 ms, at most 2000 calls and 2 GiB of outputs)
    calls = int(min(max(3, 50 / max(eager(), 1e-3)), 2000, max(3, (2 << 30) // max(1, out.numel() * 4))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()

    def graphed() -> float:
        return measure(graph.replay, min_batch_ms=GPU_MIN_BATCH_MS, batches=GPU_BATCHES, clock=clock).ms / calls

    def release() -> None:
        nonlocal graph
        graph = None
        torch.cuda.empty_cache()
    return {"torch": graphed, "torch_eager": eager}, release


def gpu_name() -> str:
    try:
        import torch
        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        return "unknown GPU"


# ------------------------------------------------------------------------------ driver

def timed_fields(flops: float, verified: bool, cmp: Comparison) -> dict:
    """A row's timing fields from its comparison: each side's median ms over the pairs that did not
    fail, `tuned/torch` (the ratio of the medians, torch ms / tuned ms, recomputable from the printed
    ms) and `tuned/torch_pairwise` (the median of the per-pair ratios), likewise against eager PyTorch,
    and the pairs. A kernel that failed its check was not timed and gets no time and no speedup."""
    got = cmp.fields("tuned" if verified else (), ["torch", "torch_eager"])
    tuned, torch = got.get("tuned_ms"), got.get("torch_ms")
    return {**got, "tuned_ms": tuned,
            "tuned_tflops": flops / tuned / 1e9 if tuned else None,
            "torch_tflops": flops / torch / 1e9 if torch else None,
            "tuned/torch": got.get("tuned_vs_torch"), "tuned/torch_pairwise": got.get("tuned_vs_torch_pairwise"),
            "pairs_ok": f"{len(cmp.ok)}/{len(cmp.pairs)}"}


def resnet50_total(rows: list[dict]) -> dict | None:
    """The ResNet-50 conv rows summed (each times its layer count) over the layers with a row that
    passed verification and was timed; the others are named and left out (a wrong kernel has no time
    worth adding, and a sum with a hole in it is not the network's). A layer tuned in more than one
    form (direct, Winograd) counts its fastest, the one a deployment would take; its trials count all."""
    convs = [r for r in rows if r["task"].startswith("r50.")]
    forms: dict[str, list[dict]] = {}
    for r in convs:
        forms.setdefault(r["task"].split()[0], []).append(r)
    best = {layer: min((r for r in rs if r["verified"] and r.get("tuned_ms") and r.get("torch_ms")),
                       key=lambda r: r["tuned_ms"], default=None) for layer, rs in forms.items()}
    good = [r for r in best.values() if r is not None]
    if not good:
        return None
    tot = {"task": f"ResNet-50 convs (x layers), {len(good)} of {len(forms)} verified and timed", "total": True,
           "layers": sum(r["layers"] for r in good),
           "trials": sum(r["trials"] for layer, rs in forms.items() if best[layer] for r in rs),
           "tuned_ms": sum(r["tuned_ms"] * r["layers"] for r in good),
           "torch_ms": sum(r["torch_ms"] * r["layers"] for r in good),
           "torch_eager_ms": sum(r["torch_eager_ms"] * r["layers"] for r in good),
           "forms": [r["task"] for r in good],
           "excluded_failed": [r["task"] for layer, rs in forms.items() if best[layer] is None for r in rs]}
    tot["verified"] = not tot["excluded_failed"]
    tot["tuned/torch"] = tot["torch_ms"] / tot["tuned_ms"]
    return tot


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench tune --target cuda")
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--trials", type=int, default=64, help="measured programs per task")
    ap.add_argument("--workloads", default="matmul,resnet50",
                    help="matmul, resnet50, r50:i[-j], r50w4:i[-j] or r50w2:i[-j] (Winograd F(4x4) / F(2x2) of the "
                         "3x3 stride-1 convs among them), comma-separated")
    ap.add_argument("--per-round", type=int, default=64)
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=[*MODEL_OBJECTIVES, "random"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-gflop", type=float, default=1000.0,
                    help="check candidates against the NumPy reference while tuning tasks up to this size")
    ap.add_argument("--run-timeout", type=float, default=10.0, help="seconds per candidate's check and timing")
    ap.add_argument("--json", help="write the environment and the rows to this JSON file (rewritten after each task)")
    ap.add_argument("--torch-only", action="store_true", help="only time PyTorch on the workloads")
    ap.add_argument("--pairs", type=int, default=PAIRS, help="timing pairs (alternating order)")
    args, _ = ap.parse_known_args(argv)
    env = environment(os.cpu_count())
    env["gpu"] = name = gpu_name()
    if args.torch_only:
        rows = []
        for item in workloads(args.workloads):
            sides, release = torch_sides(item)
            cmp = compare(sides, args.pairs)
            release()
            rows.append({"gpu": name, "task": item["label"], "layers": item["count"], **cmp.fields()})
            print(f"  {item['label']}: torch {rows[-1]['torch_ms']} ms (eager {rows[-1]['torch_eager_ms']}), "
                  f"{len(cmp.ok)}/{len(cmp.pairs)} pairs ok", flush=True)
            write_json(args.json, rows, env, benchmark="tune-cuda")
        return 0

    from tensortune.codegen.cuda_backend import device_target
    from tensortune.codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
    from tensortune.codegen.target import make_task
    from tensortune.codegen.timing import TimingConfig
    from tensortune.codegen.worker_pool import WorkerPool
    from tensortune.flows.tuning import tune_task
    from tensortune.search.sketch_policy import SearchParams
    from tensortune.tasks.workload_registry import make_dag

    target = device_target() if args.target.strip() == "cuda" else args.target
    items = workloads(args.workloads)
    env["target"] = str(target)
    print(f"{env['date']} on {name}; target '{target}'; {args.trials} trials per task; {len(items)} tasks", flush=True)
    measurer = ProgramMeasurer(LocalBuilder(n_parallel=os.cpu_count(), timeout=60),
                               LocalRunner(timeout=args.run_timeout, config=TimingConfig(min_repeat_ms=50)))
    verifier = WorkerPool("bench.tune_cuda:verify_job", 1, timeout=600)
    rows = []
    try:
        for item in items:
            task = make_task(make_dag(item["workload"], *item["args"]), target, name=item["label"])
            measurer.runner.config = TimingConfig(min_repeat_ms=50,
                                                  check_correctness=task.flops / 1e9 <= args.check_gflop)
            watch = Stopwatch()
            res = tune_task(task, args.trials, measurer=measurer, model=args.model, seed=args.seed,
                            params=SearchParams(num_measures_per_round=args.per_round),
                            progress=lambda log, r: print(
                                f"    round {log.round}: {log.trials} trials, best {log.best_gflops:.0f} GFLOP/s, "
                                f"{log.errors} errors; search {log.search_s + log.train_s:.1f} s, measure "
                                f"{log.measure_s:.1f} s", flush=True))
            wall = watch.elapsed
            # GFLOP of the direct conv for a Winograd row too: its TFLOP/s are effective, comparable
            flops = make_task(make_dag("conv2d", *item["conv"]), target).flops if "conv" in item else task.flops
            row = {"gpu": name, "task": item["label"], "layers": item["count"],
                   "trials": res.trials, "gflop": flops / 1e9, "tune_s": wall,
                   "errors": sum(r.errors for r in res.rounds), "best_steps": res.best_steps}
            bad, tuned = "no valid program", None
            if res.best_steps:
                (b,) = measurer.builder.build(task, [res.best_steps])
                if b.artifact is not None:
                    conv = (*item["conv"][7:9], item.get("winograd_m", 0)) if "conv" in item else None
                    (r,) = verifier.map([(task.to_json(), b.artifact, conv, True)])
                    bad = r.value[1] if r.ok else (r.error.strip().splitlines() or ["worker failed"])[-1]
                    if not bad:
                        tuned = tuned_side(verifier, task, b.artifact, conv)
                else:
                    bad = f"build failed: {b.error_msg[:200]}"
            # tuned (only when its output is right), PyTorch graph and eager: alternating pairs
            sides, release = torch_sides(item)
            cmp = compare({**({"tuned": tuned} if tuned else {}), **sides}, args.pairs)
            release()
            row.update({**timed_fields(flops, not bad, cmp), "verified": not bad, "note": bad[:120]})
            rows.append(row)
            print(f"  {item['label']}: tuned {row['tuned_ms']} ms, torch {row['torch_ms']} ms "
                  f"(eager {row['torch_eager_ms']}), pairs ok {row['pairs_ok']}, {res.trials} trials, "
                  f"{wall:.0f} s{'' if not bad else ' FAILED ' + bad[:80]}", flush=True)
            write_json(args.json, rows, env, benchmark="tune-cuda")
    finally:
        measurer.close()
        verifier.close()
    tot = resnet50_total(rows)
    if tot is not None:
        rows.append({"gpu": name, **tot})
    shown = [{**r, **{k: fmt_ratio(r.get(k), failed=not r.get("verified", True) and not r.get("total", False))
                      for k in ("tuned/torch", "tuned/torch_pairwise")}} for r in rows]
    print_table(shown, ["task", "layers", "trials", "tuned_ms", "tuned_tflops", "torch_ms", "torch_eager_ms",
                        "torch_tflops", "tuned/torch", "tuned/torch_pairwise", "pairs_ok", "verified"])
    print("tuned/torch = median torch ms / median tuned ms over the pairs (recomputable from the ms columns); "
          "_pairwise = the median of the per-pair ratios")
    write_json(args.json, rows, env, benchmark="tune-cuda")
    return 0
