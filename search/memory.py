"""Pausing Python's cyclic garbage collector around the search's allocation-heavy loops.

A search round allocates millions of small acyclic objects (states, steps, iterators, feature rows).
The cyclic collector is triggered by allocation counts and re-scans every live object of the
population each time; it took 40% of sampling. Reference counting frees these objects anyway, so
the collector is paused for the loop and any cycles wait until it ends.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused_gc() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
