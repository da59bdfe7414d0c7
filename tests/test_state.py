"""Loop State: transform steps, replay, the compact JSON round trip, printing and illegal steps."""
from __future__ import annotations

import dataclasses
import gc
import json
import weakref

import pytest

from tensortune.codegen.lower import lower
from tensortune.schedule.stage import IllegalStep, Iterator
from tensortune.schedule.state import State
from tensortune.schedule.steps import Step
from tensortune.tasks import te
from tensortune.tasks.workload_registry import make_dag
from tests.conftest import check_state, small_dag
from tests.schedules import tiled_schedule


@pytest.fixture
def mm():
    return make_dag("matmul", 64, 64, 64)


def test_split_extents_and_names(mm):
    s = State(mm).split("C", 0, [4, 8])
    it = s.stage_by_name("C").iters
    assert [(x.name, x.extent) for x in it[:3]] == [("i.0", 2), ("i.1", 4), ("i.2", 8)]


def test_imperfect_split_rounds_up_and_guards(mm):
    s = State(mm).split("C", 1, [10])
    assert [x.extent for x in s.stage_by_name("C").iters] == [64, 7, 10, 64]
    assert "if (" in lower(s).text()
    check_state(s)


def _all_step_codes() -> set[str]:
    kinds, todo = set(), [Step]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.code:
            kinds.add(cls.code)
    return kinds


def test_json_round_trip_of_every_step_kind():
    mm = small_dag("matmul")
    states = [tiled_schedule(small_dag(key), tile=3) for key in ("conv2d", "norm", "softmax", "matmul_bias_relu")]
    states.append(State(mm).cache_read("A", "shared", ["C"]).storage_align("A.shared", 0, 16, 4)
                  .compute_at("A.shared", "C", 1).compute_root("A.shared"))
    states.append(State(mm).split("C", 0, [8]).split("C", 2, [4]).follow_fused_split("C", 4, [0, 1], 0, True))
    codes = set()
    for s in states:
        text = s.steps_json()
        back = State.from_json(s.dag, text)
        assert back.steps_json() == text
        assert str(back) == str(s)
        assert lower(back).text() == lower(s).text()
        codes |= {step[0] for step in json.loads(text)}
    assert codes == _all_step_codes(), f"not round-tripped: {_all_step_codes() - codes}"


def test_cache_read_storage_align_and_compute_root(mm):
    s = State(mm).cache_read("A", "shared", ["C"])
    assert [st.name for st in s.stages] == ["A", "A.shared", "B", "C"]
    s = s.storage_align("A.shared", 0, 16, 4).compute_at("A.shared", "C", 1).compute_root("A.shared")
    assert s.stage_by_name("A.shared").compute_at == "root"
    assert "A.shared[float32 * 4348]" in lower(s).text()      # 63 rows padded to stride 68, + 64
    check_state(s)


def test_follow_fused_split_and_nparts(mm):
    s = State(mm).split("C", 0, [8]).split("C", 2, [4])
    s = s.follow_fused_split("C", 4, [0, 1], 0, True)
    assert s.stage_by_name("C").iters[-1].extent == 32
    check_state(s)


def test_follow_splits_record_themselves_and_steps_keep_the_ops_analysis(mm):
    """A follow split is recorded as itself (not the split it makes), its Split relation numbered by its
    step; every step but cache_read/cache_write/rfactor keeps the ops, so their access analysis too."""
    s = State(mm)
    analysis = s.analysis
    s = s.split("C", 0, [4, 8]).follow_split("C", 3, 0, 2).fuse("C", [0, 1]).reorder("C", [1, 0, 2, 3, 4, 5])
    assert [type(x).__name__ for x in s.steps] == ["SplitStep", "FollowSplitStep", "FuseStep", "ReorderStep"]
    assert [(r.step, r.extents) for r in s.stage_by_name("C").relations[:2]] == [(0, (2, 4, 8)), (1, (2, 4, 8))]
    assert s._analysis is analysis
    s = s.cache_write("C", "local")
    assert s.analysis is not analysis and [st.name for st in s.stages] == ["A", "B", "C.local", "C"]


