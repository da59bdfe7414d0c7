"""PartRows: the feature rows of program parts met before, by part structure and open numbers.

A part's rows are a function of its structure (`feature_parts`) and its open numbers alone (a
`FeatureTemplate` evaluates exactly that). Evolution makes each child from a parent by changing one
tile size, one compute location or one unroll depth, so most of a child's parts are its parent's, number
for number. In a search round of a resumed ResNet-50 store's Winograd F(4) task (five calls of about
1 600-2 200 programs, some 7 300-9 600 parts each), 62-87 % of the parts had been featurised before in
that round or an earlier one, and 40-60 % of a call's 500-570 part structures had nothing new. A template's
evaluation is a fixed number of numpy calls whatever its member count, so a structure with nothing new
costs nothing now, and the others are evaluated for their new numbers only (each once).

Rows are kept as the Featurizer returns them (float32), so a program's features are the same numbers
whether they were computed now or kept. The store is bounded: a call that finds it holding `max_parts`
parts or more empties it first (`trim`; never between a call's lookups and its reads).
"""
from __future__ import annotations

import numpy as np

MAX_PARTS = 40_000       # ~50 MB when full (38 500 parts of two Winograd tasks: 50 MB); a F(4) round adds ~8 000


class PartRows:
    """rows[(structure, numbers)] -> float32 [stores of the part, features], for the parts met before."""

    def __init__(self, max_parts: int = MAX_PARTS):
        self.max_parts = max_parts
        self._rows: dict[str, dict[tuple, np.ndarray]] = {}
        self._count = 0

    def trim(self) -> None:
        """Empty the store if it is full (at the start of a call only: a call reads back what it looked up)."""
        if self._count >= self.max_parts:
            self._rows.clear()
            self._count = 0

    def new_numbers(self, key: str, numbers: np.ndarray) -> np.ndarray:
        """The distinct rows of `numbers` [m, slots] whose parts of structure `key` have no rows kept."""
        kept = self._rows.get(key, {})
        new: dict[tuple, int] = {}
        for i, row in enumerate(map(tuple, numbers.tolist())):
            if row not in kept and row not in new:
                new[row] = i
        return numbers[list(new.values())]

    def keep(self, key: str, numbers: np.ndarray, block: np.ndarray) -> None:
        """Keep `block` [len(numbers), stores, features], the rows of `numbers`' parts of structure `key`."""
        kept = self._rows.setdefault(key, {})
        block = block.astype(np.float32, copy=False)
        for row, rows in zip(map(tuple, numbers.tolist()), block):
            if row not in kept:
                kept[row] = rows
                self._count += 1

    def block(self, key: str, numbers: np.ndarray) -> np.ndarray:
        """The kept rows of every row of `numbers` [m, slots], stacked: [m, stores, features]."""
        kept = self._rows[key]
        return np.stack([kept[row] for row in map(tuple, numbers.tolist())])
