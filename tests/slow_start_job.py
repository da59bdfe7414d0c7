"""Job functions for tests/test_worker_pool.py, in a module whose import takes SLOW_START_S seconds: a
worker process that is slow to start, as one is on a loaded machine (importing numpy and llvmlite)."""
from __future__ import annotations

import os
import time

time.sleep(float(os.environ.get("SLOW_START_S", "0")))


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def crash(_: object) -> None:
    """Die of SIGSEGV, as a kernel that writes through a null pointer does."""
    import ctypes
    ctypes.string_at(0)
