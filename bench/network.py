"""`python -m bench network NETWORK`: whole networks, tuned against PyTorch CPU eager and ONNX Runtime.

The network is the PyTorch model (the architecture written with torch.nn: torchvision does not import
beside the CPU torch wheel), exported with torch.onnx.export (torch's default exporter) to one ONNX
file. ONNX Runtime runs that file (CPU provider, all graph optimizations, sequential execution); we
import the same file with tasks/onnx_import.py, the path a user takes, extract its tasks and tune them
with the gradient task scheduler (and, at the same number of trials, from the same warm-up and taking
turns with it round by round, with round-robin). The network built from the best records is checked
against the imported graph's NumPy reference and against ONNX Runtime's outputs; then default
schedules, tuned, PyTorch and ONNX Runtime are timed in alternating pairs (bench.common.compare: one
protocol for all four, in this process, on the same inputs). A network whose outputs fail a check
gets no speedup. `--threads N` is every side's thread count (bench.common, "Threads").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass

import numpy as np

from bench.common import (
    PAIRS,
    Stopwatch,
    compare,
    ensure_clean_blas_env,
    environment,
    fmt_ratio,
    in_process,
    limit_threads,
    llvm_target,
    print_table,
    threads_used,
    write_json,
)
from tensortune.tasks.winograd import parse_tiles

NETWORK_OPTIONS = {
    "resnet-18": {"image_size": 224},
    "resnet-50": {"image_size": 224},
    "mobilenet-v2": {"image_size": 224},
    "bert-base": {"num_layers": 1, "seq_len": 128},
}


# ---------------------------------------------------------------------------------- PyTorch models

def torch_model(name: str, torch, options: dict):
    nn = torch.nn

    class Basic(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1)
            self.down = nn.Conv2d(cin, cout, 1, stride) if stride != 1 or cin != cout else None

        def forward(self, x):
            y = self.c2(torch.relu(self.c1(x)))
            return torch.relu(y + (self.down(x) if self.down is not None else x))

    class Bottleneck(nn.Module):
        """tasks.models.resnet's bottleneck (torchvision v1.5: the stride on the 3x3 conv)."""

        def __init__(self, cin, width, stride):
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(cin, width, 1), nn.Conv2d(width, width, 3, stride, 1)
            self.c3 = nn.Conv2d(width, 4 * width, 1)
            self.down = nn.Conv2d(cin, 4 * width, 1, stride) if stride != 1 or cin != 4 * width else None

        def forward(self, x):
            y = self.c3(torch.relu(self.c2(torch.relu(self.c1(x)))))
            return torch.relu(y + (self.down(x) if self.down is not None else x))

    class ResNet(nn.Module):
        """tasks.models.resnet: a 7x7 stem and max pool, `stages` blocks of widths 64-512 (each stage after the
        first starting with a stride of 2), average pool and classifier."""

        def __init__(self, block, stages, expansion):
            super().__init__()
            self.stem = nn.Conv2d(3, 64, 7, 2, 3)
            layers, cin = [], 64
            for stage, count in enumerate(stages):
                width = 64 * 2 ** stage
                for b in range(count):
                    layers.append(block(cin, width, 2 if stage > 0 and b == 0 else 1))
                    cin = width * expansion
            self.layers = nn.Sequential(*layers)
            self.fc = nn.Linear(cin, 1000)

        def forward(self, x):
            x = nn.functional.max_pool2d(torch.relu(self.stem(x)), 3, 2, 1)
            x = self.layers(x)
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    class InvRes(nn.Module):
        def __init__(self, cin, cout, stride, expand):
            super().__init__()
            hid = cin * expand
            self.expand = nn.Conv2d(cin, hid, 1) if expand != 1 else None
            self.dw = nn.Conv2d(hid, hid, 3, stride, 1, groups=hid)
            self.project = nn.Conv2d(hid, cout, 1)
            self.res = stride == 1 and cin == cout

        def forward(self, x):
            y = nn.functional.relu6(self.expand(x)) if self.expand is not None else x
            y = self.project(nn.functional.relu6(self.dw(y)))
            return x + y if self.res else y

    class MobileNetV2(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 32, 3, 2, 1)
            blocks, cin = [], 32
            for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                               (6, 160, 3, 2), (6, 320, 1, 1)):
                for i in range(n):
                    blocks.append(InvRes(cin, c, s if i == 0 else 1, t))
                    cin = c
            self.blocks = nn.Sequential(*blocks)
            self.head = nn.Conv2d(320, 1280, 1)
            self.fc = nn.Linear(1280, 1000)

        def forward(self, x):
            x = self.blocks(nn.functional.relu6(self.stem(x)))
            x = nn.functional.relu6(self.head(x))
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    class BertLayer(nn.Module):
        def __init__(self, hidden=768, heads=12, inter=3072):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.out = nn.Linear(hidden, hidden)
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.ff1, self.ff2 = nn.Linear(hidden, inter), nn.Linear(inter, hidden)

        def forward(self, x):
            b, s, h = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            att = torch.softmax(q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5, dim=-1)
            ctx = (att @ v).transpose(1, 2).reshape(b, s, h)
            x = self.ln1(x + self.out(ctx))
            return self.ln2(x + self.ff2(nn.functional.gelu(self.ff1(x))))

    class Bert(nn.Module):
        """Like tasks.models.bert: embeddings (word lookup, position, token type, LayerNorm), the
        encoder layers and the pooler, so both sides compute the same network."""

        def __init__(self, layers, hidden=768, vocab=30522, positions=512):
            super().__init__()
            self.word = nn.Embedding(vocab, hidden)
            self.position = nn.Parameter(torch.randn(positions, hidden) * 0.02)
            self.token_type = nn.Parameter(torch.randn(hidden) * 0.02)
            self.ln = nn.LayerNorm(hidden)
            self.layers = nn.Sequential(*[BertLayer() for _ in range(layers)])
            self.pool = nn.Linear(hidden, hidden)

        def forward(self, ids):
            x = self.ln(self.word(ids) + self.position[:ids.shape[1]] + self.token_type)
            x = self.layers(x)
            return x, torch.tanh(self.pool(x[:, 0]))

    size = options.get("image_size", 224)
    if name == "resnet-18":
        return ResNet(Basic, (2, 2, 2, 2), 1).eval(), torch.randn(1, 3, size, size)
    if name == "resnet-50":
        return ResNet(Bottleneck, (3, 4, 6, 3), 4).eval(), torch.randn(1, 3, size, size)
    if name == "mobilenet-v2":
        return MobileNetV2().eval(), torch.randn(1, 3, size, size)
    if name == "bert-base":
        return Bert(options.get("num_layers", 1)).eval(), torch.randint(0, 30522, (1, options.get("seq_len", 128)))
    raise ValueError(f"no PyTorch model for {name}; known: {', '.join(NETWORK_OPTIONS)}")


