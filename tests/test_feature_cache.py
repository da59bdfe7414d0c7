"""The store's feature cache: a trainer that reads a store again takes its programs' features from it,
bit for bit what it would compute; anything wrong with the cache costs time, never a wrong feature."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tensortune.codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
from tensortune.codegen.target import make_task
from tensortune.codegen.timing import TimingConfig
from tensortune.flows.retrain import Trainer
from tensortune.flows.tuning import NetworkTuner, tune_task
from tensortune.search.cost_model import XGBModel
from tensortune.search.feature_pool import Featurizer, feature_code_digest, source_digest
from tensortune.search.sketch_policy import SearchParams
from tensortune.storage.feature_cache import MERGE_AT, FeatureCache, digest
from tensortune.storage.layout import FEATURES_DIR, TASKS_DIR
from tensortune.storage.records import RecordStore
from tensortune.tasks.workload_registry import make_dag

PARAMS = SearchParams(population=128, sample_init_population=128, num_iters=1, num_measures_per_round=12)
TRIALS = 24


class CountingFeaturizer(Featurizer):
    """The real featurizer, counting the programs it was asked for."""

    def __init__(self) -> None:
        super().__init__(processes=0)
        self.programs = 0

    def __call__(self, task, states):
        self.programs += len(states)
        return super().__call__(task, states)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """Two matmul tasks tuned into one store."""
    root = str(tmp_path_factory.mktemp("features") / "records")
    tasks = [make_task(make_dag("matmul", 64, 64, 64)), make_task(make_dag("matmul", 96, 96, 48))]
    m = ProgramMeasurer(LocalBuilder(), LocalRunner(config=TimingConfig(min_repeat_ms=5, repeat=1)))
    try:
        for i, task in enumerate(tasks):
            tune_task(task, TRIALS, measurer=m, params=PARAMS, records=RecordStore(root), seed=i)
    finally:
        m.close()
    return root, tasks


def read(root: str, tasks, cache: bool = True) -> tuple[Trainer, CountingFeaturizer]:
    features = CountingFeaturizer()
    trainer = Trainer(tasks, tasks[0].target, features=features, transfer=True, cache_features=cache)
    assert trainer.read_new(RecordStore(root)) == 2 * TRIALS
    return trainer, features


def same_data(a: Trainer | XGBModel, b: Trainer | XGBModel) -> bool:
    x, y = (m.xgb if isinstance(m, Trainer) else m for m in (a, b))
    return list(x.data) == list(y.data) and all(
        len(x.data[k]) == len(y.data[k])
        and all(np.array_equal(fa, fb) and fa.dtype == fb.dtype and np.array_equal(ka, kb) and ta == tb
                for ((fa, ka), ta), ((fb, kb), tb) in zip(x.data[k], y.data[k]))
        for k in x.data)


def three_reads(tuned, tmp_path, reader) -> tuple[str, list]:
    """`reader(root, tasks, cache=...)` -> (reader, its CountingFeaturizer) on a copy of the store three
    times: without the cache (nothing written), filling it and from it, every program featurised by the
    first two and none by the third; the copy's root and the three readers."""
    root = str(tmp_path / "records")
    shutil.copytree(tuned[0], root)
    plain, computed = reader(root, tuned[1], cache=False)
    assert computed.programs == 2 * TRIALS and not os.path.exists(os.path.join(root, FEATURES_DIR))
    first, computed = reader(root, tuned[1])
    assert computed.programs == 2 * TRIALS
    again, computed = reader(root, tuned[1])
    assert computed.programs == 0
    return root, [plain, first, again]


def test_a_second_read_takes_every_feature_from_the_cache_bit_for_bit(tuned, tmp_path):
    root, (plain, first, again) = three_reads(tuned, tmp_path, read)
    assert same_data(plain, first) and same_data(plain, again)
    assert len(pd.read_parquet(root)) == 2 * TRIALS          # readers of the records see records only
    assert not [p for p in Path(root).rglob("*.parquet") if "_features" in p.parts]     # nor a DuckDB glob
    assert RecordStore(root).check() == {}


def test_only_new_programs_are_featurised_and_saved(tuned, tmp_path):
    """A flow's trainer reads the store at every retrain: each read featurises and saves the programs
    added since, and a later trainer finds all of them."""
    (root, (first, second)), grown = tuned, str(tmp_path / "records")
    for task in (first, second):
        RecordStore(grown).append(RecordStore(root).load_records(workload_key=task.workload_key))
        if task is first:
            features = CountingFeaturizer()
            trainer = Trainer([first, second], first.target, features=features, transfer=True)
            shutil.copytree(os.path.join(root, TASKS_DIR), os.path.join(grown, TASKS_DIR))
        assert trainer.read_new(RecordStore(grown)) == TRIALS
    assert features.programs == 2 * TRIALS
    assert len(list(Path(grown, FEATURES_DIR, feature_code_digest()).glob("*.features"))) == 2
    assert len(FeatureCache(grown, feature_code_digest()).load()) == 2 * TRIALS
    _, counted = read(grown, [first, second])
    assert counted.programs == 0


