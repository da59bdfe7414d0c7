"""The benchmark's host-noise probe sees CPU time taken from it (here by itself: twice as many spinning
processes as cores, so each runs about half the time) and says when figures are suspect."""
from __future__ import annotations

import os

from tensortune.bench.host_noise import NOISY, describe, lost_cpu_fraction


def test_the_probe_sees_processes_that_share_a_core():
    cores = len(os.sched_getaffinity(0))
    probe = lost_cpu_fraction(2 * cores, seconds=1.5)
    assert probe["threads"] == 2 * cores
    assert probe["lost"] > 0.25, probe          # about 0.5: each process waits while another runs
    assert probe["worst_gap_ms"] > 0.5


def test_a_noisy_run_is_flagged_and_a_quiet_one_is_not():
    quiet = describe({"lost": NOISY / 2, "worst_gap_ms": 1.0, "threads": 2, "seconds": 2.0})
    noisy = describe({"lost": NOISY * 2, "worst_gap_ms": 9.0, "threads": 2, "seconds": 2.0})
    assert "not comparable" not in quiet and "not comparable" in noisy
