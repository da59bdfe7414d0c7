"""Programs that compile to one kernel share a KernelIdentity (codegen.kernel_identity), programs that do
not, do not; and the search, handed the identity, spends no trial on a kernel it measured, has in flight
or picked already. Every kernel built here is checked against the NumPy reference."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tensortune.codegen import llvm_backend
from tensortune.codegen.kernel_identity import PREFIX, KernelIdentity, kernel_text
from tensortune.codegen.llvm_codegen import generate_llvm_ir
from tensortune.codegen.lower import lower
from tensortune.codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
from tensortune.codegen.target import make_task
from tensortune.flows.stored_features import StoredFeatures
from tensortune.flows.tuning import resume_policy, to_records, tune_task
from tensortune.schedule.state import State
from tensortune.search.cost_model import XGBModel
from tensortune.search.feature_pool import Featurizer
from tensortune.search.identities import Identities
from tensortune.search.sketch_policy import SketchPolicy
from tensortune.storage.records import RecordStore
from tensortune.tasks import te
from tensortune.tasks.compute_dag import ComputeDAG
from tensortune.tasks.network_ops import transpose
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import check_state


def _matmul_unrolled_to(depth: int) -> State:
    """Its innermost loop runs 32 times, so depths 0 and 16 unroll nothing and 64 unrolls it."""
    s = State(make_dag("matmul", 48, 40, 64)).split("C", 2, [32]).vectorize("C", 1)
    return s.pragma("C", 0, f"auto_unroll_max_step${depth}")


def _transposes() -> tuple[State, State]:
    """NCHW -> NHWC, one vectorised loop over the 3 channels inside one parallel loop, reached by two step
    lists whose loops are named differently (a split of the channels by 3 fused away, or not)."""
    x = te.placeholder((1, 3, 8, 8), name="data")
    dag = ComputeDAG([x, transpose(x, (0, 2, 3, 1))])
    split = State(dag).split(1, 3, [3]).vectorize(1, 4).fuse(1, [0, 1, 2, 3]).parallel(1, 0)
    fused = State(dag).fuse(1, [0, 1, 2]).parallel(1, 0).vectorize(1, 1)
    return split, fused


def test_twins_share_an_identity_and_compile_to_the_same_object():
    identity = KernelIdentity(make_task(make_dag("matmul", 48, 40, 64), "llvm"))
    none, sixteen, sixty_four = (_matmul_unrolled_to(d) for d in (0, 16, 64))
    assert identity(none) == identity(sixteen) != identity(sixty_four)
    assert identity(none) is not None and identity(none).startswith(PREFIX) and len(identity(none)) == 35

    # twins whose LLVM IR differs (its value names are the loops' names): one identity, one object code
    split, fused = _transposes()
    assert split.steps != fused.steps
    assert generate_llvm_ir(lower(split), "generic", "") != generate_llvm_ir(lower(fused), "generic", "")
    identity = KernelIdentity(make_task(split.dag, "llvm"))
    assert identity(split) == identity(fused)
    assert llvm_backend.build(split).binary == llvm_backend.build(fused).binary
    # twins by a loop of extent 1 (the reduction split by its whole extent), which both backends drop
    plain = State(make_dag("matmul", 48, 40, 64))
    whole = plain.split("C", 2, [64])
    identity = KernelIdentity(make_task(plain.dag, "llvm"))
    assert identity(plain) == identity(whole) != identity(plain.split("C", 2, [32]))
    assert llvm_backend.build(plain).binary == llvm_backend.build(whole).binary
    for state in (none, sixteen, sixty_four, split, fused, plain, whole):
        check_state(state)                       # builds it, runs it, compares with NumPy


def test_the_text_numbers_loops_and_leaves_out_consumed_pragmas():
    task = make_task(make_dag("matmul", 48, 40, 64), "llvm")
    text = kernel_text(task, _matmul_unrolled_to(64))
    assert "pragma" not in text and '"unroll"' in text and "for (v0, 0, 48)" in text
    assert "pragma auto_unroll_max_step=64" in lower(_matmul_unrolled_to(64)).text()


def test_a_program_that_does_not_lower_has_no_identity():
    state = State(make_dag("matmul", 48, 40, 64)).split("C", 2, [None])     # a tile size left unfilled
    assert KernelIdentity(make_task(state.dag, "llvm"))(state) is None


@pytest.mark.parametrize("with_identity", [True, False])
def test_the_search_never_measures_one_kernel_twice(with_identity):
    """A small max pool's space holds few kernels under many step lists: with the identity each batch's
    programs have kernels of their own, none a measured one's; without it, the same search repeats some."""
    task = make_task(make_dag("max_pool2d", 1, 2, 4, 4, 2, 2, 0), "llvm -num-threads=1")
    identity = KernelIdentity(task)
    policy = SketchPolicy(task, seed=2, kernel_identity=identity if with_identity else None)
    kernels: list[bytes | None] = []
    twins = 0
    with ProgramMeasurer(LocalBuilder(), LocalRunner()) as measurer:
        for _ in range(3):
            batch = policy.next_batch(12)
            twins += policy.timing.n_twins
            results = measurer.measure(task, [c.steps_json for c in batch])
            assert all(r.ok for r in results), [r.error_msg for r in results if not r.ok]
            policy.update(batch, [r.latency for r in results])
            kernels += [identity(c.state) for c in batch]
    for c in list(policy.measured_cands.values())[:4]:
        check_state(c.state)
    assert None not in kernels
    if with_identity:
        assert len(set(kernels)) == len(kernels) == 36 and twins > 0      # full batches, of new kernels
    else:
        assert len(set(kernels)) < len(kernels)


