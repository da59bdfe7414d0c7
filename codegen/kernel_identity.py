"""KernelIdentity: which programs compile to the same kernel, known before either is built.

Many step lists lower to one loop nest. A stage computed at a loop only computes the region its
consumer reads there, so its tile sizes beyond that region change nothing; two compute locations with
only loops of extent 1 between them are one; an auto-unroll limit changes nothing where every loop
under it is over both values (or under them). A search that measured each of them paid a trial for a
kernel it had timed: 7 of 128 programs of a 1024³ matmul run, 3 of 128 of a ResNet-18 conv, 182-196
of a 224² ResNet-18 run's 1 280 (most of them the pools', whose spaces are small). The search could not
see it: it never lowers a program, and may not import codegen. The flows hand it this identity
instead (`search.identities.KernelIdentity`). (A builder-side cache of object code by IR served
those twins' compilations until the search stopped proposing them; with the identity every record of a
flow has IR of its own, so it was removed.)

The identity is a digest of the lowered loop nest in `lowered_text(canonical=True)` (every loop and
store, buffer shapes and scopes; loop variables numbered, consumed pragmas and loops of extent 1 left
out) and the weight layouts the kernel reads: what the backends compile, together with the target,
which is one per task. Equal digests are equal kernels: over a 224² ResNet-18 store's 1 280 programs
the identity found 1 061 kernels where the LLVM IR text has 1 069, and each group of differing IR
under one identity (seven: loops named differently, loops of extent 1 placed differently) compiled to
one object code. Unequal digests may still compile alike (an unroll of a loop LLVM would unroll
anyway): the identity misses such twins, never invents one. Lowering costs 1-2 ms a program (a 1024³
matmul 1.0, a 56² conv 1.9), which the search pays for each program it considers for a batch.
"""
from __future__ import annotations

import hashlib

from tensortune.codegen.lower import lower
from tensortune.schedule.layout_rewrite import weight_layouts
from tensortune.schedule.state import State
from tensortune.tasks.search_task import SearchTask

# the identity's digests start with this; a change to what the identity reads changes it, so the search
# does not take a kernel named by an older rule (stored in records) for one named by this one
PREFIX = "k1-"


def kernel_text(task: SearchTask, state: State) -> str:
    """The text two programs of `task` share exactly when they compile to the same kernel."""
    cuda = task.target_kind == "cuda"
    layouts = weight_layouts(state, task.layout_rewrite) if task.layout_rewrite and not cuda else {}
    func = lower(state, target_kind="cuda" if cuda else "cpu", layouts=layouts)
    return func.text(canonical=True) + "".join(f"{layout!r}\n" for layout in layouts.values())


class KernelIdentity:
    """identity(state) -> PREFIX + the hex digest (16 bytes) of the kernel `state` compiles to, or None
    where lowering fails (the measurement reports that failure as the program's record; the search must
    not). Records keep it (`MeasureRecord.kernel`), so a resumed search lowers no stored program."""

    def __init__(self, task: SearchTask):
        self.task = task

    def __call__(self, state: State) -> str | None:
        try:
            text = kernel_text(self.task, state)
        except Exception:        # noqa: BLE001 - any lowering failure: the builder reports it, with its record
            return None
        return PREFIX + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
