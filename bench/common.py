"""What every benchmark needs: one timing protocol, paired comparisons, matched threads, the machine's
peak, a record of where and how it ran, tables.

The timing protocol (`measure`): a warm-up call, then the number of calls per batch is raised until a
batch lasts at least `min_batch_ms`; `batches` batches of that many calls are timed and the result is
the median of the batches' per-call means. Every side timed in this process — our kernels or network as
a callable, NumPy, PyTorch, ONNX Runtime — goes through it. The only other timings are our kernels in
the tuner's isolated runner (`codegen.measure.LocalRunner` with `RUNNER_TIMING`: the same protocol, run
in the runner process: number raised until a repeat lasts `min_repeat_ms`, median of `repeat` repeats)
and, for the GPU, CUDA events in `cuda_clock` / the CUDA runner (same protocol, a GPU clock).

Sides are compared in pairs (`compare`): each pair times every side once, even pairs in one order and
odd pairs in the reverse order, so each side goes first equally often (this VM's speed drifts by tens
of percent within minutes; sides timed in turn share its weather). A row reports each side's median
over the pairs, the ratio of those medians (recomputable from the printed milliseconds) and the median
of the per-pair ratios. A pair in which a side fails (raises, returns NaN or a non-positive time) is
counted and reported, and left out of every median.

Threads (`limit_threads`): `--threads N` is the thread count of every side: our kernels are compiled for
`llvm -num-threads=N`, PyTorch gets torch.set_num_threads(N), ONNX Runtime intra_op_num_threads=N,
OpenBLAS (numpy) threadpoolctl's limit N; `threads_used` records what each actually reports.

OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE (which slow OpenBLAS here) are removed by re-executing the
benchmark before numpy is loaded.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from tensortune.bench.host_noise import describe, lost_cpu_fraction

BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MIN_BATCH_MS = 200.0     # a batch lasts at least this long
BATCHES = 3              # batches per timing; the timing is their median
PAIRS = 6                # pairs per comparison (even: each side goes first in half of them)


def ensure_clean_blas_env() -> None:
    """Re-exec without the variables that slow OpenBLAS (they only take effect at library load)."""
    if any(v in os.environ for v in BLAS_ENV):
        env = {k: v for k, v in os.environ.items() if k not in BLAS_ENV}
        os.execve(sys.executable, [sys.executable, "-m", "bench"] + sys.argv[1:], env)


# ---------------------------------------------------------------------------------- the timing protocol

Clock = Callable[[Callable[[], object], int], float]     # (fn, number) -> seconds for `number` calls


def _perf_clock(fn: Callable[[], object], number: int) -> float:
    """Host wall time of `number` calls of fn."""
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return time.perf_counter() - t0


def cuda_clock(torch) -> Clock:
    """A clock of CUDA events on the current stream: GPU time of `number` calls of fn."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def clock(fn: Callable[[], object], number: int) -> float:
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return clock


@dataclass
class Timing:
    ms: float                     # median over the batches of the mean milliseconds per call
    batch_ms: list[float]         # each batch's mean milliseconds per call
    number: int                   # calls per batch


def measure(fn: Callable[[], object], *, min_batch_ms: float = MIN_BATCH_MS, batches: int = BATCHES,
            clock: Clock | None = None) -> Timing:
    """THE timing protocol (module docstring): median of `batches` batches of >= `min_batch_ms` each."""
    clock = clock or _perf_clock
    clock(fn, 1)                                   # warm-up: first-call costs are not timed
    number = 1
    while True:                                    # raise `number` until a batch lasts min_batch_ms
        secs = clock(fn, number)
        if secs * 1e3 >= min_batch_ms:
            break
        number = max(number + 1, math.ceil(number * 1.1 * min_batch_ms / max(secs * 1e3, 1e-6)))
    samples = [clock(fn, number) * 1e3 / number for _ in range(batches)]
    return Timing(statistics.median(samples), samples, number)


def in_process(fn: Callable[[], object], **protocol) -> Callable[[], float]:
    """A side for `compare`: fn timed in this process by `measure`, in milliseconds per call."""
    return lambda: measure(fn, **protocol).ms