# ---------------------------------------------------------------------------------- ONNX: export, ORT, import

def export_onnx(model, example, path: str, torch) -> str:
    """The model as an ONNX file, by torch.onnx.export with its defaults (what a user runs); its one
    input is named "input"."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example,), path, input_names=["input"], verbose=False)
    return path


def ort_session(path: str, threads: int, profile_prefix: str | None = None):
    """ONNX Runtime on the CPU: all graph optimizations, `threads` intra-op threads, sequential; with
    `profile_prefix`, its per-node profile on (written by end_profiling())."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref| (inf for a shape mismatch or a non-finite value), as
    CompiledNetwork.check measures against the NumPy reference."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        return math.inf
    diff = np.abs(out - ref)
    if not np.all(np.isfinite(diff)):
        return math.inf
    return float(np.max(diff)) / max(float(np.max(np.abs(ref))), 1e-30) if ref.size else 0.0


def output_errors(outs: dict, refs: list) -> dict[str, float]:
    """Per output (in the graph's output order, which is the ONNX file's): error against refs."""
    return {k: relative_error(v, r) for (k, v), r in zip(outs.items(), refs)}


# ---------------------------------------------------------------------------------- tensortune

def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if math.isfinite(seconds) else "n/a (a task has no program yet)"


def tune(name: str, tasks: list, trials: int, strategies: list[str], seed: int, measurer,
         records: str | None = None, form_sets: list | None = None) -> dict:
    """{strategy: (result, seconds)}. The warm-up (a round per task) runs once; each strategy resumes
    from a copy of its records, so all start from the same programs, cost model and bests, and they take
    turns, one round each, on one measurer, so that this VM's drift (which moved a task's timings by 30%
    within minutes) hits them alike. Curves and times include the warm-up."""
    from tensortune.flows.tuning import NetworkTuner
    from tensortune.storage.records import RecordStore
    home = records or tempfile.mkdtemp(prefix="tensortune-bench-network-")

    def tuner(label: str, budget: int, strategy: str = "round-robin") -> NetworkTuner:
        # retime=0: a strategy resumes from the warm-up made minutes ago on this measurer, and both must
        # start from the same bests
        return NetworkTuner(tasks, budget, measurer, strategy=strategy, seed=seed, network_name=name,
                            records=RecordStore(os.path.join(home, label)), form_sets=form_sets or (), retime=0,
                            progress=lambda i, log, r: print(
                                f"  {name} [{label}] {r.trials}/{budget} trials, task {i} best "
                                f"{log.best_gflops:.1f} GFLOP/s, est. {_ms(r.estimated_latency)}", flush=True))
    with Stopwatch() as warm_watch:
        warm = tuner("warm-up", trials)
        for _ in tasks:
            warm.step()
    warm_trials = warm.result.trials
    tuners = {}
    for s in strategies:
        shutil.copytree(os.path.join(home, "warm-up"), os.path.join(home, s))
        tuners[s] = tuner(s, trials - warm_trials, s)
        tuners[s].per_round = warm.per_round       # the round size of the whole budget, as in one run
    turns = take_turns(tuners)
    seconds = {s: warm_watch.seconds + turns[s] for s in strategies}
    out = {}
    for s, t in tuners.items():
        res = t.result
        res.trials += warm_trials
        res.curve = warm.result.curve + [(n + warm_trials, obj) for n, obj in res.curve]
        out[s] = (res, seconds[s])
    if records is None:
        shutil.rmtree(home, ignore_errors=True)
    return out


