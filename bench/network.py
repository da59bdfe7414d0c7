"""`python -m bench network NETWORK`: whole networks, default schedules vs tuned vs PyTorch CPU eager.

Extracts the network's tasks, tunes them with the gradient task scheduler (and, at the same number of
trials, from the same warm-up and taking turns with it round by round, with round-robin), builds the
network from the best records, checks it against the graph's NumPy reference and times it end to end.
PyTorch runs the same architecture written by hand with torch.nn (torchvision does not import beside
the CPU torch wheel), eager, with the same thread count.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from bench.common import ensure_clean_blas_env, paired_ms, print_table, torch_threads, write_json

NETWORK_OPTIONS = {
    "resnet-18": {},
    "mobilenet-v2": {},
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

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 64, 7, 2, 3)
            layers, cin = [], 64
            for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                layers += [Basic(cin, cout, stride), Basic(cout, cout, 1)]
                cin = cout
            self.layers = nn.Sequential(*layers)
            self.fc = nn.Linear(512, 1000)

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

    if name == "resnet-18":
        return ResNet18().eval(), torch.randn(1, 3, 224, 224)
    if name == "mobilenet-v2":
        return MobileNetV2().eval(), torch.randn(1, 3, 224, 224)
    if name == "bert-base":
        return Bert(options.get("num_layers", 1)).eval(), torch.randint(0, 30522, (1, options.get("seq_len", 128)))
    raise ValueError(f"no PyTorch model for {name}")


def torch_fn(name: str, threads: int, options: dict):
    """The PyTorch model's forward pass on a random input (None when torch is not installed)."""
    torch = torch_threads(threads)
    if torch is None:
        return None
    model, x = torch_model(name, torch, options)

    def forward():
        with torch.no_grad():
            return model(x)
    return forward


# ---------------------------------------------------------------------------------- tensortune

def tune(name: str, trials: int, strategies: list[str], seed: int, options: dict, measurer,
         records: str | None = None) -> tuple:
    """(network, tasks, {strategy: (result, seconds)}). The warm-up (a round per task) runs once; each
    strategy resumes from a copy of its records, so all start from the same programs, cost model and
    bests, and they take turns, one round each, on one measurer, so that this VM's drift (which moved
    a task's timings by 30% within minutes) hits them alike. Curves and times include the warm-up."""
    from flows.tuning import NetworkTuner, network_tasks
    from storage.records import RecordStore
    net, tasks = network_tasks(name, "llvm", **options)
    home = records or tempfile.mkdtemp(prefix="tensortune-bench-network-")

    def tuner(label: str, budget: int, strategy: str = "round-robin") -> NetworkTuner:
        return NetworkTuner(tasks, budget, measurer, strategy=strategy, seed=seed, network_name=name,
                            records=RecordStore(os.path.join(home, label)),
                            progress=lambda i, log, r: print(
                                f"  {name} [{label}] {r.trials}/{budget} trials, task {i} best "
                                f"{log.best_gflops:.1f} GFLOP/s, est. {r.estimated_latency * 1e3:.2f} ms", flush=True))
    t0 = time.perf_counter()
    warm = tuner("warm-up", trials)
    for _ in tasks:
        warm.step()
    warm_s, warm_trials = time.perf_counter() - t0, warm.result.trials
    tuners = {}
    for s in strategies:
        shutil.copytree(os.path.join(home, "warm-up"), os.path.join(home, s))
        tuners[s] = tuner(s, trials - warm_trials, s)
        tuners[s].per_round = warm.per_round       # the round size of the whole budget, as in one run
    seconds = dict.fromkeys(strategies, warm_s)
    busy = True
    while busy:
        busy = False
        for s, t in tuners.items():
            t0 = time.perf_counter()
            busy |= t.step()
            seconds[s] += time.perf_counter() - t0
    out = {}
    for s, t in tuners.items():
        res = t.result
        res.trials += warm_trials
        res.curve = warm.result.curve + [(n + warm_trials, obj) for n, obj in res.curve]
        out[s] = (res, seconds[s])
    if records is None:
        shutil.rmtree(home, ignore_errors=True)
    return net, tasks, out


