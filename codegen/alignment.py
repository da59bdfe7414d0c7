"""64-byte aligned arrays: what every kernel reads and writes, in the tuner's runner as in a network.

Why: an AVX-512 load of 64 bytes from an address that is not a multiple of 64 spans two cache lines.
NumPy's allocator aligns to 16 bytes, so a weight array usually started 16, 32 or 48 bytes into a line
and every vector load of it touched two. On a Zen 5 (2 threads), ResNet-18's tuned kernels ran up to
12 % faster on 64-byte aligned copies of the same arrays (the 128->256 3x3 conv of layer 3: 0.295 ms
against 0.335-0.340 at offsets 16 and 32; 1-12 % for the other convs). The compiled library and the
deployed runtime (tensortune/runtime.py, which imports nothing of the package) always placed weights
at 64-byte offsets; the JIT network runtime and the tuner's runner now do too, so the tuner times a
kernel on memory laid out as the deployed network lays it out.
"""
from __future__ import annotations

import math

import numpy as np

ALIGN = 64


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose first byte is at a multiple of ALIGN."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start: start + nbytes].view(dtype).reshape(shape)


def aligned(array: np.ndarray) -> np.ndarray:
    """`array` itself when it is C-contiguous and starts at a multiple of ALIGN, else an aligned copy."""
    if array.flags.c_contiguous and array.ctypes.data % ALIGN == 0:
        return array
    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out
