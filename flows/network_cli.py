"""`tensortune extract` and `tensortune run-network`: a network's tuning tasks, and the network run end to end."""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from tensortune.flows.cli_app import app
from tensortune.flows.cli_input import USAGE, at_least, check_target, fail, open_store
from tensortune.tasks.extract import ExtractError, NetworkTasks, extract_tasks
from tensortune.tasks.graph import Graph
from tensortune.tasks.graph_ops import GraphError
from tensortune.tasks.models import load_graph, network_names
from tensortune.tasks.winograd import TILE_SIZES, parse_tiles

if TYPE_CHECKING:
    from tensortune.storage.records import RecordStore

NetworkArg = Annotated[str, typer.Argument(
    help=f"A network ({', '.join(network_names())}) or the path of an .onnx model.")]
BatchOption = Annotated[Optional[int], typer.Option("--batch", **at_least("--batch", 1),
                                                    help="Batch size (default 1).")]
SeqLenOption = Annotated[Optional[int], typer.Option("--seq-len", **at_least("--seq-len", 1),
                                                     help="BERT: sequence length.")]
LayersOption = Annotated[Optional[int], typer.Option("--layers", **at_least("--layers", 1),
                                                     help="BERT: encoder layers.")]
ImageSizeOption = Annotated[Optional[int], typer.Option("--image-size", **at_least("--image-size", 1),
                                                        help="ResNet/MobileNet: input height and width.")]
InputShapeOption = Annotated[Optional[list[str]], typer.Option(
    "--input-shape", help="ONNX: NAME=D0,D1,... for an input with symbolic dimensions (repeatable).")]
TargetOption = Annotated[str, typer.Option("--target", help="Target the tasks are for ('llvm' = this CPU).")]
RecordsOption = Annotated[Optional[str], typer.Option(
    "--records", envvar="TENSORTUNE_RECORDS",
    help="Record store to take each task's best schedule from (default schedules without).")]
ThreadsOption = Annotated[Optional[int], typer.Option(
    "--threads", **at_least("--threads", 1),
    help="CPU threads every kernel runs on (default: all cores; the target's -num-threads).")]


WinogradOption = Annotated[Optional[str], typer.Option(
    "--winograd", metavar="TILES",
    help="Also the Winograd form F(m x m, 3 x 3) of every 3x3 stride-1 conv, for these m (2, 4; e.g. 4 or "
         "2,4): tuned beside the direct form, the network runs the faster.")]


def winograd_tiles(text: str | None) -> tuple[int, ...]:
    """--winograd "2,4" -> (2, 4); None -> (); a bad value is a usage error."""
    try:
        return parse_tiles(text)
    except ValueError as err:
        fail(str(err), USAGE)


def stored_winograd_tiles(store: RecordStore | None) -> tuple[int, ...]:
    """The Winograd tile sizes a network build extracts: those the store holds records of (task names
    conv2d_winograd_f<m>..., what `tune --winograd` measured), so a build from a store without them
    costs nothing extra (the transformed weights of ResNet-50 take 1.5 s and 190 MB)."""
    if store is None:
        return ()
    names = {str(n) for n in store.read(columns=["task_name"])["task_name"].unique()}
    return tuple(m for m in TILE_SIZES if any(n.startswith(f"conv2d_winograd_f{m}") for n in names))


def with_threads(target: str, threads: int | None) -> str:
    """The target string with `-num-threads=threads` when --threads is given."""
    if threads is None:
        return target
    kept = [p for p in target.split() if not p.startswith(("-num-threads=", "-num-cores="))]
    return " ".join(kept + [f"-num-threads={threads}"])


def load_network(network: str, **kw) -> Graph:
    """The network a command names (a builder or an .onnx file), or one clear error line."""
    try:
        return load_graph(network, **kw)
    except (GraphError, ValueError, TypeError) as err:
        fail(str(err), USAGE)


def _extract(graph: Graph, winograd: tuple[int, ...] = ()) -> NetworkTasks:
    try:
        return extract_tasks(graph, winograd)
    except (ExtractError, GraphError) as err:
        fail(str(err))


