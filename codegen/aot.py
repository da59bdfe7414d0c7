"""Ahead-of-time network module: every task's kernel and a driver in one LLVM module, one shared library.

`compile_network` writes, into one folder:

- `<name>.so`: one object file emitted by LLVM from one module (each task's kernel, built from its best
  record or the default schedule, plus a generated driver), linked by the system compiler
  (`cc -shared ... -lgomp -lm`). The driver calls the kernels in the network's execution order over an
  arena planned by liveness (as `network_runtime` plans it: a block is reused once its last reader has
  run, and never by the output of a kernel that reads it); the arena is a zero-initialised global (.bss),
  so a library runs one network at a time per process.
- `<name>.weights.bin`: the constants the kernels read, each in the dtype and C-contiguous layout its
  kernel takes, at 64-byte aligned offsets (the library holds the offsets, the caller the bytes): a
  task's constant weights in the layout its schedule reads them in (schedule.layout_rewrite), as the
  JIT network runtime stores them.
- `manifest.json`: network, target (CPU, features, threads, triple), inputs and outputs, every kernel's
  record (workload key and steps) or "default", the weights file's size, tensortune's version.

The C ABI, `P` being the library's C name (the network name, non-identifier characters as `_`):

    int32_t P_num_inputs(void), P_num_outputs(void);
    const char *P_input_name(int32_t i), *P_input_dtype(int32_t i);     (also P_output_*)
    int32_t P_input_ndim(int32_t i);  const int64_t *P_input_shape(int32_t i);
    int64_t P_weights_size(void);     int32_t P_set_weights(const void *data, int64_t nbytes);
    int32_t P_run(const void **inputs, void **outputs);   /* 0 ok, 1: set_weights not called */
    int32_t P_num_calls(void);        /* kernel calls per run */

Every graph op the runtime executes is a task kernel (extraction makes a task of every op no anchor
absorbed) and reshapes are views, so the network needs no glue code beyond the driver; an output that
is a graph input or a constant, or an output listed twice, is copied (memcpy) at the end of a run.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Mapping

import numpy as np

from tensortune.codegen.alignment import ALIGN
from tensortune.codegen.llvm_backend import compile_module, default_triple
from tensortune.codegen.llvm_codegen import generate_llvm_ir
from tensortune.codegen.lower import LoweringError, lower
from tensortune.codegen.network_runtime import task_schedule
from tensortune.codegen.target import Target, parse_target
from tensortune.schedule.default_schedule import default_schedule
from tensortune.schedule.layout_rewrite import WeightLayout, weight_layouts
from tensortune.schedule.stage import IllegalStep
from tensortune.tasks.extract import NetworkTasks

FORMAT = 1


class AOTError(RuntimeError):
    """The network cannot be built into a library; the message says what and why."""


def c_name(name: str) -> str:
    """A C identifier from a network name ('resnet-18' -> 'resnet_18')."""
    out = re.sub(r"[^A-Za-z0-9_]", "_", name) or "net"
    return out if not out[0].isdigit() else "n_" + out


def tensortune_version() -> str:
    try:
        return metadata.version("tensortune")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class KernelInfo:
    index: int
    name: str
    workload_key: str
    weight: int
    flops: float
    schedule: str                  # "record" | "default" | "default (record failed...)"
    steps: object = None           # the record's steps (JSON) when built from it
    build_seconds: float = 0.0
    layouts: dict[str, WeightLayout] = field(default_factory=dict)   # inputs the kernel takes rewritten


@dataclass
class AOTResult:
    out_dir: str
    library: str
    weights: str
    manifest: str
    kernels: list[KernelInfo] = field(default_factory=list)
    arena_bytes: int = 0
    weights_bytes: int = 0
    seconds: float = 0.0

    @property
    def files(self) -> list[str]:
        return [self.library, self.weights, self.manifest]


# ------------------------------------------------------------------------------------------ planning

@dataclass
class _Plan:
    """Where every value lives: ("input", i) | ("output", j) | ("const", offset) | ("arena", offset)."""
    where: dict[str, tuple[str, int]]
    arena_bytes: int
    consts: dict[str, int]                 # constant root -> offset in the weights blob
    weights_bytes: int
    copies: list[tuple[int, str]]          # (output index, value root) copied at the end of a run
    # rewritten weights: (group index, input index) -> offset, and (constant root, layout) -> offset
    group_consts: dict[tuple[int, int], int] = field(default_factory=dict)
    rewritten: dict[tuple[str, WeightLayout], int] = field(default_factory=dict)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan(net: NetworkTasks, layouts: Mapping[int, Mapping[str, WeightLayout]] | None = None) -> _Plan:
    """Storage of every value; `layouts[task]` names the inputs task's kernel takes rewritten, which
    get their own place in the weights (one per constant and layout)."""
    graph, groups = net.graph, net.groups
    layouts = layouts or {}

    where: dict[str, tuple[str, int]] = {}
    for i, name in enumerate(graph.inputs):
        where[name] = ("input", i)
    produced = {g.output for g in groups}
    copies: list[tuple[int, str]] = []
    for j, name in enumerate(graph.outputs):
        r = net.storage(name)
        if r in produced and r not in where:
            where[r] = ("output", j)
        else:
            copies.append((j, r))
    consts: dict[str, int] = {}
    group_consts: dict[tuple[int, int], int] = {}
    rewritten: dict[tuple[str, WeightLayout], int] = {}
    offset = 0
    for gi, g in enumerate(groups):
        for k, v in enumerate(g.inputs):
            r = net.storage(v)
            lay = layouts.get(g.task, {}).get(net.tasks[g.task].dag.inputs[k].name)
            if r in graph.constants and lay is not None:
                if (r, lay) not in rewritten:
                    rewritten[(r, lay)] = offset
                    offset = _align(offset + math.prod(lay.new_shape) * graph.constants[r].itemsize)
                group_consts[(gi, k)] = rewritten[(r, lay)]
                continue
            if r in graph.constants and r not in consts:
                consts[r] = offset
                where[r] = ("const", offset)
                offset = _align(offset + graph.constants[r].nbytes)
    for _, r in copies:
        if r in graph.constants and r not in consts:
            consts[r] = offset
            where[r] = ("const", offset)
            offset = _align(offset + graph.constants[r].nbytes)
    last_use: dict[str, int] = {}
    for i, g in enumerate(groups):
        for v in g.inputs:
            last_use[net.storage(v)] = i
    free: list[tuple[int, int]] = []           # (offset, size)
    top = 0
    live: dict[str, tuple[int, int]] = {}
    for i, g in enumerate(groups):
        if g.output not in where:
            nbytes = graph.values[g.output].nbytes
            fits = [k for k, (_, size) in enumerate(free) if size >= nbytes]
            if fits:
                block = free.pop(min(fits, key=lambda k: free[k][1]))
            else:
                block = (top, _align(nbytes))
                top += block[1]
            live[g.output] = block
            where[g.output] = ("arena", block[0])
        for r in {net.storage(v) for v in g.inputs} | {g.output}:
            if r in live and last_use.get(r, i) <= i:
                free.append(live.pop(r))
    missing = [net.storage(v) for gi, g in enumerate(groups) for k, v in enumerate(g.inputs)
               if net.storage(v) not in where and (gi, k) not in group_consts]
    if missing:
        raise AOTError(f"no storage for value(s) {sorted(set(missing))}: not an input, constant or task output")
    return _Plan(where, top, consts, offset, copies, group_consts, rewritten)


# ------------------------------------------------------------------------------------------- driver IR

def _c_string(text: str) -> tuple[str, int]:
    data = text.encode() + b"\0"
    body = "".join(chr(b) if 32 <= b < 127 and chr(b) not in '"\\' else f"\\{b:02X}" for b in data)
    return f'c"{body}"', len(data)


def _table_functions(p: str, kind: str, infos: list[tuple[str, tuple[int, ...], str]]) -> list[str]:
    """P_<kind>_name/dtype/ndim/shape(i32 i) over constant tables (out of range: null / -1)."""
    lines = []
    n = len(infos)
    for field_ in ("name", "dtype"):
        ptrs = []
        for i, info in enumerate(infos):
            text = info[0] if field_ == "name" else info[2]
            lit, size = _c_string(text)
            lines.append(f"@.{kind}.{field_}.{i} = private unnamed_addr constant [{size} x i8] {lit}")
            ptrs.append(f"ptr @.{kind}.{field_}.{i}")
        lines.append(f"@.{kind}.{field_} = private constant [{n} x ptr] [{', '.join(ptrs)}]")
    shapes = []
    for i, info in enumerate(infos):
        dims = ", ".join(f"i64 {d}" for d in info[1])
        lines.append(f"@.{kind}.shape.{i} = private constant [{len(info[1])} x i64] [{dims}]")
        shapes.append(f"ptr @.{kind}.shape.{i}")
    lines.append(f"@.{kind}.shape = private constant [{n} x ptr] [{', '.join(shapes)}]")
    ndims = ", ".join(f"i32 {len(info[1])}" for info in infos)
    lines.append(f"@.{kind}.ndim = private constant [{n} x i32] [{ndims}]")

    def getter(fname: str, table: str, ty: str, bad: str) -> str:
        return (f"define {ty} @{p}_{kind}_{fname}(i32 %i) {{\nentry:\n"
                f"  %ok = icmp ult i32 %i, {n}\n  br i1 %ok, label %get, label %bad\n"
                f"get:\n  %j = zext i32 %i to i64\n"
                f"  %a = getelementptr [{n} x {ty}], ptr @.{kind}.{table}, i64 0, i64 %j\n"
                f"  %v = load {ty}, ptr %a\n  ret {ty} %v\nbad:\n  ret {ty} {bad}\n}}")
    lines += [getter("name", "name", "ptr", "null"), getter("dtype", "dtype", "ptr", "null"),
              getter("shape", "shape", "ptr", "null"), getter("ndim", "ndim", "i32", "-1")]
    return lines


def driver_ir(net: NetworkTasks, pl: _Plan, p: str, kernel_names: list[str],
              kernel_arity: list[int], stub_kernels: bool = False) -> str:
    """The driver and query functions; the kernels are declared (or, with `stub_kernels`, defined as
    empty non-inlined functions behind a memory barrier, to measure the driver's own cost)."""
    graph = net.graph

    ins = [(k, tuple(v.shape), v.dtype) for k, v in graph.inputs.items()]
    outs = [(k, tuple(graph.values[k].shape), graph.values[k].dtype) for k in graph.outputs]
    lines = ["@.weights = internal global ptr null, align 8",
             f"@.arena = internal global [{max(pl.arena_bytes, ALIGN)} x i8] zeroinitializer, align {ALIGN}",
             "declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)"]
    for k in sorted(set(kernel_names)):
        n = kernel_arity[kernel_names.index(k)]
        params = ", ".join(["ptr"] * n)
        lines.append(f"declare void @{k}({params})" if not stub_kernels else
                     f'define void @{k}({params}) noinline {{\n  call void asm sideeffect "", "~{{memory}}"()\n'
                     "  ret void\n}")
    lines += _table_functions(p, "input", ins) + _table_functions(p, "output", outs)
    const = lambda ty, name, v: f"define {ty} @{p}_{name}() {{\n  ret {ty} {v}\n}}"  # noqa: E731
    lines += [const("i32", "num_inputs", len(ins)), const("i32", "num_outputs", len(outs)),
              const("i64", "weights_size", pl.weights_bytes), const("i64", "workspace_size", pl.arena_bytes),
              const("i32", "num_calls", len(net.groups)),
              f"define i32 @{p}_set_weights(ptr %data, i64 %n) {{\nentry:\n"
              f"  %ok = icmp eq i64 %n, {pl.weights_bytes}\n  br i1 %ok, label %set, label %bad\n"
              f"set:\n  store ptr %data, ptr @.weights\n  ret i32 0\nbad:\n  ret i32 2\n}}"]
    body = ["entry:", "  %w = load ptr, ptr @.weights", "  %nw = icmp eq ptr %w, null"
            if pl.weights_bytes else "  %nw = icmp eq i1 0, 1",
            "  br i1 %nw, label %noweights, label %go", "noweights:", "  ret i32 1", "go:"]
    for i in range(len(ins)):
        body += [f"  %in{i}.a = getelementptr ptr, ptr %inputs, i64 {i}", f"  %in{i} = load ptr, ptr %in{i}.a"]
    for j in range(len(outs)):
        body += [f"  %out{j}.a = getelementptr ptr, ptr %outputs, i64 {j}", f"  %out{j} = load ptr, ptr %out{j}.a"]
    tmp = iter(range(1 << 30))

    def pointer(value: str, place: tuple[int, int] | None = None) -> str:
        kind, at = ("const", pl.group_consts[place]) if place in pl.group_consts else pl.where[net.storage(value)]
        if kind == "input":
            return f"%in{at}"
        if kind == "output":
            return f"%out{at}"
        name = f"%v{next(tmp)}"
        base = "%w" if kind == "const" else "@.arena"
        body.append(f"  {name} = getelementptr i8, ptr {base}, i64 {at}")
        return name

    for gi, (g, k) in enumerate(zip(net.groups, (kernel_names[g.task] for g in net.groups))):
        args = [pointer(v, (gi, j)) for j, v in enumerate(g.inputs)] + [pointer(g.output)]
        body.append(f"  call void @{k}({', '.join('ptr ' + a for a in args)})")
    for j, r in pl.copies:
        body.append(f"  call void @llvm.memcpy.p0.p0.i64(ptr %out{j}, ptr {pointer(r)}, "
                    f"i64 {graph.values[graph.outputs[j]].nbytes}, i1 0)")
    body.append("  ret i32 0")
    lines.append(f"define i32 @{p}_run(ptr %inputs, ptr %outputs) {{\n" + "\n".join(body) + "\n}")
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------- build

def _kernel_ir(net: NetworkTasks, i: int, steps, target: Target, name: str) -> tuple[str, KernelInfo, int]:
    task = net.tasks[i]
    t0 = time.perf_counter()
    state, source = task_schedule(task, steps)
    try:
        layouts = weight_layouts(state, task.layout_free)
        func = lower(state, name=name, target_kind="cpu", layouts=layouts)
    except (LoweringError, IllegalStep, ValueError) as err:
        if source != "record":
            raise AOTError(f"task {i} ({task.name}): the default schedule does not lower: {err}") from err
        source = f"default (record failed to lower: {str(err)[:120]})"
        state = default_schedule(task.dag)
        layouts = weight_layouts(state, task.layout_free)
        func = lower(state, name=name, target_kind="cpu", layouts=layouts)
    ir = generate_llvm_ir(func, target.cpu, target.features, target.num_threads)
    info = KernelInfo(i, task.name, task.workload_key, task.weight, task.flops, source,
                      json.loads(steps) if source == "record" and isinstance(steps, str) else
                      (steps if source == "record" else None), time.perf_counter() - t0, layouts)
    return ir, info, len(func.args)


def _link(obj: bytes, lib: str, cc: str | None = None) -> None:
    """Link one object file into the shared library `lib` with the system C compiler (libgomp, libm)."""
    with tempfile.TemporaryDirectory() as tmp:
        obj_path = os.path.join(tmp, "module.o")
        with open(obj_path, "wb") as f:
            f.write(obj)
        cmd = [cc or os.environ.get("CC", "cc"), "-shared", "-o", lib + ".tmp", obj_path, "-lgomp", "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as err:
            raise AOTError(f"cannot run the C compiler to link ({' '.join(cmd)}): {err}") from err
        if done.returncode != 0:
            raise AOTError(f"linking failed ({' '.join(cmd)}): {done.stderr.strip()[:2000]}")
    os.replace(lib + ".tmp", lib)


def dispatch_overhead(net: NetworkTasks, target: str | Target = "llvm", runs: int = 2000,
                      cc: str | None = None) -> float:
    """Seconds the driver spends per kernel call, measured on the network's own driver with every
    kernel replaced by an empty, non-inlined function (a memory barrier keeps the calls): the time of
    a run divided by its calls. The ctypes call of each run counts too, so this is an upper bound."""
    t = parse_target(target)
    p = c_name(net.source.name) + "_stub"
    pl = plan(net)
    names = [f"{p}_k{i}" for i in range(len(net.tasks))]
    arity = [len(net.tasks[i].dag.inputs) + len(net.tasks[i].dag.outputs) for i in range(len(net.tasks))]
    ir = driver_ir(net, pl, p, names, arity, stub_kernels=True)
    with tempfile.TemporaryDirectory() as tmp:
        lib = os.path.join(tmp, f"{p}.so")
        _link(compile_module([ir], t), lib, cc)
        so = ctypes.CDLL(lib)
        weights = np.zeros(max(1, pl.weights_bytes), np.uint8)
        so[f"{p}_set_weights"](ctypes.c_void_p(weights.ctypes.data), ctypes.c_int64(pl.weights_bytes))
        run = so[f"{p}_run"]
        run.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        graph = net.graph
        arrays = [np.zeros(v.shape, v.dtype) for v in graph.inputs.values()]
        outputs = [np.zeros(graph.values[k].shape, graph.values[k].dtype) for k in graph.outputs]
        ins = (ctypes.c_void_p * max(1, len(arrays)))(*(a.ctypes.data for a in arrays))
        outs = (ctypes.c_void_p * max(1, len(outputs)))(*(a.ctypes.data for a in outputs))
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(runs):
                run(ins, outs)
            best = min(best, (time.perf_counter() - t0) / runs)
    return best / max(1, len(net.groups))


def compile_network(net: NetworkTasks, records: Mapping[str, str | list | None] | None, out_dir: str,
                    target: str | Target = "llvm", name: str | None = None, cc: str | None = None,
                    extra: Mapping | None = None) -> AOTResult:
    """Build the network into `out_dir` (library, weights, manifest); see the module docstring."""
    t_start = time.perf_counter()
    t = parse_target(target)
    if t.kind != "llvm":
        raise AOTError(f"a compiled library is for CPUs only (an llvm target), got {target!s}")
    records = records or {}
    p = c_name(name or net.source.name)
    os.makedirs(out_dir, exist_ok=True)
    irs, kernels, names, arity = [], [], [], []
    for i in range(len(net.tasks)):
        kname = f"{p}_k{i}"
        ir, info, n = _kernel_ir(net, i, records.get(net.tasks[i].workload_key), t, kname)
        irs.append(ir)
        kernels.append(info)
        names.append(kname)
        arity.append(n)
    pl = plan(net, {k.index: k.layouts for k in kernels})
    driver = driver_ir(net, pl, p, names, arity)
    lib = os.path.join(out_dir, f"{p}.so")
    _link(compile_module([driver, *irs], t), lib, cc)
    weights = os.path.join(out_dir, f"{p}.weights.bin")
    blob = np.zeros(pl.weights_bytes, dtype=np.uint8)
    for r, off in pl.consts.items():
        arr = np.ascontiguousarray(net.graph.constants[r])
        blob[off: off + arr.nbytes] = np.frombuffer(arr.tobytes(), dtype=np.uint8)
    for (r, lay), off in pl.rewritten.items():
        arr = lay.transform(net.graph.constants[r].reshape(lay.shape))
        blob[off: off + arr.nbytes] = np.frombuffer(arr.tobytes(), dtype=np.uint8)
    blob.tofile(weights)
    graph = net.graph
    manifest = {
        "format": FORMAT,
        "name": p,
        "network": net.source.name,
        "library": os.path.basename(lib),
        "weights": os.path.basename(weights),
        "weights_bytes": pl.weights_bytes,
        "workspace_bytes": pl.arena_bytes,
        "target": {"string": str(t), "cpu": t.cpu, "features": t.features, "threads": t.num_threads,
                   "triple": default_triple()},
        "inputs": [{"name": k, "shape": list(v.shape), "dtype": v.dtype} for k, v in graph.inputs.items()],
        "outputs": [{"name": k, "shape": list(graph.values[k].shape), "dtype": graph.values[k].dtype}
                    for k in graph.outputs],
        "calls": len(net.groups),
        "kernels": [{"index": k.index, "name": k.name, "symbol": names[k.index], "workload_key": k.workload_key,
                     "weight": k.weight, "flops": k.flops,
                     "schedule": k.schedule, "steps": k.steps,
                     "layouts": [lay.to_json() for lay in k.layouts.values()]} for k in kernels],
        "tensortune_version": tensortune_version(),
        **(dict(extra) if extra else {}),
    }
    man = os.path.join(out_dir, "manifest.json")
    with open(man + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(man + ".tmp", man)
    return AOTResult(out_dir, lib, weights, man, kernels, pl.arena_bytes, pl.weights_bytes,
                     time.perf_counter() - t_start)
