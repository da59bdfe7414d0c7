"""DagMemo: the last few results of a costly derivation from a DAG's ops, per DAG.

Programs of one task replay the same steps on the very same ops (every sample of a sketch starts from
the DAG's own), so what depends on the ops alone is worked out once and shared: the cache_read /
cache_write / rfactor rewrites (`steps.py`) and the stages' bodies with inlined stages put in
(`State.effective_bodies`). Keys are ids of ops or stages, so an entry must hold those objects (no
other object can take their ids while it lives), and no State: one refers to the DAG, which would
then never leave this weak-keyed memo (a network run makes many DAGs)."""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Hashable

from tensortune.tasks.compute_dag import ComputeDAG


class DagMemo:
    """Per DAG, the `kept` most recently used entries by key."""

    def __init__(self, kept: int):
        self.kept = kept
        self._memos: "weakref.WeakKeyDictionary[ComputeDAG, OrderedDict]" = weakref.WeakKeyDictionary()

    def get(self, dag: ComputeDAG, key: Hashable) -> Any | None:
        memo = self._memos.get(dag)
        if memo is None or key not in memo:
            return None
        memo.move_to_end(key)
        return memo[key]

    def put(self, dag: ComputeDAG, key: Hashable, entry: Any) -> None:
        memo = self._memos.setdefault(dag, OrderedDict())
        memo[key] = entry
        if len(memo) > self.kept:
            memo.popitem(last=False)