# ---------------------------------------------------------------------------------- paired comparison

@dataclass
class Pair:
    order: tuple[str, ...]                          # the order the sides were timed in
    ms: dict[str, float]                            # what each side timed (up to a failure)
    error: str | None = None                        # the failure that leaves this pair out


@dataclass
class Ratio:
    median_of_ratios: float      # median over the pairs of num_ms / den_ms
    ratio_of_medians: float      # median(num_ms) / median(den_ms): recomputable from the printed ms


@dataclass
class Comparison:
    sides: tuple[str, ...]
    pairs: list[Pair] = field(default_factory=list)

    @property
    def ok(self) -> list[Pair]:
        return [p for p in self.pairs if p.error is None]

    @property
    def failed(self) -> int:
        return len(self.pairs) - len(self.ok)

    @property
    def errors(self) -> list[str]:
        return [p.error for p in self.pairs if p.error is not None]

    def median_ms(self, side: str) -> float | None:
        """The side's median over the pairs that did not fail (None when all failed)."""
        ok = self.ok
        return statistics.median(p.ms[side] for p in ok) if ok else None

    def ratio(self, num: str, den: str) -> Ratio | None:
        """num's time over den's (e.g. ratio("torch", "tuned"): how many times faster tuned is)."""
        ok = self.ok
        if not ok:
            return None
        return Ratio(statistics.median(p.ms[num] / p.ms[den] for p in ok),
                     self.median_ms(num) / self.median_ms(den))

    def fields(self, ours: str | Sequence[str] = (), refs: Sequence[str] = ()) -> dict:
        """Row fields: `<side>_ms` for every side; for each of ours against each ref `<ours>_vs_<ref>`
        (ratio of medians, ref_ms / ours_ms) and `<ours>_vs_<ref>_pairwise` (median of the per-pair
        ratios); pairs, failed pairs and their errors, and every pair's timings in order."""
        ours = [ours] if isinstance(ours, str) else list(ours)
        out: dict = {f"{s}_ms": self.median_ms(s) for s in self.sides}
        for o in ours:
            for r in refs:
                ratio = self.ratio(r, o)
                out[f"{o}_vs_{r}"] = ratio.ratio_of_medians if ratio else None
                out[f"{o}_vs_{r}_pairwise"] = ratio.median_of_ratios if ratio else None
        out.update({"pairs": len(self.pairs), "failed_pairs": self.failed, "pair_errors": self.errors,
                    "pair_timings": [{"order": list(p.order), "ms": p.ms, "error": p.error} for p in self.pairs]})
        return out


def compare(sides: Mapping[str, Callable[[], float]], pairs: int = PAIRS) -> Comparison:
    """Time every side once per pair, in the given order in even pairs and reversed in odd ones. Each
    side is a callable returning milliseconds per call under the protocol (`in_process(fn)`, or a runner
    that times the same way). A side that raises or returns NaN / a non-positive time fails its pair:
    the pair's remaining sides are not timed and the pair is left out of every median."""
    names = tuple(sides)
    result = Comparison(names)
    for k in range(pairs):
        order = names if k % 2 == 0 else names[::-1]
        pair = Pair(order, {})
        for name in order:
            try:
                ms = float(sides[name]())
            except Exception as err:  # noqa: BLE001 - a failed side is reported, not fatal
                pair.error = f"{name}: {type(err).__name__}: {str(err)[:300]}"
                break
            if not (math.isfinite(ms) and ms > 0):
                pair.error = f"{name}: timed {ms!r} ms"
                break
            pair.ms[name] = ms
        result.pairs.append(pair)
    return result


# ---------------------------------------------------------------------------------- wall clock