def take_turns(tuners: dict) -> dict[str, float]:
    """Step the tuners one round each, in turn, until none has a round left (so that this VM's drift hits
    them alike); returns the seconds each spent."""
    seconds = dict.fromkeys(tuners, 0.0)
    busy = True
    while busy:
        busy = False
        for label, t in tuners.items():
            with Stopwatch() as watch:
                busy |= t.step()
            seconds[label] += watch.seconds
    return seconds


class MissingPrograms(Exception):
    """`--retime` found a store without a program for some of the network's tasks."""


def retime_store(records: str, name: str) -> str | None:
    """Where `--retime` reads network `name`'s records in `records` (None: nowhere). A run of this benchmark
    keeps them in records/<name>/gradient; a store the flow wrote (`tensortune tune NAME --records DIR`,
    a user's nightly store) is `records` itself, so the network a user would deploy from it can be set
    beside ONNX Runtime and PyTorch without tuning again."""
    from tensortune.storage.records import RecordStore
    own = os.path.join(records, name, "gradient")
    if os.path.isdir(own):
        return own
    return records if os.path.isdir(records) and RecordStore(records).targets() else None


def stored_result(name: str, tasks: list, store: str, form_sets: list):
    """The best programs and costs stored in `store` (`retime_store`), read as a tuner resuming from them
    reads them: `--retime` times the networks again without tuning. Every task must have a stored program:
    one built with the runtime's default schedule would be timed as if it were tuned."""
    from tensortune.flows.tuning import NetworkTuner
    from tensortune.search.task_scheduler import INF_COST, effective_costs
    from tensortune.storage.records import RecordStore
    tuner = NetworkTuner(tasks, 0, None, records=RecordStore(store), network_name=name, form_sets=form_sets)
    # the terms the estimate cannot price: a task, or a group's every form, without a valid program
    costs = effective_costs(tuner.result.best_costs, tuner.result.form_sets)
    missing = [t.name for t, cost in zip(tasks, costs) if cost >= INF_COST]
    if missing:
        names = sorted(set(missing))
        raise MissingPrograms(f"--retime: {store} holds no program for {len(missing)} of the {len(tasks)} tasks of "
                              f"{name} as this benchmark imports it ({', '.join(names[:4])}"
                              f"{', ...' if len(names) > 4 else ''})")
    tuner.result.trials = sum(tuner.history)
    return tuner.result


