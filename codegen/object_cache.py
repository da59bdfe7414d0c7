"""Object code by LLVM IR, so that programs that differ in their steps but not in their IR are compiled once.

A build's time is LLVM's (its O3 pipeline and code generation: about 120 of a conv's 130 ms on the
Xeon VM; our lowering and IR text about 5). Different step lists often lower to the same IR: auto-unroll
depths that unroll the same loops (0 and 16 where no loop nest is that small, 64 and 512 where none lies
between), compute locations that lower alike, a pool's tile sizes. In a 1280-trial ResNet-18 224² run
1 081 of the 1 280 measured programs had IR of their own; the other 199 repeated one (the convs 0-10 %
each but a 1×1 conv's 20 of 64, the max pool 52 of 64). Each of them is still timed and recorded as the
program it is; only the compilation is shared.

Kept per process (a builder process lives for many builds) and bounded by the bytes of object code it
holds, oldest first out. The key is a digest of the IR and the target machine's CPU and features, the
whole input of the compilation, so a hit is the object code that compilation would produce again.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Callable

# about four rounds of 64 conv kernels (10-200 KB of object code each)
OBJECT_CACHE_BYTES = 32 << 20


class ObjectCache:
    """A thread-safe map (IR, CPU, features) -> object code, holding at most `max_bytes` of it."""

    def __init__(self, max_bytes: int = OBJECT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def key(ir: str, cpu: str, features: str) -> bytes:
        return hashlib.blake2b("\0".join((cpu, features, ir)).encode(), digest_size=20).digest()

    def get_or_compile(self, ir: str, cpu: str, features: str, compile_: Callable[[], bytes]) -> bytes:
        """The object code of `ir` for the target: cached, or `compile_()` (which is not called under this
        cache's lock: two threads that miss on one IR may both compile it, and the second stores the same
        bytes again)."""
        k = self.key(ir, cpu, features)
        with self._lock:
            obj = self._items.get(k)
            if obj is not None:
                self._items.move_to_end(k)
                self.hits += 1
                return obj
            self.misses += 1
        obj = compile_()
        with self._lock:
            if k not in self._items and len(obj) <= self.max_bytes:
                self._items[k] = obj
                self._bytes += len(obj)
                while self._bytes > self.max_bytes:
                    _, old = self._items.popitem(last=False)
                    self._bytes -= len(old)
        return obj

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes
