"""`tensortune extract` and `tensortune run-network`: a network's tuning tasks, and the network run end to end."""
from __future__ import annotations

import os
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console
from rich.table import Table

from flows.cli import app
from tasks.graph import Graph, GraphError
from tasks.models import make_network, network_names
from tasks.extract import ExtractError, NetworkTasks, extract_tasks

NetworkArg = Annotated[str, typer.Argument(
    help=f"A network ({', '.join(network_names())}) or the path of an .onnx model.")]
BatchOption = Annotated[Optional[int], typer.Option("--batch", min=1, help="Batch size (default 1).")]
SeqLenOption = Annotated[Optional[int], typer.Option("--seq-len", min=1, help="BERT: sequence length.")]
LayersOption = Annotated[Optional[int], typer.Option("--layers", min=1, help="BERT: encoder layers.")]
ImageSizeOption = Annotated[Optional[int], typer.Option("--image-size", min=1,
                                                        help="ResNet/MobileNet: input height and width.")]
InputShapeOption = Annotated[Optional[list[str]], typer.Option(
    "--input-shape", help="ONNX: NAME=D0,D1,... for an input with symbolic dimensions (repeatable).")]
TargetOption = Annotated[str, typer.Option("--target", help="Target the tasks are for ('llvm' = this CPU).")]


def load_graph(network: str, batch: int | None = None, seq_len: int | None = None, layers: int | None = None,
               image_size: int | None = None, input_shapes: list[str] | None = None) -> Graph:
    """A registered network built with the given sizes, or an imported ONNX file."""
    if network.endswith(".onnx") or os.path.sep in network:
        from tasks.onnx_import import import_onnx
        given = {k: v for k, v in (("--batch", batch), ("--seq-len", seq_len), ("--layers", layers),
                                   ("--image-size", image_size)) if v is not None}
        if given:
            raise GraphError(f"{', '.join(given)} apply to built-in networks; for an ONNX model pass "
                             f"--input-shape NAME=D0,D1,...")
        return import_onnx(network, _parse_shapes(input_shapes or []))
    options = {k: v for k, v in (("batch_size", batch), ("seq_len", seq_len), ("num_layers", layers),
                                 ("image_size", image_size)) if v is not None}
    return make_network(network, **options)


def _parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    out = {}
    for item in items:
        name, sep, dims = item.partition("=")
        try:
            out[name] = tuple(int(d) for d in dims.replace("x", ",").split(","))
        except ValueError:
            sep = ""
        if not sep or not name:
            raise GraphError(f"--input-shape {item!r}: write NAME=D0,D1,... (e.g. input=1,3,224,224)")
    return out


def _load(network: str, **kw) -> Graph:
    try:
        return load_graph(network, **kw)
    except (GraphError, ValueError, TypeError) as err:
        _fail(str(err))


def _extract(graph: Graph) -> NetworkTasks:
    try:
        return extract_tasks(graph)
    except (ExtractError, GraphError) as err:
        _fail(str(err))


def _fail(message: str) -> NoReturn:
    Console(stderr=True).print(f"[red]error:[/red] {message}", markup=True, highlight=False)
    raise typer.Exit(code=1)


@app.command("extract")
def extract(network: NetworkArg, batch: BatchOption = None, seq_len: SeqLenOption = None,
            layers: LayersOption = None, image_size: ImageSizeOption = None,
            input_shape: InputShapeOption = None, target: TargetOption = "llvm") -> None:
    """The network's tuning tasks: fused subgraphs deduplicated by workload key, with weights and FLOPs."""
    from codegen.target import TargetError, make_task
    graph = _load(network, batch=batch, seq_len=seq_len, layers=layers, image_size=image_size,
                  input_shapes=input_shape)
    net = _extract(graph)
    try:
        tasks = [make_task(t.dag, target, t.name, t.weight) for t in net.tasks]
    except TargetError as err:
        _fail(str(err))
    table = Table(title=f"{graph.name}: {len(tasks)} tasks from {len(net.groups)} subgraphs "
                        f"({tasks[0].target if tasks else target})")
    for header in ("#", "task", "weight", "output", "MFLOP", "weighted GFLOP", "workload key"):
        table.add_column(header, justify="right" if header in ("#", "weight", "MFLOP", "weighted GFLOP") else "left")
    for i, (t, row) in enumerate(zip(tasks, net.table())):
        table.add_row(str(i), t.name, str(t.weight), "x".join(map(str, row["output"])), f"{row['flops'] / 1e6:,.2f}",
                      f"{row['weighted_flops'] / 1e9:,.3f}", t.workload_key)
    console = Console(width=max(120, Console().width))
    console.print(table)
    console.print(f"total: {net.total_flops / 1e9:,.3f} GFLOP per run, {sum(t.weight for t in tasks)} kernel calls")