def tuned_programs(result) -> tuple[dict[str, str], dict[str, float]]:
    """A NetworkTuneResult's best programs and their costs by workload key, as build_network takes them."""
    best = {t.workload_key: s for t, s in zip(result.tasks, result.best_steps) if s}
    return best, {t.workload_key: c for t, c in zip(result.tasks, result.best_costs)}


def trials_to_reach(curve, target: float) -> int | None:
    for t, obj in curve:
        if obj <= target * (1 + 1e-9):
            return t
    return None


def builtin_agreement(imported: list, builtin: list) -> dict:
    """Whether the imported ONNX graph's tasks are those of the built-in builder (tasks/models.py, what
    `tensortune tune-network NAME` tunes): the same workload keys with the same weights. Only then do
    this benchmark's figures and records carry over to the built-in network; where they do not, the
    row names the tasks on each side."""
    a, b = ({t.workload_key: t.weight for t in ts} for ts in (imported, builtin))
    return {"same": a == b, "imported_tasks": len(imported), "builtin_tasks": len(builtin),
            "imported_only": sorted(t.name for t in imported if t.workload_key not in b),
            "builtin_only": sorted(t.name for t in builtin if t.workload_key not in a),
            "weights_differ": sorted(t.name for t in imported if t.workload_key in b and a[t.workload_key]
                                     != b[t.workload_key])}


def network_options(name: str, args) -> dict:
    options = dict(NETWORK_OPTIONS.get(name, {}))
    if args.image_size and "image_size" in options:
        options["image_size"] = args.image_size
    if args.seq_len and "seq_len" in options:
        options["seq_len"] = args.seq_len
    return options


LAYER_BLOCKS, LAYER_PASSES = 4, 10


@dataclass
class LayerBreakdown:
    """ms per call of each task (aligned with the benchmark's task list; None where a network runs no
    call of it): inside our network, and of its ONNX nodes inside ORT's run of the same file."""
    ours_ms: list[float | None]
    ort_ms: list[float | None]
    ort_unmapped_ms: float          # per run: ORT's nodes that no task computes (its layout reorders)