@app.command("extract")
def extract(network: NetworkArg, batch: BatchOption = None, seq_len: SeqLenOption = None,
            layers: LayersOption = None, image_size: ImageSizeOption = None,
            input_shape: InputShapeOption = None, target: TargetOption = "llvm",
            winograd: WinogradOption = None) -> None:
    """The network's tuning tasks: fused subgraphs deduplicated by workload key, with weights and FLOPs."""
    from tensortune.codegen.target import TargetError, make_task
    check_target(target)
    graph = load_network(network, batch=batch, seq_len=seq_len, layers=layers, image_size=image_size,
                  input_shapes=input_shape)
    net = _extract(graph, winograd_tiles(winograd))
    try:
        tasks = [make_task(t.dag, target, t.name, t.weight) for t in net.tasks]
    except TargetError as err:
        fail(str(err))
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


@app.command("run-network")
def run_network(network: NetworkArg,
                records: RecordsOption = None,
                batch: BatchOption = None, seq_len: SeqLenOption = None, layers: LayersOption = None,
                image_size: ImageSizeOption = None, input_shape: InputShapeOption = None,
                repeat: Annotated[int, typer.Option("--repeat", **at_least("--repeat", 1),
                                                    help="Timed runs.")] = 10,
                target: TargetOption = "llvm", threads: ThreadsOption = None,
                check: Annotated[bool, typer.Option("--check/--no-check",
                                                    help="Compare the outputs with the NumPy reference.")] = True,
                compiled: Annotated[bool, typer.Option(
                    "--compiled", help="Run the one-library build `tensortune compile` writes (loaded by "
                                       "tensortune.runtime) instead of the Python loop of kernel calls.")] = False,
                ) -> None:
    """Compile every task (best record, else a default schedule), run the network end to end, print latency.

    The network runs on the thread count its records were tuned with (the target they were measured
    on), unless --threads or a target with -num-threads says otherwise. A conv whose Winograd form was
    tuned (tune --winograd) runs in the form whose record is faster."""
    from tensortune.codegen.target import TargetError, parse_target
    from tensortune.flows.tuned_network import measure_tuned_network
    target = with_threads(target, threads)
    check_target(target)                    # validated; passed on as given (a bare llvm: the records' threads)
    if compiled and parse_target(target).kind != "llvm":
        fail(f"--compiled runs a CPU library (an llvm target), got {target!r}", USAGE)
    store = open_store(records) if records else None
    graph = load_network(network, batch=batch, seq_len=seq_len, layers=layers, image_size=image_size,
                  input_shapes=input_shape)
    net = _extract(graph, stored_winograd_tiles(store))    # forms without a faster record drop out at build
    console = Console(width=max(120, Console().width))
    if compiled:
        from tensortune.codegen.aot import AOTError
        from tensortune.flows.tuned_network import measure_compiled_network
        try:
            timing, result, per_call = measure_compiled_network(net, store, target, repeat=repeat, check=check)
        except (AOTError, TargetError, OSError, ValueError) as err:
            fail(str(err))
        console.print(f"compiled library: {len(result.kernels)} kernels, {timing.tuned} from records, "
                      f"{result.arena_bytes:,} bytes of arena; dispatch {per_call * 1e9:.0f} ns per kernel call "
                      "(driver with empty kernels, ctypes call included)", soft_wrap=True)
        console.print(timing.line(), soft_wrap=True)
        if not timing.passed:
            raise typer.Exit(code=2)
        return
    try:
        timing = measure_tuned_network(net, store, target, repeat=repeat, check=check)
    except (TargetError, OSError, ValueError) as err:
        fail(str(err))
    table = Table(title=f"{graph.name}: {len(net.tasks)} tasks on {timing.target}")
    for header in ("#", "task", "weight", "estimated ms", "ms per run", "schedule"):
        table.add_column(header)
    for i, t in enumerate(timing.tasks):
        est = f"{t.weight * t.estimate_s * 1e3:.3f}" if t.estimate_s == t.estimate_s else "-"
        table.add_row(str(i), t.name, str(t.weight), est, f"{t.measured_s * 1e3:.3f}", t.source)
    console.print(table)
    console.print(timing.line(), soft_wrap=True)
    if timing.gap_too_large:
        console.print(f"[yellow]warning:[/yellow] measured and estimated latency differ by {timing.gap:+.0%}")
    if not timing.passed:
        raise typer.Exit(code=2)