def test_stage_objects_are_frozen_dataclasses_with_their_own_init(mm):
    """Iterator, Split and Stage set their slots directly (stage.py): still immutable, equal by fields
    (an iterator's loop variable aside) and hashable as before."""
    s = State(mm).split("C", 0, [4])
    stage = s.stage_by_name("C")
    it = stage.iters[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        it.name = "x"                                                  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        stage.relations[0].step = 3                                    # type: ignore[misc]
    same = Iterator(it.name, it.extent, it.kind)                       # another variable
    assert same == it and hash(same) == hash(it) and same != dataclasses.replace(it, annotation="unroll")
    assert stage.replace() == stage and hash(stage.replace()) == hash(stage)
    assert stage.replace(scope="local") != stage
    assert repr(it) == "Iterator(name='i.0', extent=16, kind='spatial', annotation='none', pragmas=())"


def test_state_prints_like_tvm(mm):
    s = State(mm).split("C", 0, [8]).parallel("C", 0).vectorize("C", 2)
    text = str(s)
    assert text.splitlines()[0] == "Placeholder: A, B"
    assert "parallel i.0 (0,8)" in text and "vectorize j (0,64)" in text and "C = ..." in text


@pytest.mark.parametrize("make, match", [
    (lambda s: s.split("C", 0, [100]), r"split lengths \[100\] \(product 100\) do not fit iterator i"),
    (lambda s: s.split("C", 0, [0]), r"positive integers"),
    (lambda s: s.split("C", 7, [2]), r"iterators 0..2, got 7"),
    (lambda s: s.reorder("C", [0, 1]), r"exactly once.*missing \[2\]"),
    (lambda s: s.fuse("C", [0, 2]), r"consecutive"),
    (lambda s: s.fuse("C", [1, 2]), r"cannot fuse spatial and reduce"),
    (lambda s: s.compute_at("C", "A", 0), r"placeholder"),
    (lambda s: s.annotate("C", 0, "warp"), r"unknown annotation"),
    (lambda s: s.compute_inline("C"), r"reduction and cannot be inlined"),
    (lambda s: s.pragma("C", 0, "auto_unroll_max_step$x"), r"must be an integer"),
])
def test_illegal_steps_fail_clearly(mm, make, match):
    with pytest.raises(IllegalStep, match=match):
        make(State(mm))


def test_compute_at_a_stage_that_does_not_consume_it():
    dag = make_dag("conv2d_relu", 1, 8, 8, 4, 8, 3, 3, 1, 1, True)
    s = State(dag)
    with pytest.raises(IllegalStep, match="T_relu does not consume pad_temp"):
        s.compute_at("pad_temp", "T_relu", 0)


@pytest.mark.parametrize("text, match", [
    ("not json", "malformed step JSON"),
    ('{"a": 1}', "expected a list of steps"),
    ('[["XX", 1]]', "unknown step code 'XX'"),
    ('[["SP", 2, 0]]', "malformed step"),
    ('[["SP", 9, 0, 64, [4], 1]]', "stage 9 does not exist"),
])
def test_malformed_step_json(mm, text, match):
    with pytest.raises(IllegalStep, match=match):
        State.from_json(mm, text)


def test_cache_read_after_cache_write_keeps_the_dataflow(mm):
    """Packing B for the register tile: C.local must stay C's producer, or it cannot be attached to C."""
    s = State(mm).cache_write("C", "local").cache_read("B", "local", ["C.local"])
    assert [st.name for st in s.stages] == ["A", "B", "B.local", "C.local", "C"]
    assert [c.name for c in s.consumers(s.stage_id("C.local"))] == ["C"]
    s = s.split("C", 0, [8]).split("C", 2, [16]).reorder("C", [0, 2, 1, 3])
    s = s.compute_at("C.local", "C", 1).split("C.local", 2, [8]).reorder("C.local", [2, 0, 3, 1])
    s = s.compute_at("B.local", "C.local", 0).vectorize("C.local", 3).vectorize("B.local", 1).parallel("C", 0)
    assert "B.local[float32 * 128]" in lower(s).text()         # one 8 x 16 panel of B per k.0
    check_state(s)


def test_replayed_cache_write_is_shared_and_does_not_keep_its_dag_alive():
    """Replays of a cache write on the same stages share ops and analysis (a population's samples all
    start from the DAG's stages); the memo must not outlive the DAG (a network run makes many)."""
    import gc
    import weakref
    dag = make_dag("matmul", 16, 16, 16)
    a = State(dag).cache_write("C", "local")
    b = State(dag).cache_write("C", "local")
    assert a.stages == b.stages and a.analysis is b.analysis
    check_state(a.split("C.local", 0, [4]))
    gone = weakref.ref(dag)
    del dag, a, b
    gc.collect()
    assert gone() is None


def test_a_rewrite_on_the_same_ops_after_other_loops_shares_its_ops_and_analysis_not_its_loops():
    """Samples of a sketch differ in the split lengths drawn before its cache_read / cache_write, not in
    the ops those rewrite: they share the rewritten ops and their access analysis (making them was a
    tenth of a second per replay on a Winograd F(4) DAG), while each keeps its own loops; both compile
    and compute the matmul."""
    dag = make_dag("matmul", 64, 64, 64)
    base = State(dag).cache_write("C", "local")
    a = base.split("C", 0, [8]).cache_read("B", "local", ["C.local"])
    b = base.split("C", 0, [16]).cache_read("B", "local", ["C.local"])
    assert [s.name for s in a.stages] == ["A", "B", "B.local", "C.local", "C"]
    assert all(x.op is y.op for x, y in zip(a.stages, b.stages)) and a.analysis is b.analysis
    assert [it.extent for it in a.stage_by_name("C").iters] == [8, 8, 64]
    assert [it.extent for it in b.stage_by_name("C").iters] == [4, 16, 64]
    check_state(a)
    check_state(b)


def test_cache_write_of_a_stage_with_a_stage_computed_at_it_fails_though_its_ops_were_rewritten_before():
    """The shared rewrite is keyed by the ops, which do not say where stages are computed: the rule that
    a cache_write comes before anything is attached to its stage is checked on every state."""
    dag = make_dag("matmul_bias_relu", 16, 16, 16)
    State(dag).cache_write("T_relu", "local")
    attached = State(dag).compute_inline("T_add").compute_at("C", "T_relu", 1)
    with pytest.raises(IllegalStep, match="must come before stages are computed at it"):
        attached.cache_write("T_relu", "local")


def test_states_with_the_same_ops_and_inlining_share_their_effective_bodies():
    """The feature templates count a body once per object, so tile sizes must not make new bodies;
    another inlining must, and a shared body is what expanding the stages afresh gives."""
    dag = make_dag("conv2d_relu", 1, 14, 14, 16, 32, 3, 3, 1, 1)
    inlined = State(dag).compute_inline("pad_temp")
    a = inlined.split("conv2d_nchw", 1, [4, 2]).effective_bodies()
    b = inlined.split("conv2d_nchw", 1, [8, 1]).effective_bodies()
    c = State(dag).split("conv2d_nchw", 1, [4, 2]).effective_bodies()
    assert set(a) == {"conv2d_nchw", "T_relu"} and all(a[k] is b[k] for k in a)
    assert "pad_temp" in c and c["conv2d_nchw"] is not a["conv2d_nchw"]
    fresh = inlined._expand_inlined()
    assert all(te.structural_key(a[k]) == te.structural_key(fresh[k]) for k in a)
    assert "pad_temp" in te.to_text(c["conv2d_nchw"]) and "pad_temp" not in te.to_text(a["conv2d_nchw"])
    gone = weakref.ref(dag)                   # the memo must not outlive the DAG (a network run makes many)
    del dag, inlined, a, b, c, fresh
    gc.collect()
    assert gone() is None


def test_an_rfactor_on_the_same_loops_shares_its_ops_and_follows_other_loops():
    """Every sample of an rfactor sketch splits the reduction anew before the rfactor: samples whose
    factored loops are alike (lengths, not variable objects) share the new ops and their analysis, while
    other lengths make ops of their own; each computes the matmul."""
    dag = make_dag("matmul", 8, 8, 256)
    a = State(dag).split("C", 2, [16]).rfactor("C", 3, 2)
    b = State(dag).split("C", 2, [16]).rfactor("C", 3, 2)
    c = State(dag).split("C", 2, [32]).rfactor("C", 3, 2)
    assert [s.name for s in a.stages] == ["A", "B", "C.rf", "C"]
    assert all(x.op is y.op for x, y in zip(a.stages, b.stages)) and a.analysis is b.analysis
    assert a.stage_by_name("C.rf").op is not c.stage_by_name("C.rf").op
    assert a.stage_by_name("C.rf").op.shape == (8, 8, 16) and c.stage_by_name("C.rf").op.shape == (8, 8, 32)
    for s in (a, b, c):
        check_state(s)


def test_rfactor_of_a_stage_with_a_stage_computed_at_it_fails_though_its_loops_were_factored_before():
    """The shared rfactor is keyed by the ops and the factored loops, which do not say where other stages
    are computed: the rule that nothing is attached to the factored stage is checked on every state."""
    dag = make_dag("matmul", 8, 8, 256)
    packed = State(dag).cache_read("B", "local", ["C"])
    packed.split("C", 2, [16]).rfactor("C", 3, 2)
    attached = packed.split("C", 2, [16]).compute_at("B.local", "C", 1)
    with pytest.raises(IllegalStep, match="must come before stages are computed at it"):
        attached.rfactor("C", 3, 2)