def layer_breakdown(compiled, path: str, threads: int, feed: dict, net, tasks,
                    blocks: int = LAYER_BLOCKS, passes: int = LAYER_PASSES) -> LayerBreakdown:
    """Where the network's time goes, task by task, in ours and in ORT: CompiledNetwork.profile (each
    kernel timed alone inside the network; all its calls / weight) and ORT's own per-node profile, in
    `blocks` alternating blocks of `passes` runs each, so the machine's drift (a shared VM's speed moved
    by half within minutes) meets both alike. The medians per block, then across blocks; set beside the
    tuner's task_best_ms it attributes the estimate's gap, beside ORT's it says where ORT's kernels beat
    ours. Never a compared speed of the networks: that is `compare`'s. A profiled ORT session of its own,
    so the timed one carries no profiler. `net` runs one form per group (resolve_forms). ORT names a node
    it keeps after the ONNX node, and a node it rewrote for its NCHWc kernels after the tensor it writes
    plus `_nchwc` (ORT 1.32); our graph's nodes are named after the tensors they write
    (tasks.onnx_import)."""
    import onnx
    sess = ort_session(path, threads, profile_prefix=os.path.join(os.path.dirname(path), "ort-profile"))
    warm_up = 3
    for _ in range(warm_up):
        sess.run(None, feed)
    ours_blocks = []
    for _ in range(blocks):
        ours_blocks.append(compiled.profile(passes))   # its untimed first run absorbs ORT's spinning threads
        for _ in range(passes):
            sess.run(None, feed)
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    per_node: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_node.setdefault(e["name"][:-len("_kernel_time")], []).append(e["dur"] / 1e3)
    output_of = {n.name: n.output[0] for n in onnx.load(path, load_external_data=False).graph.node if n.output}
    ort_spent = [0.0] * len(net.tasks)
    unmapped = 0.0
    for node, ms in per_node.items():
        runs = ms[warm_up:]
        block_medians = [statistics.median(runs[b * passes:(b + 1) * passes]) for b in range(blocks)]
        tensor = node.removesuffix("_nchwc")
        group = next((net.node_group[k] for k in (node, tensor, output_of.get(node))
                      if net.node_group.get(k) is not None), None)
        if group is None:
            unmapped += statistics.median(block_medians)
        else:
            ort_spent[net.groups[group].task] += statistics.median(block_medians)
    ours = {k.workload_key: statistics.median(b[i] for b in ours_blocks) / k.weight * 1e3
            for i, k in enumerate(compiled.kernels)}
    theirs = {t.workload_key: ort_spent[i] / t.weight for i, t in enumerate(net.tasks)}
    return LayerBreakdown([ours.get(t.workload_key) for t in tasks], [theirs.get(t.workload_key) for t in tasks],
                          unmapped)