def test_files_that_cannot_be_read_cost_only_time(tuned, tmp_path):
    root = str(tmp_path / "records")
    shutil.copytree(tuned[0], root)
    plain, _ = read(root, tuned[1], cache=False)
    read(root, tuned[1])
    folder = Path(root, FEATURES_DIR, feature_code_digest())
    (good,) = folder.glob("*.features")
    data = good.read_bytes()
    good.write_bytes(data[: len(data) // 2])                 # truncated
    (folder / "0123abcd.features").write_bytes(b"not parquet")
    again, computed = read(root, tuned[1])
    assert computed.programs == 2 * TRIALS and same_data(plain, again)


def test_many_files_are_merged_into_one_with_the_same_entries(tmp_path):
    cache = FeatureCache(str(tmp_path), "abc123")
    rng = np.random.default_rng(0)
    saved = {}
    for i in range(MERGE_AT + 1):
        entry = {(digest("task"), digest(f"steps {i}")): rng.random((i % 3 + 1, 164), dtype=np.float32)}
        cache.save(entry)
        saved.update(entry)
    folder = tmp_path / FEATURES_DIR / "abc123"
    assert len(list(folder.glob("*.features"))) == MERGE_AT + 1
    loaded = cache.load()
    assert len(list(folder.glob("*.features"))) == 1
    for loaded_now in (loaded, cache.load()):
        assert loaded_now.keys() == saved.keys()
        assert all(np.array_equal(loaded_now[k], saved[k]) and loaded_now[k].dtype == np.float32 for k in saved)
    assert FeatureCache(str(tmp_path), "other1").load() == {}     # another code's cache is another folder
    with pytest.raises(ValueError, match="letters and digits"):
        FeatureCache(str(tmp_path), "../x")


def test_the_code_digest_follows_the_feature_packages_only(tmp_path):
    root = Path(__file__).resolve().parent.parent
    for package in ("search", "schedule", "tasks", "flows"):
        shutil.copytree(root / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    packages = ("search", "schedule", "tasks")
    before = source_digest(tmp_path, packages)
    assert before == source_digest(root, packages) == feature_code_digest()
    with open(tmp_path / "flows" / "retrain.py", "a") as f:
        f.write("\n# a change outside the feature code\n")
    assert source_digest(tmp_path, packages) == before
    with open(tmp_path / "schedule" / "steps.py", "a") as f:
        f.write("\n# a change the features may depend on\n")
    assert source_digest(tmp_path, packages) != before
    shutil.rmtree(tmp_path / "tasks")                          # compiled files only: no digest, no cache
    assert source_digest(tmp_path, packages) == ""


def resumed(root: str, tasks, cache: bool = True) -> tuple[NetworkTuner, CountingFeaturizer]:
    features = CountingFeaturizer()
    tuner = NetworkTuner(tasks, 2 * TRIALS, None, model=XGBModel(features=features), params=PARAMS,
                         records=RecordStore(root), cache_features=cache)
    assert tuner.history == [TRIALS, TRIALS]
    return tuner, features


def test_a_resume_neither_replays_nor_featurises_what_the_cache_holds(tuned, tmp_path):
    """The library's resume (NetworkTuner with its own model, as the benchmarks use it) reads the cache as
    the flow's trainer does; a program the cache holds replayed under today's code, so it is parsed and
    its loops wait until something needs them. The model learns the same numbers and proposes the same."""
    _, (plain, first, again) = three_reads(tuned, tmp_path, resumed)
    replayed = lambda tuner: sum(c._state is not None for p in tuner.policies  # noqa: E731
                                 for c in p.measured_cands.values())
    assert replayed(plain) == replayed(first) == 2 * TRIALS and replayed(again) == 0
    proposed = lambda tuner: [[c.steps_json for c in tuner.propose(i).candidates] for i in range(2)]  # noqa: E731
    expected = proposed(plain)
    assert [len(batch) for batch in expected] == [PARAMS.num_measures_per_round] * 2
    for tuner in (first, again):
        assert same_data(plain.model, tuner.model)
        assert [p.best_cost for p in tuner.policies] == [p.best_cost for p in plain.policies]
        assert proposed(tuner) == expected
