"""Artifact: what a builder hands a runner — compiled bytes plus the argument signature (plain data)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Artifact:
    kind: str                                     # "llvm" (object code) | "cuda" (cubin)
    func_name: str
    binary: bytes
    args: tuple[tuple[str, tuple[int, ...], str], ...]   # (name, shape, dtype), inputs then outputs
    launch: tuple = ()                            # cuda: (grid xyz, block xyz, dynamic shared bytes)
    source: str = ""                              # generated source, kept when asked for (debugging)