def best_records(path: str, target: str = "llvm") -> dict[str, str]:
    """workload_key -> steps JSON of the fastest record for this target's CPU in the record store."""
    from codegen.target import parse_target
    from storage.records import RecordStore
    frame = RecordStore(path, auto_compact=None).best_per_task()
    if frame.empty:
        return {}
    want = parse_target(target)

    def same(t: str) -> bool:
        try:
            got = parse_target(t)
        except ValueError:
            return False
        return got.kind == want.kind and got.cpu == want.cpu

    frame = frame[frame["target"].map(same)].sort_values("mean_latency", kind="stable")
    return {row["workload_key"]: row["steps"] for row in frame.drop_duplicates("workload_key").to_dict("records")}


@app.command("run-network")
def run_network(network: NetworkArg,
                records: Annotated[Optional[str], typer.Option(
                    "--records", envvar="TENSORTUNE_RECORDS",
                    help="Record store to take each task's best schedule from (default schedules without).")]
                = None,
                batch: BatchOption = None, seq_len: SeqLenOption = None, layers: LayersOption = None,
                image_size: ImageSizeOption = None, input_shape: InputShapeOption = None,
                repeat: Annotated[int, typer.Option("--repeat", min=1, help="Timed runs.")] = 10,
                target: TargetOption = "llvm",
                check: Annotated[bool, typer.Option("--check/--no-check",
                                                    help="Compare the outputs with the NumPy reference.")] = True,
                ) -> None:
    """Compile every task (best record, else a default schedule), run the network end to end, print latency."""
    from codegen.network_runtime import build_network
    graph = _load(network, batch=batch, seq_len=seq_len, layers=layers, image_size=image_size,
                  input_shapes=input_shape)
    net = _extract(graph)
    best: dict[str, str] = {}
    if records:
        try:
            best = best_records(records, target)
        except (OSError, ValueError) as err:
            _fail(f"cannot read records from {records}: {err}")
    console = Console(width=max(120, Console().width))
    try:
        compiled = build_network(net, best, target)
    except ValueError as err:
        _fail(str(err))
    per_task = compiled.profile(repeat=1)
    table = Table(title=f"{graph.name}: {len(net.tasks)} tasks")
    for header in ("#", "task", "weight", "MFLOP", "ms per run", "schedule"):
        table.add_column(header)
    for i, k in enumerate(compiled.kernels):
        table.add_row(str(i), k.name, str(k.weight), f"{k.flops / 1e6:,.2f}", f"{per_task[i] * 1e3:.3f}", k.source)
    console.print(table)
    if check:
        result = compiled.check()
        console.print(f"check against the NumPy reference: {result}")
        if not result.passed:
            raise typer.Exit(code=2)
    lat = compiled.benchmark(repeat=repeat)
    tuned = sum(k.source == "record" for k in compiled.kernels)
    console.print(f"latency: {lat.mean_ms:.3f} ms mean, {lat.median_ms:.3f} ms median, {lat.std_ms:.3f} ms std "
                  f"over {repeat} runs ({net.total_flops / 1e9:.3f} GFLOP, "
                  f"{net.total_flops / max(lat.median_ms, 1e-9) / 1e6:.1f} GFLOP/s; {tuned}/{len(compiled.kernels)} "
                  f"tasks from records)")
