"""How much CPU time this machine loses to other tenants while the benchmark runs.

A shared VM can have its vCPUs descheduled by the host without the guest counting it as steal time: on
one 2-vCPU VM a spinning thread lost 10-30 % of the wall clock in gaps of 1-16 ms, with the guest idle
and /proc/stat's steal column still. A parallel kernel waits for its slowest thread, so such gaps
inflate short timings many times over (a 0.25 ms kernel timed at 4 ms). The probe spins one process per
thread, each reading the clock in a tight loop, and counts the time between two readings that exceeds
GAP_S as lost. Figures measured while the loss is high are not comparable with another run's.
"""
from __future__ import annotations

import json
import subprocess
import sys

GAP_S = 0.0005            # a clock reading this much after the previous one: the process was not running
NOISY = 0.03              # lost fraction above which the benchmark warns that its figures are suspect

_SPIN = r"""
import json, sys, time
seconds, gap = float(sys.argv[1]), float(sys.argv[2])
t0 = last = time.perf_counter()
lost, worst = 0.0, 0.0
while True:
    t = time.perf_counter()
    d = t - last
    if d > gap:
        lost += d
        worst = max(worst, d)
    last = t
    if t - t0 >= seconds:
        break
print(json.dumps({"lost": lost / (t - t0), "worst": worst}))
"""


def lost_cpu_fraction(threads: int, seconds: float = 2.0) -> dict:
    """{"lost": mean fraction of wall time the spinning processes were not running, "worst_gap_ms": the
    longest gap}, over `threads` processes spinning at once for `seconds`."""
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(seconds), str(GAP_S)], stdout=subprocess.PIPE,
                              text=True) for _ in range(max(1, threads))]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 60)
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {"lost": sum(r["lost"] for r in results) / len(results),
            "worst_gap_ms": max(r["worst"] for r in results) * 1e3, "threads": len(results), "seconds": seconds}


def describe(probe: dict) -> str:
    """One line for the console: the loss, and a warning when figures are suspect."""
    line = (f"host noise: spinning on {probe['threads']} threads lost {probe['lost']:.1%} of the wall clock "
            f"(longest gap {probe['worst_gap_ms']:.1f} ms)")
    if probe["lost"] > NOISY:
        line += (f" -- over {NOISY:.0%}: other tenants are taking this machine's CPUs; timings from this run "
                 "are not comparable with another run's")
    return line