def compiled_network(net, records: dict | None):
    """(the network built from these records, whether it matches the graph's NumPy reference)."""
    from codegen.network_runtime import build_network
    compiled = build_network(net, records)
    return compiled, compiled.check().passed


def trials_to_reach(curve, target: float) -> int | None:
    for t, obj in curve:
        if obj <= target * (1 + 1e-9):
            return t
    return None


def main(argv: list[str]) -> int:
    ensure_clean_blas_env()
    ap = argparse.ArgumentParser(prog="python -m bench network")
    ap.add_argument("networks", nargs="*", default=["resnet-18"])
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-round-robin", action="store_true", help="skip the round-robin comparison")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--records", metavar="DIR", help="keep the records in DIR/<network>/{warm-up,<strategy>} "
                                                      "(a fresh folder: a stored history would be resumed)")
    args = ap.parse_args(argv)
    from codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
    rows = []
    for name in args.networks:
        options = NETWORK_OPTIONS.get(name, {})
        measurer = ProgramMeasurer(LocalBuilder(), LocalRunner())
        strategies = ["gradient"] + ([] if args.no_round_robin else ["round-robin"])
        net, tasks, runs = tune(name, args.trials, strategies, args.seed, options, measurer,
                                os.path.join(args.records, name) if args.records else None)
        measurer.close()
        grad, wall = runs["gradient"]
        default, ok_default = compiled_network(net, None)
        best = {t.workload_key: s for t, s in zip(tasks, grad.best_steps) if s}
        tuned, ok_tuned = compiled_network(net, best)
        # default, tuned and PyTorch timed in turn (bench.common.paired_ms), medians of five
        forward = torch_fn(name, args.threads, options)
        timed = {}
        for label, compiled in (("default", default), ("tuned", tuned)):
            ours = lambda c=compiled: c.benchmark(repeat=5).median_ms   # noqa: E731
            timed[label] = paired_ms(forward, ours) if forward is not None else (float("nan"), ours(), float("nan"))
        row = {"network": name, "tasks": len(tasks), "trials": grad.trials, "default_ms": timed["default"][1],
               "tuned_ms": timed["tuned"][1], "torch_ms": timed["tuned"][0],
               "checked": ok_default and ok_tuned, "tune_wall_s": wall,
               "est_latency_ms": grad.estimated_latency * 1e3, "gradient_curve": grad.curve,
               "task_best_ms": [c * 1e3 for c in grad.best_costs],
               # where the tuned network spends its time, per task (all its calls), against weight x best
               "task_in_network_ms": [v * 1e3 for v in tuned.profile(repeat=5).values()]}
        row["speedup_vs_torch"] = timed["tuned"][2]
        row["default_vs_torch"] = timed["default"][2]
        if "round-robin" in runs:
            rr, rr_wall = runs["round-robin"]
            target = rr.curve[-1][1]
            reached = trials_to_reach(grad.curve, target)
            row["rr_final_objective_ms"] = target * 1e3
            row["gradient_final_objective_ms"] = grad.curve[-1][1] * 1e3
            row["rr_trials"] = rr.trials
            row["rr_wall_s"] = rr_wall
            row["gradient_trials_to_rr_final"] = reached
            row["gradient_needs_fewer_trials"] = reached is not None and reached < rr.trials
            row["rr_curve"] = rr.curve
            row["rr_task_best_ms"] = [c * 1e3 for c in rr.best_costs]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("curve")}), flush=True)
    print_table(rows, ["network", "tasks", "trials", "default_ms", "tuned_ms", "torch_ms", "default_vs_torch",
                       "speedup_vs_torch", "checked", "gradient_final_objective_ms", "rr_final_objective_ms",
                       "rr_trials", "gradient_trials_to_rr_final"])
    write_json(args.json, rows)
    return 0