class Stopwatch:
    """Wall seconds of one event (a tuning run, a flow run, a store query, a build): a duration reported
    as such, never a speed compared between sides (that is `compare`'s)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = 0.0

    def __enter__(self) -> "Stopwatch":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start

    @property
    def elapsed(self) -> float:
        """Seconds since start (while running)."""
        return time.perf_counter() - self.start


def missing_folder(option: str, paths: Sequence[str]) -> bool:
    """True, after one error line naming it, where one of `paths` (given as `option`) is not a folder: a
    store a benchmark reads must be there before anything starts."""
    missing = [p for p in paths if not os.path.isdir(p)]
    if missing:
        print(f"error: {option} {missing[0]}: no such folder", file=sys.stderr)
    return bool(missing)


# ---------------------------------------------------------------------------------- threads

def llvm_target(threads: int) -> str:
    """Our kernels' target for `threads` threads (compiled into every parallel loop)."""
    return f"llvm -num-threads={threads}"


@contextlib.contextmanager
def limit_threads(threads: int):
    """OpenBLAS (and any other BLAS numpy or torch loaded) limited to `threads` threads; PyTorch's
    intra-op threads set to `threads` when torch is installed. ONNX Runtime and our kernels take
    theirs from their session options and target (`ort_session`, `llvm_target`)."""
    from threadpoolctl import threadpool_limits
    torch = torch_threads(threads)
    with threadpool_limits(limits=threads, user_api="blas"):
        yield torch


