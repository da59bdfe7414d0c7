"""bench ceiling: the IR register kernel computes A @ B per block on every thread, and the peak's spread."""
from __future__ import annotations

import numpy as np
import pytest

from bench.ceiling import Placement, RegisterKernel, kernel_ir, placements, register_block, spread
from bench.common import FmaPeakLoop


@pytest.mark.parametrize("threads", [1, 2])
def test_register_kernel_sums_every_block_product_as_numpy_does(threads):
    """Odd strides (A's rows 37 floats apart, each block 5 and 7 floats on) so a wrong offset shows."""
    kernel = RegisterKernel(Placement("test", k=24, lda=37, blocks=6, a_step=5, b_step=7), threads, seed=1)
    kernel.check()                                 # 4 blocks
    # the check is not vacuous: the threads' operands differ, and so do their results
    assert threads == 1 or not np.allclose(kernel.c[0], kernel.c[1])
    assert kernel.flops == 2 * 6 * 24 * kernel.rows * kernel.n * threads
    for c in kernel.c:                             # a whole call sums all 6 blocks
        c[:] = 0
    kernel()
    for t, c in enumerate(kernel.c):
        np.testing.assert_allclose(c.reshape(kernel.rows, kernel.n), kernel.expected(t, 6), rtol=1e-5)
        assert not np.allclose(c.reshape(kernel.rows, kernel.n), kernel.expected(t, 4), rtol=1e-5)


def test_register_blocks_fit_the_vector_registers():
    """Accumulators plus B's vectors plus one broadcast within 32 registers (AVX-512) or 16 (AVX2)."""
    for width, registers in ((64, 32), (32, 16)):
        rows, vecs, lanes = register_block(width)
        assert lanes == width // 4 and rows * vecs + vecs + 1 <= registers
        assert f"<{lanes} x float>" in kernel_ir(rows, vecs, lanes, 8, 8, "generic", "")
    # the streamed placement walks all 1024 rows of A, a block of rows at a time
    streamed = placements(4)[-1]
    assert streamed.a_step * streamed.blocks == 1024 * 1024 and streamed.lda == 1024


def test_spread_is_relative_to_the_best_peak_run():
    got = spread([100.0, 90.0, 80.0, 50.0], peak=200.0)
    assert got == {"peak_frac": 0.5, "median_frac": 0.425, "p25_frac": 0.4, "worst_frac": 0.25}
    loop = FmaPeakLoop(1)
    assert loop.flops > 0 and loop.run() > 0


def test_every_benchmark_records_the_peaks_median_run_beside_its_best(monkeypatch):
    """environment() keeps the best of 20 peak runs (what fractions divide by) and their median."""
    import bench.common as common
    runs = iter([[10.0, 30.0, 20.0], [40.0, 80.0, 60.0]])
    monkeypatch.setattr(common, "fma_peak_runs", lambda threads: next(runs))
    monkeypatch.setattr(common, "lost_cpu_fraction", lambda threads: {"lost": 0.0, "worst_gap_ms": 0.0,
                                                                       "threads": threads, "seconds": 0.0})
    env = common.environment(2)
    assert env["fma_peak_gflops"] == {"1": 30.0, "2": 80.0}
    assert env["fma_peak_median_gflops"] == {"1": 20.0, "2": 60.0}


def test_a_peak_that_does_not_scale_with_the_threads_is_measured_again(monkeypatch):
    """A 2-thread peak at the 1-thread figure (a vCPU held by the host through all the runs) is measured
    again after a pause, the better set kept; one that never scales (SMT) is retried PEAK_RETRIES times."""
    import bench.common as common
    monkeypatch.setattr(common, "lost_cpu_fraction", lambda threads: {"lost": 0.0, "worst_gap_ms": 0.0,
                                                                       "threads": threads, "seconds": 0.0})
    monkeypatch.setattr(common, "PEAK_RETRY_GAP_S", 0.0)
    runs = iter([[100.0, 110.0], [100.0, 115.0], [200.0, 210.0, 220.0]])
    monkeypatch.setattr(common, "fma_peak_runs", lambda threads: next(runs))
    env = common.environment(2)
    assert env["fma_peak_gflops"] == {"1": 110.0, "2": 220.0} and env["fma_peak_median_gflops"]["2"] == 210.0
    assert env["fma_peak_retries"] == 1
    calls = []
    monkeypatch.setattr(common, "fma_peak_runs", lambda threads: calls.append(threads) or [100.0 + len(calls)])
    env = common.environment(2)
    assert calls == [1, 2, 2, 2, 2] and env["fma_peak_retries"] == common.PEAK_RETRIES
    assert env["fma_peak_gflops"] == {"1": 101.0, "2": 105.0}
