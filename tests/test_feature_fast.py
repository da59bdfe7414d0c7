"""The batched feature computation (every store and buffer of a structure at once) gives exactly the
numbers of the store-by-store code it replaced (tests/feature_reference.py, a frozen copy of it), bit
for bit, on sampled and evolved programs of several tasks on CPU and GPU targets: products and sums of
the features combine only integers (exact in float64), and every operation on fractions is the same
elementwise formula, so not even the last bit may move. The cost model reads these numbers; a changed
bit could change a prediction and with it the programs a search proposes."""
from __future__ import annotations

import random

import numpy as np
import pytest

import tensortune.search.feature as feature_module
from tensortune.codegen.target import make_task
from tensortune.search.candidate import Candidate
from tensortune.search.feature import (
    FeatureExtractor,
    FeatureTemplate,
    _BodyFacts,
    _first_loads,
    _tree_counts,
)
from tensortune.search.feature_parts import state_numbers, structure_key
from tensortune.search.mutation import crossover, mutate_auto_unroll, mutate_tile_size
from tensortune.search.sketch_policy import SketchPolicy
from tensortune.tasks import te
from tensortune.tasks.workload_registry import make_dag
from tests.feature_reference import (
    ReferenceTemplate,
    reference_count_ops,
    reference_first_loads,
    reference_tree_counts,
)

TASKS = [
    ("matmul", (128, 256, 64), "llvm -num-threads=2"),
    ("conv2d_relu", (1, 14, 14, 16, 32, 3, 3, 1, 1), "llvm -num-threads=2"),
    ("depthwise_conv2d", (1, 28, 28, 16, 3, 2, 1), "llvm -num-threads=4"),
    ("softmax", (8, 100), "llvm -num-threads=2"),
    ("layer_norm", (4, 96), "llvm -num-threads=2"),
    ("conv2d_winograd", (1, 14, 14, 16, 16, 1, 2), "llvm -num-threads=2"),
    ("max_pool2d", (1, 8, 20, 20, 3, 2, 1), "llvm -num-threads=2"),
    ("matmul", (64, 64, 64), "cuda -arch=sm_80"),
    ("conv2d_relu", (1, 14, 14, 16, 16, 3, 3, 1, 1), "cuda -arch=sm_80"),
]


def _population(task, seed: int) -> list[Candidate]:
    """Sampled programs, and tile-size / unroll mutants and crossover children of them (so most
    structures have several members with different numbers)."""
    policy = SketchPolicy(task, seed=seed)
    rng = random.Random(seed)
    programs = policy.sample(48)
    extra = []
    for c in programs:
        for _ in range(3):
            child = mutate_tile_size(c, rng, 64) if rng.random() < 0.8 else mutate_auto_unroll(c, rng, policy.is_gpu)
            if child is not None:
                extra.append(child)
    for _ in range(24):
        a, b = rng.choice(programs), rng.choice(programs)
        child = crossover(a, b, len(policy.sketches[a.sketch].state.steps), rng) if a.sketch >= 0 else None
        if child is not None:
            extra.append(child)
    return programs + extra


def _reference(state, task) -> ReferenceTemplate:
    """A template made and evaluated entirely by the old code (its tree walks included)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(feature_module, "_tree_counts", reference_tree_counts)
        mp.setattr(feature_module, "_first_loads", reference_first_loads)
        return ReferenceTemplate(state, task)


@pytest.mark.parametrize("name,args,target", TASKS, ids=[f"{n}-{t.split()[0]}" for n, _, t in TASKS])
def test_batched_features_equal_the_reference_bit_for_bit(name, args, target):
    task = make_task(make_dag(name, *args), target)
    programs = _population(task, seed=len(name))
    groups = _structures(programs)
    assert len(groups) >= 2 and max(len(idx) for idx in groups.values()) >= 3
    for key, idx in groups.items():
        state = programs[idx[0]].state
        fast_template = FeatureTemplate(state, task)
        numbers = np.array([state_numbers(programs[i], fast_template.slots) for i in idx])
        fast = fast_template(numbers)
        slow = _reference(state, task)(numbers)
        assert fast.shape == slow.shape
        assert np.isfinite(fast).all()
        assert np.array_equal(fast, slow), f"{name} on {target}: structure {key[:80]}... differs"
    # and through the extractor (one template per part structure, evaluated for all its members)
    got = FeatureExtractor(task)(programs)
    for i in range(0, len(programs), 7):
        ref = _reference(programs[i].state, task)
        want = ref(np.array([state_numbers(programs[i], ref.slots)]))[0]
        assert np.array_equal(got[i], want)


def _structures(programs) -> dict[str, list[int]]:
    """Positions of programs by whole-program structure."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(programs):
        groups.setdefault(structure_key(p), []).append(i)
    return groups


class _CheckedFacts:
    """`_BodyFacts` that also walk the substituted body the old way and compare, each time a template
    asks for a stage's op counts and first loads."""
    checked = 0

    def __init__(self, body: te.Expr):
        self.body, self.facts = body, _BodyFacts.of(body)

    def substituted(self, values: dict):
        ops, loads = self.facts.substituted(values)
        src = te.substitute(self.body, values)
        nonzero = lambda c: {k: v for k, v in c.items() if v}      # noqa: E731
        assert nonzero(ops) == nonzero(reference_count_ops(src))
        want = reference_first_loads(src)
        assert list(loads) == list(want)
        for t in want:
            assert [te.structural_key(i) for i in loads[t][0]] == [te.structural_key(i) for i in want[t][0]]
        _CheckedFacts.checked += 1
        return ops, loads


