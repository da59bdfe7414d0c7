"""`tensortune compile`: the tuned network as one shared library, its weights and a manifest."""
from __future__ import annotations

import math
import os
import shutil
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tensortune.flows.cli_app import app
from tensortune.flows.cli_input import USAGE, check_target, fail, folder_to_write, open_store
from tensortune.flows.network_cli import (
    BatchOption,
    ImageSizeOption,
    InputShapeOption,
    LayersOption,
    NetworkArg,
    RecordsOption,
    SeqLenOption,
    TargetOption,
    ThreadsOption,
    _extract,
    load_network,
    stored_winograd_tiles,
    with_threads,
)


@app.command("compile")
def compile_command(network: NetworkArg,
                    output: Annotated[str, typer.Option("-o", "--output", help="Folder to write the library, "
                                                        "weights and manifest.json into.")],
                    records: RecordsOption = None,
                    batch: BatchOption = None, seq_len: SeqLenOption = None, layers: LayersOption = None,
                    image_size: ImageSizeOption = None, input_shape: InputShapeOption = None,
                    target: TargetOption = "llvm", threads: ThreadsOption = None,
                    check: Annotated[bool, typer.Option("--check/--no-check", help="Load the library and "
                                                        "compare its outputs with the NumPy reference.")] = True,
                    ) -> None:
    """Build the network (each task from its best record, else the default schedule) into one shared
    library that `tensortune.runtime.load` (numpy + ctypes) or any C program runs."""
    from tensortune.codegen.aot import AOTError
    from tensortune.codegen.target import TargetError, parse_target
    from tensortune.flows.tuned_network import compile_tuned
    if os.path.exists(output) and not os.path.isdir(output):
        fail(f"--output {output} exists and is not a folder", USAGE)
    folder_to_write("--output", output)
    target = with_threads(target, threads)
    check_target(target)
    if parse_target(target).kind != "llvm":
        fail(f"compile builds CPU libraries only (an llvm target), got {target!r}", USAGE)
    store = open_store(records) if records else None
    if shutil.which(os.environ.get("CC", "cc")) is None:
        fail(f"no C compiler to link with ({os.environ.get('CC', 'cc')} not found; set CC)")
    graph = load_network(network, batch=batch, seq_len=seq_len, layers=layers, image_size=image_size,
                  input_shapes=input_shape)
    net = _extract(graph, stored_winograd_tiles(store))    # a Winograd form runs where its record is faster
    console = Console(width=max(120, Console().width))
    try:
        result, chosen, estimate, untuned = compile_tuned(net, store, target, output)
    except (AOTError, TargetError, OSError, ValueError) as err:
        fail(str(err))
    table = Table(title=f"{graph.name}: {len(result.kernels)} tasks on {chosen}")
    for header in ("#", "task", "weight", "schedule"):
        table.add_column(header)
    for k in result.kernels:
        table.add_row(str(k.index), k.name, str(k.weight), k.schedule)
    console.print(table)
    tuned = sum(k.schedule == "record" for k in result.kernels)
    console.print(f"{tuned}/{len(result.kernels)} tasks from records, {len(result.kernels) - tuned} on default "
                  "schedules", soft_wrap=True)
    if math.isfinite(estimate):
        console.print(f"estimated latency: {estimate * 1e3:.3f} ms (sum of the records' latencies)")
    else:
        console.print(f"estimated latency: n/a ({len(untuned)} task(s) have no record)")
    if check:
        from tensortune.codegen.network_runtime import NETWORK_TOLERANCE, NetworkCheck, relative_errors
        from tensortune.runtime import load
        inputs = net.source.random_inputs(0)
        result_check = NetworkCheck(relative_errors(load(output).run(inputs), net.source.run_reference(inputs)),
                                    NETWORK_TOLERANCE)
        console.print(f"check against the NumPy reference: {result_check}", soft_wrap=True)
        if not result_check.passed:
            raise typer.Exit(code=2)
    console.print(f"wrote {len(result.files)} files in {result.seconds:.1f} s:", soft_wrap=True)
    for f in result.files:
        console.print(f"  {f} ({os.path.getsize(f):,} bytes)", soft_wrap=True, highlight=False)