def bench_network(name: str, args, torch, folder: str, stored: str | None = None) -> dict:
    """One network's row; with `stored` (a `retime_store`), its records are timed again, not tuned."""
    from tensortune.codegen.network_runtime import NETWORK_TOLERANCE, build_network
    from tensortune.flows.tuning import network_measurer, network_tasks
    from tensortune.tasks.onnx_import import import_onnx
    options = network_options(name, args)
    target = llvm_target(args.threads)
    torch.manual_seed(args.seed)
    model, example = torch_model(name, torch, options)
    path = export_onnx(model, example, os.path.join(folder, f"{name}.onnx"), torch)
    graph = import_onnx(path, name=name)
    tiles = args.winograd
    net, tasks = network_tasks(graph, target, tiles)
    agreement = builtin_agreement(tasks, network_tasks(name, target, tiles, **options)[1])
    feed = graph.random_inputs(args.seed)         # the same inputs for every side
    (input_name,) = feed

    if stored is not None:
        runs = {"gradient": (stored_result(name, tasks, stored, net.form_sets()), None)}
    else:
        measurer = network_measurer(net)          # as tune_network and the flow time kernels
        strategies = ["gradient"] + ([] if args.no_round_robin else ["round-robin"])
        try:
            runs = tune(name, tasks, args.trials, strategies, args.seed, measurer,
                        os.path.join(args.records, name) if args.records else None, net.form_sets())
        finally:
            measurer.close()      # its runner's thread pool must not meet the timings below
    grad, wall = runs["gradient"]
    best, costs = tuned_programs(grad)
    built = {"default": build_network(net, None, target), "tuned": build_network(net, best, target, costs),
             # the same tuned programs with their weights in the plain layout: what the layout rewrite buys
             "plain": build_network(net, best, target, costs, layout_rewrite=False)}
    net = net.resolve_forms(best, costs)          # the forms the tuned network runs, for the library too
    # the same tuned kernels as one AOT library (driver in native code), loaded as a deployment loads it
    from tensortune.codegen.aot import compile_network, dispatch_overhead
    from tensortune.codegen.network_runtime import relative_errors
    from tensortune.runtime import load
    library = load(compile_network(net, best, os.path.join(folder, f"{name}-compiled"), target).out_dir)

    # checks: ours against the NumPy reference and ONNX Runtime, ORT against PyTorch
    sess = ort_session(path, args.threads)
    ort_outs = sess.run(None, feed)
    with torch.no_grad():
        torch_outs = model(torch.from_numpy(feed[input_name]))
    torch_outs = [t.numpy() for t in (torch_outs if isinstance(torch_outs, (tuple, list)) else (torch_outs,))]
    checks = {}
    for label, compiled in built.items():
        ref = compiled.check(feed)
        vs_ort = output_errors(compiled.run(feed), ort_outs)
        checks[label] = {"numpy_error": ref.errors, "ort_error": vs_ort,
                         "passed": ref.passed and all(e <= NETWORK_TOLERANCE for e in vs_ort.values())}
    lib_outs = library.run(feed)
    ref_err = relative_errors(lib_outs, graph.run_reference(feed))
    vs_ort = output_errors(lib_outs, ort_outs)
    checks["compiled"] = {"numpy_error": ref_err, "ort_error": vs_ort,
                          "passed": all(e <= NETWORK_TOLERANCE for e in [*ref_err.values(), *vs_ort.values()])}
    ort_vs_torch = {f"output{i}": relative_error(o, t) for i, (o, t) in enumerate(zip(ort_outs, torch_outs))}

    # timing: six sides in alternating pairs, one protocol, the same inputs
    for compiled in built.values():
        compiled.set_inputs(feed)
    x = torch.from_numpy(feed[input_name])

    def forward():
        with torch.no_grad():
            return model(x)
    sides = {"tuned": in_process(built["tuned"].run_planned), "default": in_process(built["default"].run_planned),
             "plain": in_process(built["plain"].run_planned),
             "compiled": in_process(library.run_pointers),
             "torch": in_process(forward), "ort": in_process(lambda: sess.run(None, feed))}
    cmp = compare(sides, args.pairs)
    layers = layer_breakdown(built["tuned"], path, args.threads, feed, net, tasks)

    row = {"network": name, "options": options, "onnx_inputs": {input_name: list(feed[input_name].shape)},
           "tasks": len(tasks), "trials": grad.trials, "target": target, "builtin_agreement": agreement,
           "same_tasks_as_builtin": agreement["same"],
           "threads_used": threads_used(target, sess),
           **cmp.fields(["tuned", "default", "compiled", "plain"], ["torch", "ort"]),
           "compiled_vs_python_runtime": None, "dispatch_ns_per_kernel": dispatch_overhead(net, target) * 1e9,
           "checked": {k: v["passed"] for k, v in checks.items()}, "checks": checks,
           "check_tolerance": NETWORK_TOLERANCE, "ort_vs_torch_error": ort_vs_torch,
           "tune_wall_s": wall, "est_latency_ms": grad.estimated_latency * 1e3,
           "gradient_curve": grad.curve, "task_best_ms": [c * 1e3 for c in grad.best_costs],
           "task_weights": [t.weight for t in tasks], "workload_keys": [t.workload_key for t in tasks],
           # each task's time per call inside the tuned network (all its calls / weight), beside
           # task_best_ms (timed alone by the tuner): where the estimate and the network part
           "task_in_network_ms": layers.ours_ms,
           # the same tasks' ONNX nodes in ORT's own per-node profile, and ORT's nodes no task computes
           "task_ort_ms": layers.ort_ms, "ort_unmapped_ms": layers.ort_unmapped_ms,
           "task_labels": [t.label for t in tasks]}
    withhold_failed(row)
    # the estimate against the network as the Python runtime runs it (a ctypes call per kernel, a few us
    # each) and as the compiled library runs it (what a user deploys; a native loop of calls)
    row["est_vs_measured"] = (row["est_latency_ms"] / row["tuned_ms"]) if row["tuned_ms"] else None
    row["est_vs_compiled"] = (row["est_latency_ms"] / row["compiled_ms"]) if row["compiled_ms"] else None
    if row["compiled_ms"] and row["tuned_ms"]:
        row["compiled_vs_python_runtime"] = row["tuned_ms"] / row["compiled_ms"]
    # > 1: the layout rewrite made the tuned network faster than its programs with plain-layout weights
    gain = cmp.ratio("plain", "tuned")
    row["tuned_vs_plain"] = gain.ratio_of_medians if gain else None
    row["tuned_vs_plain_pairwise"] = gain.median_of_ratios if gain else None
    if "round-robin" in runs:
        rr, rr_wall = runs["round-robin"]
        goal = rr.curve[-1][1]
        reached = trials_to_reach(grad.curve, goal)
        row.update({"rr_final_objective_ms": goal * 1e3, "gradient_final_objective_ms": grad.curve[-1][1] * 1e3,
                    "rr_trials": rr.trials, "rr_wall_s": rr_wall, "gradient_trials_to_rr_final": reached,
                    "gradient_needs_fewer_trials": reached is not None and reached < rr.trials,
                    "rr_curve": rr.curve, "rr_task_best_ms": [c * 1e3 for c in rr.best_costs]})
    return row