WINOGRAD_F4 = ("conv2d_winograd", (1, 8, 8, 8, 8, 1, 4), "llvm -num-threads=2")


# F(4, 3)'s transforms are the large bodies the fast path was written for; walking them substituted, the
# check itself takes 10 s, and F(2, 3) ("conv2d_winograd") goes through the same code: -m slow.
@pytest.mark.parametrize("name,args,target",
                         TASKS + [pytest.param(*WINOGRAD_F4, marks=pytest.mark.slow)],
                         ids=[f"{n}-{t.split()[0]}" for n, _, t in TASKS] + ["winograd_f4-llvm"])
def test_body_facts_equal_walking_the_body_with_its_loop_values_put_in(name, args, target):
    """Op counts and first loads come from the body as written plus its loop values, not from the body
    with the values substituted (which a large Winograd transform made slow): the same numbers as
    walking the substituted body, for every stage of every structure of a sampled population."""
    task = make_task(make_dag(name, *args), target)
    programs = _population(task, seed=len(name) + 1)
    _CheckedFacts.checked = 0
    groups = _structures(programs)
    for idx in groups.values():
        FeatureTemplate(programs[idx[0]].state, task, _CheckedFacts)
    assert len(groups) >= 2 and _CheckedFacts.checked >= len(groups)      # every structure, each stage


def test_tree_walks_count_shared_subtrees_as_often_as_the_tree_holds_them():
    """The op count and the first loads walk each shared node once, but count as a tree walk does."""
    i, j = te.Var("i"), te.Var("j")
    A = te.placeholder((64, 64), name="A")
    idx = i * 8 + j                       # one node: twice in each of three loads, once in the condition
    load = A[idx // 64, idx % 64]
    e = te.binary("add", te.binary("mul", load, load), te.if_then_else(te.compare("lt", idx, 5), load, 0.0))
    ops = _tree_counts([(e, 1)])[0]
    assert dict(ops) == dict(reference_count_ops(e))
    assert ops["int_mul"] == 7 and ops["float_mul"] == 1
    first = _first_loads(e)
    assert list(first) == ["A"] and first["A"][0] is reference_first_loads(e)["A"][0]


def test_body_facts_of_a_loop_value_that_is_the_constant_zero_fold_as_substitution_does():
    """A whole reduction's outer tile (extent 1) fused with a spatial loop has the value 0: substitution
    folds `k0 * 96 + k1` to `k1`, so the op counts are those of the folded body, not the written one's
    plus the values'."""
    x, k0, k1, f = te.Var("x"), te.Var("k0"), te.Var("k1"), te.Var("x@k0@")
    data = te.placeholder((4, 96), name="data")
    body = te.binary("div", data[x, k0 * 96 + k1], te.const(96.0, "float32"))
    values = {x: f, k0: te.const(0), k1: k1}
    ops, loads = _BodyFacts.of(body).substituted(values)
    src = te.substitute(body, values)
    assert {k: v for k, v in ops.items() if v} == {k: v for k, v in reference_count_ops(src).items() if v}
    assert "int_mul" not in {k for k, v in ops.items() if v}
    assert [te.structural_key(i) for i in loads["data"][0]] == [te.structural_key(i) for i in (f, k1)]


def test_one_walk_of_many_weighted_roots_counts_each_tree_as_often_as_its_weight():
    """Loop values are counted in one walk (they share subtrees, and one root may lie inside another):
    the same op counts and variable occurrences as counting each tree alone, times its weight."""
    i, j = te.Var("i"), te.Var("j")
    inner = i * 8 + j
    outer = (inner // 4) * 3 + inner % 4
    roots = [(outer, 2), (inner, 3), (j * 5, 1)]
    ops, occurrences = _tree_counts(roots)
    want: dict[str, int] = {}
    for e, w in roots:
        for f, n in reference_count_ops(e).items():
            want[f] = want.get(f, 0) + w * n
    assert {k: v for k, v in ops.items() if v} == {k: v for k, v in want.items() if v}
    assert occurrences == {i: 2 * 2 + 3, j: 2 * 2 + 3 + 1}


def test_body_facts_keep_the_folded_body_per_set_of_constants_and_stay_exact_for_other_values():
    """The constants fold into the body once; later calls with the same constants and other loop values
    give what substituting everything at once gives."""
    x, k0, k1, y = te.Var("x"), te.Var("k0"), te.Var("k1"), te.Var("y")
    data = te.placeholder((4, 96), name="data")
    body = te.binary("mul", data[x, k0 * 96 + k1], data[x, k1])
    facts = _BodyFacts.of(body)
    for values in ({x: y * 2 + 1, k0: te.const(0), k1: k1}, {x: y, k0: te.const(0), k1: k1 * 3 + y}):
        ops, loads = facts.substituted(values)
        src = te.substitute(body, values)
        assert {k: v for k, v in ops.items() if v} == {k: v for k, v in reference_count_ops(src).items() if v}
        assert [te.structural_key(i) for i in loads["data"][0]] == \
            [te.structural_key(i) for i in reference_first_loads(src)["data"][0]]
    assert len(facts.folded) == 1
