"""Network tuning times a kernel the way the network runs it, on both paths: the library's tune_network and
the flow's Dask measurer use codegen.timing.NETWORK_TIMING (caches flushed before every timed run), and a
run's own timing options still override it; single-operator tuning keeps warm timing, as libraries are
timed. (A configuration test: two paths that timed differently would store incomparable latencies.)"""
from __future__ import annotations

from dataclasses import replace

from tensortune.codegen.measure import LocalRunner
from tensortune.codegen.timing import NETWORK_TIMING, TimingConfig
from tensortune.flows.tune_flow import timing_options
from tensortune.flows.tuning import network_measurer


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


def test_single_operator_tuning_stays_warm():
    assert not LocalRunner().config.flush_cache and TimingConfig() != NETWORK_TIMING