def withhold_failed(row: dict, refs: tuple[str, ...] = ("torch", "ort")) -> dict:
    """A wrong answer has no speedup: for each of our networks whose check failed (row["checked"]),
    its ratios against every reference become None, in the JSON as in the table (`printed`)."""
    for label, ok in row["checked"].items():
        if not ok:
            for ref in refs:
                row[f"{label}_vs_{ref}"] = row[f"{label}_vs_{ref}_pairwise"] = None
    return row


def layer_rows(row: dict) -> list[dict]:
    """Per task the network runs: its calls, ms per call inside our network and inside ORT's, most
    ms lost to ORT (per network run) first."""
    rows = []
    for label, weight, ours, theirs in zip(row["task_labels"], row["task_weights"], row["task_in_network_ms"],
                                           row["task_ort_ms"]):
        if ours is None or not theirs:
            continue
        rows.append({"task": label, "calls": weight, "ours_ms": ours, "ort_ms": theirs,
                     "ours_over_ort": ours / theirs, "lost_ms_per_run": (ours - theirs) * weight})
    return sorted(rows, key=lambda r: -r["lost_ms_per_run"])


def printed(row: dict) -> dict:
    """The table's view of a row: ratios as 'failed' where the answer was wrong."""
    out = dict(row)
    for label in [k for k in ("tuned", "default", "compiled", "plain") if k in row["checked"]]:
        ok = row["checked"][label]
        out[f"{label}_check"] = "ok" if ok else "FAILED"
        for ref in ("torch", "ort"):
            out[f"{label}_vs_{ref}"] = fmt_ratio(row[f"{label}_vs_{ref}"], failed=not ok)
            out[f"{label}_vs_{ref}_pairwise"] = fmt_ratio(row[f"{label}_vs_{ref}_pairwise"], failed=not ok)
    out["pairs_ok"] = f"{row['pairs'] - row['failed_pairs']}/{row['pairs']}"
    return out