def torch_threads(n: int):
    """PyTorch with n intra-op threads, or None when torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(n)
    return torch


def threads_used(ours_target: str | None = None, ort_session=None) -> dict:
    """What each side reports it runs on, read back (not what was asked for)."""
    from threadpoolctl import threadpool_info
    out: dict = {"blas": [f"{i['internal_api']} {i.get('version', '')} x{i['num_threads']}"
                          for i in threadpool_info() if i["user_api"] == "blas"]}
    if ours_target is not None:
        from tensortune.codegen.target import parse_target
        out["tensortune"] = parse_target(ours_target).num_threads
    if "torch" in sys.modules:
        out["torch"] = sys.modules["torch"].get_num_threads()
    if ort_session is not None:
        opts = ort_session.get_session_options()
        out["onnxruntime"] = {"intra_op": opts.intra_op_num_threads, "inter_op": opts.inter_op_num_threads,
                              "execution_mode": str(opts.execution_mode),
                              "graph_optimization_level": str(opts.graph_optimization_level)}
    return out


def blas_info() -> str:
    from threadpoolctl import threadpool_info
    libs = [f"{i['internal_api']} {i.get('version', '')} {i.get('architecture', '')} x{i['num_threads']}"
            for i in threadpool_info() if i["user_api"] == "blas"]
    return "; ".join(libs) or "no BLAS found"


# ---------------------------------------------------------------------------------- where and how it ran

def _lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except ImportError:
        return None
    return getattr(mod, "__version__", "unknown")


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("-dirty" if dirty else "")


def environment(threads: int | None = None, peak: bool = True) -> dict:
    """Machine (lscpu model name, LLVM's host CPU, cores), versions, the FMA peak on 1 and `threads`
    threads (measured again where it does not scale with them: PEAK_SCALING_DOUBT, `fma_peak_retries`),
    the command line and the date: what a reader needs to check a result."""
    import llvmlite.binding as llvm
    llvm.initialize_native_target()
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m bench " + shlex.join(sys.argv[1:]),
        "machine": {"cpu_model": _lscpu_model(), "llvm_host_cpu": llvm.get_host_cpu_name(),
                    "cores": os.cpu_count(), "cores_available": affinity},
        "versions": {"python": sys.version.split()[0],
                     **{m: _version(m) for m in ("numpy", "torch", "onnxruntime", "onnx", "llvmlite")},
                     "tensortune_commit": _git_commit()},
        "threads": threads,
        "blas": blas_info(),
    }
    env["host_noise"] = {"start": lost_cpu_fraction(threads or 1)}
    print(describe(env["host_noise"]["start"]), flush=True)
    if peak:
        # the best run is the peak every fraction divides by; the median run says how far this VM's
        # lent vCPUs fall below it meanwhile (docs/performance.md, "The bar on an Intel Xeon VM": 0.83-0.96)
        env["fma_peak_gflops"], env["fma_peak_median_gflops"] = {}, {}
        env["fma_peak_retries"] = 0
        one = 0.0
        for t in sorted({1, threads or 1}):
            runs = fma_peak_runs(t)
            while t > 1 and max(runs) < PEAK_SCALING_DOUBT * t * one and env["fma_peak_retries"] < PEAK_RETRIES:
                env["fma_peak_retries"] += 1
                time.sleep(PEAK_RETRY_GAP_S)
                runs = max(runs, fma_peak_runs(t), key=max)
            one = one or max(runs)
            env["fma_peak_gflops"][str(t)], env["fma_peak_median_gflops"][str(t)] = max(runs), statistics.median(runs)
    return env


def write_json(path: str | None, rows: Sequence[dict], env: dict, **extra) -> None:
    """One JSON document: {"environment": ..., **extra, "rows": [...]}. The host-noise probe runs again
    first, so the file says how quiet the machine was at both ends of the run."""
    if "host_noise" in env:
        env["host_noise"]["end"] = end = lost_cpu_fraction(env["host_noise"]["start"]["threads"])
        print(describe(end), flush=True)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"environment": env, **extra, "rows": list(rows)}, f, indent=1, default=_jsonable)
        print(f"wrote {len(rows)} rows to {path}")


def read_json_rows(path: str) -> list[dict]:
    """The rows of a benchmark's JSON (this format, or the older one JSON object per line)."""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return doc["rows"] if isinstance(doc, dict) and "rows" in doc else [doc]


def _jsonable(v):
    if hasattr(v, "item"):
        return v.item()
    return str(v)


# ---------------------------------------------------------------------------------- the FMA peak

_PEAK_IR = """
declare void @GOMP_parallel(ptr, ptr, i32, i32)
declare VEC @llvm.fma.vWf32(VEC, VEC, VEC)
define void @peak(ptr %out, i64 %iters) #0 {
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%i.next, %loop]
ACC_PHIS
FMAS
  %i.next = add i64 %i, 1
  %c = icmp slt i64 %i.next, %iters
  br i1 %c, label %loop, label %done
done:
SUMS
  store volatile VEC %sum, ptr %out
  ret void
}
define void @peak_body(ptr %d) #0 {
  %buf = alloca VEC, align 64
  %n = load i64, ptr %d
  call void @peak(ptr %buf, i64 %n)
  ret void
}
define void @peak_threads(i64 %iters, i32 %threads) #0 {
  %d = alloca i64
  store i64 %iters, ptr %d
  call void @GOMP_parallel(ptr @peak_body, ptr %d, i32 %threads, i32 0)
  ret void
}
attributes #0 = { nounwind "target-cpu"="CPU" "target-features"="FEATURES" "prefer-vector-width"="BITS" \
"min-legal-vector-width"="BITS" }
"""


# Pause between two runs of the peak loop. Back to back, 20 runs of 5 ms all fell in one slow spell of
# the Zen 4 VM: a 2-thread "peak" of 187 GFLOP/s in a run whose kernels then reached 209-221 (the
# machine's 222-234 otherwise; 2026-11-28). Spread over a second, one spell no longer covers them all.
PEAK_RUN_GAP_S = 0.05


# A peak on t threads below this fraction of t times the one-thread peak is measured again (at most
# PEAK_RETRIES times, PEAK_RETRY_GAP_S apart, keeping the better set of runs): on the Zen 4 VM (2026-11-30)
# all 20 runs on 2 threads once read 117 GFLOP/s, the one-thread figure, a second in which one vCPU was
# the host's, and that run's best kernel re-timed at 213.5, "1.82 of peak". Where two threads share a core's
# FMA units (SMT) the peak does not scale, and the retries only cost their seconds.
PEAK_SCALING_DOUBT = 0.75
PEAK_RETRIES = 3
PEAK_RETRY_GAP_S = 2.0


def fma_peak_runs(threads: int, runs: int = 20, gap_s: float = PEAK_RUN_GAP_S) -> list[float]:
    """GFLOP/s of `runs` short runs of the peak loop (FmaPeakLoop) on `threads` threads, `gap_s` apart.
    The machine's fp32 peak is the best of them (environment's `fma_peak_gflops`): the peak is what the
    machine can do, and other tenants only slow it (a bound, not a speed compared with anything). How
    far the other runs fall below it: their median beside it, and `python -m bench ceiling`."""
    loop = FmaPeakLoop(threads)
    out = []
    for n in range(runs):
        if n:
            time.sleep(gap_s)
        out.append(loop.run())
    return out


def jit_function(ir: str, symbol: str, *argtypes) -> tuple[object, Callable]:
    """(engine, `symbol` as a void ctypes function of `argtypes`): the IR optimised at O3 for this
    machine and loaded into its own MCJIT engine, which must outlive the function."""
    import ctypes

    import llvmlite.binding as llvm

    from tensortune.codegen.llvm_backend import _init, _new_target_machine, compile_ir
    from tensortune.codegen.target import parse_target
    _init()
    target = parse_target("llvm")
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), _new_target_machine(target.cpu, target.features))
    engine.add_object_file(llvm.ObjectFileRef.from_data(compile_ir(ir, target)))
    engine.finalize_object()
    return engine, ctypes.CFUNCTYPE(None, *argtypes)(engine.get_function_address(symbol))


