"""Artifact: what a builder hands a runner — compiled bytes plus the argument signature (plain data)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tensortune.schedule.layout_rewrite import WeightLayout


@dataclass(frozen=True)
class Artifact:
    kind: str                                     # "llvm" (object code) | "cuda" (cubin)
    func_name: str
    binary: bytes
    args: tuple[tuple[str, tuple[int, ...], str], ...]   # (name, shape, dtype), inputs then outputs
    launch: tuple = ()                            # cuda: (grid xyz, block xyz, dynamic shared bytes)
    source: str = ""                              # generated source, kept when asked for (debugging)
    layouts: tuple[WeightLayout, ...] = ()        # inputs the kernel takes rewritten (layout_rewrite)

    def layout_inputs(self, names: Sequence[str], arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The DAG's input arrays (`names` in order) as this kernel takes them: rewritten weights in
        their layout, the others as they are."""
        by_name = {lay.name: lay for lay in self.layouts}
        return [by_name[n].transform(a) if n in by_name else a for n, a in zip(names, arrays)]