def main(argv: list[str]) -> int:
    ensure_clean_blas_env()
    ap = argparse.ArgumentParser(prog="python -m bench network")
    ap.add_argument("networks", nargs="*", default=["resnet-18"], help=", ".join(NETWORK_OPTIONS))
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--json", help="write the environment and the rows to this JSON file")
    ap.add_argument("--threads", type=int, default=2, help="threads of every side (ours, PyTorch, ORT, BLAS)")
    ap.add_argument("--pairs", type=int, default=PAIRS, help="timing pairs (alternating order)")
    ap.add_argument("--image-size", type=int, help="input size of the CNNs (default 224; e.g. 64 for a smoke run)")
    ap.add_argument("--seq-len", type=int, help="BERT's sequence length (default 128)")
    ap.add_argument("--no-round-robin", action="store_true", help="skip the round-robin comparison")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--winograd", metavar="TILES", type=parse_tiles, default=(),
                    help="also tune the Winograd form F(m x m, 3 x 3) of every eligible conv, for these tile "
                         "sizes (e.g. 4 or 2,4); each group runs its faster form")
    ap.add_argument("--records", metavar="DIR", help="keep the records in DIR/<network>/{warm-up,<strategy>} "
                                                      "(a fresh folder: a stored history would be resumed)")
    ap.add_argument("--retime", action="store_true", help="no tuning: time the networks built from the records "
                                                           "an earlier run kept in --records DIR, or from the "
                                                           "record store DIR (`tensortune tune NAME --records DIR`)")
    ap.add_argument("--keep-onnx", metavar="DIR", help="write the exported ONNX files to DIR (default: a "
                                                       "temporary folder, removed)")
    args = ap.parse_args(argv)
    unknown = [n for n in args.networks if n not in NETWORK_OPTIONS]
    if unknown:
        ap.error(f"unknown network(s) {unknown}; known: {', '.join(NETWORK_OPTIONS)}")
    stored: dict[str, str | None] = {}          # network -> the records --retime times (`retime_store`)
    if args.retime:
        stored = {n: retime_store(args.records, n) if args.records else None for n in args.networks}
        missing = [n for n, store in stored.items() if store is None]
        if missing:
            ap.error(f"--retime needs the records of an earlier run: no {args.records or '--records DIR'}/"
                     f"<network>/gradient for {', '.join(missing)}, and {args.records or '--records DIR'} "
                     "is no record store")
    folder = args.keep_onnx or tempfile.mkdtemp(prefix="tensortune-bench-onnx-")
    os.makedirs(folder, exist_ok=True)
    rows = []
    try:
        with limit_threads(args.threads) as torch:
            if torch is None:
                ap.error("the network benchmark needs the bench extra: pip install -e '.[bench]' -c constraints.txt")
            env = environment(args.threads)
            print(f"{env['machine']['cpu_model']} ({env['machine']['llvm_host_cpu']}); BLAS {env['blas']}; "
                  f"FMA peak {env['fma_peak_gflops']} GFLOP/s", flush=True)
            for name in args.networks:
                try:
                    rows.append(bench_network(name, args, torch, folder, stored.get(name)))
                except MissingPrograms as err:
                    print(f"error: {err}", file=sys.stderr)
                    return 2
                print(json.dumps({k: v for k, v in rows[-1].items()
                                  if not k.endswith("curve") and k not in ("pair_timings", "workload_keys")}),
                      flush=True)
                write_json(args.json, rows, env, benchmark="network")
    finally:
        if not args.keep_onnx:
            shutil.rmtree(folder, ignore_errors=True)
    print_table([printed(r) for r in rows],
                ["network", "tasks", "same_tasks_as_builtin", "trials", "tuned_check", "tuned_ms", "default_ms",
                 "compiled_ms", "plain_ms", "dispatch_ns_per_kernel", "torch_ms", "ort_ms",
                 "tuned_vs_torch", "tuned_vs_torch_pairwise", "tuned_vs_ort", "tuned_vs_ort_pairwise",
                 "compiled_vs_ort", "tuned_vs_plain",
                 "default_vs_torch", "est_latency_ms", "est_vs_measured", "est_vs_compiled", "pairs_ok"])
    for r in rows:
        print(f"{r['network']} per task, inside each network (ORT's own profile; its nodes in no task: "
              f"{r['ort_unmapped_ms']:.3f} ms a run):")
        print_table(layer_rows(r), ["task", "calls", "ours_ms", "ort_ms", "ours_over_ort", "lost_ms_per_run"])
    if any("rr_trials" in r for r in rows):
        print_table(rows, ["network", "gradient_final_objective_ms", "rr_final_objective_ms", "rr_trials",
                           "gradient_trials_to_rr_final"])
    print("ratios: <ours>_vs_<ref> = median ref ms / median ours ms over the pairs (recomputable from the "
          "ms columns); _pairwise = the median of the per-pair ratios")
    return 0