class FmaPeakLoop:
    """Independent chains of native-width FMAs: 16 chains of 16 floats with AVX-512 (32 registers), 12
    of 8 with AVX2 (16 registers), enough to cover two FMA pipes' latency without spilling. Compiled
    for the host and run once on `threads` threads as a warm-up; run() times one more run (about 5 ms)."""
    ITERS = 2_000_000

    def __init__(self, threads: int):
        import ctypes

        from tensortune.codegen.target import parse_target
        target = parse_target("llvm")
        lanes = max(4, target.hardware.vector_unit_bytes // 4)
        n_acc = 16 if lanes >= 16 else 12
        vec = f"<{lanes} x float>"
        phis = "\n".join(f"  %a{k} = phi {vec} [zeroinitializer, %entry], [%f{k}, %loop]" for k in range(n_acc))
        mul = "<" + ", ".join(["float 0x3FF0000020000000"] * lanes) + ">"
        fmas = "\n".join(f"  %f{k} = call {vec} @llvm.fma.v{lanes}f32({vec} %a{k}, {vec} {mul}, {vec} {mul})"
                         for k in range(n_acc))
        sums = f"  %s0 = fadd {vec} %f0, %f1\n" + "\n".join(
            f"  %s{k} = fadd {vec} %s{k - 1}, %f{k + 1}" for k in range(1, n_acc - 1))
        sums += f"\n  %sum = fadd {vec} %s{n_acc - 2}, %f0"
        ir = (_PEAK_IR.replace("ACC_PHIS", phis).replace("FMAS", fmas).replace("SUMS", sums)
              .replace("VEC", vec).replace("vWf32", f"v{lanes}f32").replace("BITS", str(lanes * 32))
              .replace("CPU", target.cpu).replace("FEATURES", target.features))
        self._engine, self._fn = jit_function(ir, "peak_threads", ctypes.c_int64, ctypes.c_int32)
        self.threads, self.flops = threads, self.ITERS * n_acc * lanes * 2 * threads
        self._fn(self.ITERS, threads)

    def run(self) -> float:
        """GFLOP/s of one run."""
        return self.flops / _perf_clock(lambda: self._fn(self.ITERS, self.threads), 1) / 1e9


# ---------------------------------------------------------------------------------- tables

def fmt_ratio(value: float | None, failed: bool = False) -> str:
    """A speedup as printed: 'failed' for a wrong answer, '-' when there is none."""
    if failed:
        return "failed"
    return "-" if value is None else f"{value:.3g}x"


def print_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    def fmt(v) -> str:
        if isinstance(v, float):
            if v != v:
                return "nan"
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "" if v is None else str(v)
    widths = [max([len(c)] + [len(fmt(r.get(c))) for r in rows]) for c in columns]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    text = "\n".join(lines)
    print(text)
    return text
