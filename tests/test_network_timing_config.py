"""Network tuning times a kernel the way the network runs it, on both paths: the library's tune_network and
the flow's Dask measurer use codegen.timing.NETWORK_TIMING (caches flushed before every timed run), and a
run's own timing options still override it; single-operator tuning keeps warm timing, as libraries are
timed. (A configuration test: two paths that timed differently would store incomparable latencies.)"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from tensortune.codegen.measure import LocalRunner, ProgramMeasurer
from tensortune.codegen.network_runtime import touched_bytes
from tensortune.codegen.timing import FLUSH_BYTES, NETWORK_TIMING, OPERATOR_TIMING, TimingConfig
from tensortune.flows.tune_flow import timing_options
from tensortune.flows.tuning import network_measurer, network_timing
from tensortune.tasks.extract import extract_tasks
from tensortune.tasks.graph import GraphBuilder


def _embedding_network():
    """ids -> gather from a 1000-row table -> + bias -> softmax: two groups, one intermediate value."""
    g = GraphBuilder("embed")
    ids = g.input("ids", (4,), "int64")
    x = g.add("gather", [g.constant(np.ones((1000, 16), np.float32), "table"), ids], axis=0)
    x = g.add("add", [x, g.constant(np.ones((16,), np.float32), "bias")])
    return extract_tasks(g.build([g.add("softmax", [x], axis=1)]))


def test_library_and_flow_time_network_kernels_alike():
    assert NETWORK_TIMING.flush_cache
    library = network_measurer()
    try:
        assert library.runner.config == NETWORK_TIMING
    finally:
        library.close()
    # the flow's Dask measurer takes its TimingConfig from timing_options (flows/tune_flow.py _measurer)
    assert timing_options(None).config() == NETWORK_TIMING
    assert timing_options({"repeat": 5}).config() == replace(NETWORK_TIMING, repeat=5)
    assert not timing_options({"flush_cache": False}).config().flush_cache
    assert NETWORK_TIMING.flush_bytes == FLUSH_BYTES        # no network known: every cache flushed


def test_network_tuning_flushes_as_many_bytes_as_the_network_touches():
    net = _embedding_network()
    # ids (4 x int64) + the 4 table rows gathered (not the 64000-byte table) + bias + the one intermediate
    # [4, 16] in the arena + the output [4, 16]
    assert touched_bytes(net) == 4 * 8 + 4 * 16 * 4 + 16 * 4 + 4 * 16 * 4 + 4 * 16 * 4
    timing = network_timing(net)
    assert timing == replace(NETWORK_TIMING, flush_bytes=touched_bytes(net))
    library = network_measurer(net)
    try:
        assert library.runner.config == timing
    finally:
        library.close()
    # the flow's measurer: the same, and a flush_bytes option still overrides it
    assert timing_options(None).config(timing) == timing
    assert timing_options({"flush_bytes": 0}).config(timing).flush_bytes == 0


def test_single_operator_tuning_stays_warm():
    assert not LocalRunner().config.flush_cache and TimingConfig() != NETWORK_TIMING


def test_single_operators_are_timed_in_interleaved_passes_and_networks_in_one():
    """The library's measurer times a batch in four passes, the fastest counting (OPERATOR_TIMING);
    network timing keeps its one calibrated cold pass, on the local measurer and in the flow."""
    with ProgramMeasurer() as library:
        assert library.runner.config == OPERATOR_TIMING and OPERATOR_TIMING.passes == 4
    assert NETWORK_TIMING.passes == 1 and timing_options(None).config(NETWORK_TIMING).passes == 1
    library = network_measurer(_embedding_network())
    try:
        assert library.runner.config.passes == 1
    finally:
        library.close()
