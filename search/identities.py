"""The kernels of the programs a round considers, lowered on this process and the helpers at once.

The search may not lower a program (it never imports codegen), so the caller hands it a
`KernelIdentity`; picking a batch asks it for each program the pick considers, 1-2 ms of lowering a
program (12 % of a 224² ResNet-18 proposal; the global pool, whose space is small, passes over 300-400
twins for its 64 and spent 1.1 s). The helper processes that sampled the initial population and
computed its features idle meanwhile, so the programs are dealt out to them as well: each share is a
contiguous run of the programs, sent as step tuples and replayed there against the task's graph (a
tenth of the lowering's cost), and each helper keeps the identity it was sent (and so its task's graph
and the caches lowering warms on it) from call to call. Which process lowers a program does not change
its identity (a digest of the lowered text), so the picks are the same with or without helpers; a
helper that died costs its share being lowered here.
"""
from __future__ import annotations

import pickle
from typing import Protocol

from tensortune.schedule.state import State
from tensortune.schedule.steps import Step
from tensortune.search.candidate import Candidate
from tensortune.search.helper_pool import HelperPool, run_shares
from tensortune.search.memory import paused_gc
from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.search_task import SearchTask

MIN_SHARED = 16     # fewer programs are not worth a round trip to a helper (~1 ms against 1-2 ms a program)


class KernelIdentity(Protocol):
    """Which kernel a program of `task` compiles to: equal strings, one kernel (None: unknown, e.g. a
    program that does not lower; the measurement reports it). `codegen.kernel_identity.KernelIdentity`
    is one. An identity that pickles (a module-level class) is also run on the search's helpers."""

    task: SearchTask

    def __call__(self, state: State) -> str | None: ...


class Identities:
    """identities(programs, helpers) -> their kernels, in order; on the helpers too where there are enough."""

    def __init__(self, identity: KernelIdentity):
        self.identity = identity
        task = identity.task
        self._key = f"{type(identity).__module__}.{type(identity).__qualname__}/{task.workload_key}/{task.target}"
        try:
            pickle.dumps(identity)
            self._ships = True
        except Exception:        # noqa: BLE001 - e.g. a local class: it runs here only
            self._ships = False

    def __call__(self, cands: list[Candidate], helpers: HelperPool | None = None) -> list[str | None]:
        ways = helpers.processes + 1 if helpers is not None and self._ships and len(cands) >= MIN_SHARED else 1
        size = -(-len(cands) // ways)
        shares = [cands[i:i + size] for i in range(0, len(cands), size)] or [[]]
        kernels = run_shares(helpers, shares, lambda i: i - 1 if i else None,
                             lambda share: (_identify_in_helper, (self._key, self.identity, [c.steps for c in share])),
                             lambda share: [_kernel(self.identity, c.dag, c.steps, c) for c in share])
        return [k for share in kernels for k in share]


def _kernel(identity: KernelIdentity, dag: ComputeDAG, steps: tuple[Step, ...], cand: Candidate | None = None
            ) -> str | None:
    """The kernel of one program; None where its steps do not replay (evolution changes numbers without
    replaying them): the measurement reports that, with the program's record."""
    try:
        state = cand.state if cand is not None else State.replay(dag, steps)
    except Exception:        # noqa: BLE001 - any replay failure, as for a lowering failure in the identity
        return None
    return identity(state)


_IDENTITIES: dict[str, KernelIdentity] = {}     # inside a helper: the identities it was sent, per key


def _identify_in_helper(key: str, identity: KernelIdentity, programs: list[tuple[Step, ...]]) -> list[str | None]:
    """A helper's share: the kernels of these step lists, by the identity first sent under `key`."""
    identity = _IDENTITIES.setdefault(key, identity)
    with paused_gc():
        return [_kernel(identity, identity.task.dag, steps) for steps in programs]
