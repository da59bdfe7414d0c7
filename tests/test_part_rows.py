"""PartRows: a part's feature rows kept by (structure, open numbers) give every program the features
its own evaluation gives, and a call evaluates only the parts it has not met."""
from __future__ import annotations

import numpy as np

from tensortune.codegen.target import make_task
from tensortune.search.feature import FeatureExtractor
from tensortune.search.feature_pool import Featurizer
from tensortune.search.part_rows import PartRows
from tensortune.tasks.workload_registry import make_dag
from tests.test_feature_fast import _population
from tests.test_feature_parts import WINOGRAD_NHWC_F4


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    """a (a Featurizer's float32 rows) equal b (an extractor's float64 rows) as float32."""
    return len(a) == len(b) and all(np.array_equal(x, y.astype(np.float32)) for x, y in zip(a, b))


def test_kept_rows_are_the_rows_a_fresh_extractor_makes():
    """Parents, then their mutants and crossover children mixed with programs met before: each call's
    features equal a fresh FeatureExtractor's, and the second call evaluates only parts it had not met."""
    name, args, target = WINOGRAD_NHWC_F4
    task = make_task(make_dag(name, *args), target)
    programs = _population(task, seed=5)            # 48 sampled programs, then children of them
    first, second = programs[:48], programs[24:]
    featurizer = Featurizer(processes=0)
    try:
        assert _same(featurizer(task, first), FeatureExtractor(task)(first))
        ex = featurizer.extractor(task)
        kept = featurizer.part_rows
        distinct = new = 0
        for key, members in ex.groups(second).items():
            numbers = ex.numbers(second, members)
            distinct += len(PartRows().new_numbers(task.workload_key + key, numbers))
            new += len(kept.new_numbers(task.workload_key + key, numbers))
        assert 0 < new < distinct, (new, distinct)    # some parts met in the first call, some not
        assert _same(featurizer(task, second), FeatureExtractor(task)(second))
        assert _same(featurizer(task, second), FeatureExtractor(task)(second))   # all kept now
        assert all(len(kept.new_numbers(task.workload_key + key, ex.numbers(second, members))) == 0
                   for key, members in ex.groups(second).items())
    finally:
        featurizer.close()


def test_tasks_with_one_part_structure_keep_rows_apart():
    """A part's structure key names steps and stage positions, not shapes: two convs of other sizes
    share keys, and their rows must not."""
    small = make_task(make_dag("conv2d_relu", 1, 14, 14, 16, 16, 3, 3, 1, 1))
    large = make_task(make_dag("conv2d_relu", 1, 28, 28, 32, 32, 3, 3, 1, 1))
    programs, others = _population(small, seed=2)[:40], _population(large, seed=2)[:40]
    assert set(FeatureExtractor(small).groups(programs)) & set(FeatureExtractor(large).groups(others))
    featurizer = Featurizer(processes=0)
    try:
        assert _same(featurizer(small, programs), FeatureExtractor(small)(programs))
        assert _same(featurizer(large, others), FeatureExtractor(large)(others))
    finally:
        featurizer.close()


def test_a_full_store_is_emptied_only_when_a_call_starts():
    kept = PartRows(max_parts=3)
    numbers = np.array([[1, 2], [3, 4], [1, 2], [5, 6]], dtype=np.int64)
    new = kept.new_numbers("s", numbers)
    assert new.tolist() == [[1, 2], [3, 4], [5, 6]]           # each distinct once
    kept.keep("s", new, np.arange(3 * 2 * 4, dtype=np.float64).reshape(3, 2, 4))
    got = kept.block("s", numbers)
    assert got.dtype == np.float32 and got.shape == (4, 2, 4)
    assert np.array_equal(got[0], got[2]) and got[3].tolist() == np.arange(16, 24).reshape(2, 4).tolist()
    kept.keep("t", np.array([[7]]), np.zeros((1, 1, 4)))        # over the bound: still readable in this call
    assert kept.block("s", numbers).shape == (4, 2, 4)
    kept.trim()                                                 # the next call starts afresh
    assert kept.new_numbers("s", numbers).tolist() == [[1, 2], [3, 4], [5, 6]]
    small = PartRows(max_parts=10)
    small.keep("s", new, np.zeros((3, 2, 4)))
    small.trim()
    assert len(small.new_numbers("s", numbers)) == 0            # under the bound: kept