class _Counted:
    """The real identity, counting the programs it lowered."""

    def __init__(self, identity: KernelIdentity):
        self.identity, self.task, self.calls = identity, identity.task, 0

    def __call__(self, state: State) -> str | None:
        self.calls += 1
        return self.identity(state)


def test_records_name_their_kernels_and_a_resumed_search_lowers_none_of_them(tmp_path):
    task = make_task(make_dag("max_pool2d", 1, 2, 4, 4, 2, 2, 0), "llvm -num-threads=1")
    identity = KernelIdentity(task)
    store, bare = RecordStore(str(tmp_path / "records")), RecordStore(str(tmp_path / "bare"))
    with ProgramMeasurer(LocalBuilder(), LocalRunner()) as measurer:
        tune_task(task, 24, measurer=measurer, records=store, seed=2)
        # records written without kernels (before schema 4, or by a caller that has no identity)
        programs = SketchPolicy(task, seed=2).sample(6)
        bare.append(to_records(task, programs, measurer.measure(task, [c.steps_json for c in programs]), round_=0))
    frame = store.records_of(task.workload_key)
    stored = set(frame["kernel"])
    assert len(frame) == len(stored) == 24
    assert list(frame["kernel"]) == [identity(State.from_json(task.dag, s)) for s in frame["steps"]]

    counted = _Counted(identity)
    resumed = SketchPolicy(task, seed=5, kernel_identity=counted)
    assert resume_policy(resumed, frame, StoredFeatures(store)) == 24 and counted.calls == 0  # named by the records
    batch = resumed.next_batch(12)
    assert batch and all(resumed.kernel_of(c) == identity(c.state) not in stored for c in batch)

    assert (bare.records_of(task.workload_key)["kernel"] == "").all()
    counted = _Counted(identity)
    policy = SketchPolicy(task, seed=5, kernel_identity=counted)
    asked: list[int] = []
    ask = policy.identities
    policy.identities = lambda cands, helpers=None: asked.append(len(cands)) or ask(cands, helpers)  # type: ignore
    resume_policy(policy, bare.records_of(task.workload_key), StoredFeatures(bare))
    assert counted.calls == 6 and asked == [6]          # lowered once each, at resume, in one call (helpers too)
    for steps in list(frame["steps"][:2]) + [programs[0].steps_json]:
        check_state(State.from_json(task.dag, steps))


def test_helpers_lower_their_share_and_the_batches_stay_the_same():
    """The kernels a pick considers are lowered on the search's helper too (`search/identities.py`): the
    same identities as in this process, so the same batches and twins, round after round of a small
    space whose twins need several chunks; an identity that does not pickle is asked here only."""
    conv = make_task(make_dag("conv2d_relu", 1, 14, 14, 16, 16, 3, 3, 1, 1), "llvm -num-threads=2")
    pool = make_task(make_dag("max_pool2d", 1, 2, 4, 4, 2, 2, 0), "llvm -num-threads=1")
    shared, alone = Featurizer(processes=1), Featurizer(processes=0)
    try:
        identity = KernelIdentity(conv)
        programs = SketchPolicy(conv, seed=3).sample(48)
        kernels = Identities(identity)(programs, shared.helpers)
        assert shared.helpers.pids(), "no share went to the helper"
        assert None not in kernels and kernels == [identity(c.state) for c in programs]
        (pid,) = shared.helpers.pids()
        os.kill(pid, signal.SIGKILL)               # a dead helper's share is lowered here
        time.sleep(0.2)
        assert Identities(identity)(programs, shared.helpers) == kernels

        for task, n in ((conv, 40), (pool, 24)):
            policies = [SketchPolicy(task, XGBModel(features=f, seed=4), seed=4, kernel_identity=KernelIdentity(task))
                        for f in (shared, alone)]
            for _ in range(3 if task is pool else 1):
                batches = [p.next_batch(n) for p in policies]
                assert [c.steps_json for c in batches[0]] == [c.steps_json for c in batches[1]] and batches[0]
                assert policies[0].twins == policies[1].twins
                assert [policies[0].kernel_of(c) for c in batches[0]] == [KernelIdentity(task)(c.state)
                                                                          for c in batches[0]]
                for p, batch in zip(policies, batches):
                    p.update(batch, [1e-4] * len(batch))
            assert policies[0].twins or task is conv
    finally:
        shared.close()

    class Local:                    # a class inside a function does not pickle: lowered here only
        task = conv

        def __call__(self, state: State) -> str | None:
            return identity(state)

    fresh = Featurizer(processes=1)
    try:
        assert Identities(Local())(programs, fresh.helpers) == kernels and not fresh.helpers.pids()
    finally:
        fresh.close()
