"""Transfer: the tuners store each task beside its records, and the flow's trainer learns from every
stored record of the target, rebuilding other tasks' programs from those files (issue 19)."""
from __future__ import annotations

import os
import shutil

import pandas as pd
import pytest

from tensortune.codegen.measure import LocalBuilder, LocalRunner, ProgramMeasurer
from tensortune.codegen.target import make_task
from tensortune.codegen.timing import TimingConfig
from tensortune.flows.retrain import MODEL_KIND, NewestModel, Trainer, load_newest, retrain
from tensortune.flows.tuning import tune_task
from tensortune.search.sketch_policy import SearchParams, SketchPolicy
from tensortune.storage.layout import TASKS_DIR
from tensortune.storage.models import ModelStore
from tensortune.storage.records import RecordStore
from tensortune.storage.tasks import TaskStore
from tensortune.tasks.search_task import SearchTask
from tensortune.tasks.workload_registry import make_dag

PARAMS = SearchParams(population=128, sample_init_population=128, num_iters=1, num_measures_per_round=12)
TRIALS = 24


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """Two matmul tasks tuned into one store: `other` stands for another network's task."""
    root = str(tmp_path_factory.mktemp("transfer") / "records")
    store = RecordStore(root)
    other, mine = make_task(make_dag("matmul", 64, 64, 64)), make_task(make_dag("matmul", 96, 96, 48))
    m = ProgramMeasurer(LocalBuilder(), LocalRunner(config=TimingConfig(min_repeat_ms=5, repeat=1)))
    try:
        for i, task in enumerate((other, mine)):
            tune_task(task, TRIALS, measurer=m, params=PARAMS, records=store, seed=i)
    finally:
        m.close()
    return root, store, other, mine


def test_the_tuner_stores_each_task_beside_its_records_once(tuned):
    root, _, other, mine = tuned
    stored = TaskStore(root).descriptions()
    assert set(stored) == {other.workload_key, mine.workload_key}
    assert SearchTask.from_json(stored[other.workload_key]).workload_key == other.workload_key
    assert not TaskStore(root).add(other.workload_key, "something else")     # the first writer wins
    assert SearchTask.from_json(TaskStore(root).descriptions()[other.workload_key]).workload_key == other.workload_key
    # readers of the records see records only
    assert len(pd.read_parquet(root)) == 2 * TRIALS


def test_a_write_in_flight_is_never_read(tuned):
    root = tuned[0]
    folder = os.path.join(root, TASKS_DIR)
    with open(os.path.join(folder, ".abc.json.1234abcd.tmp"), "w") as f:
        f.write('{"workload_key": "ab')                          # a writer that died mid-write
    assert len(TaskStore(root).descriptions()) == 2


def test_with_transfer_the_trainer_learns_from_every_task_of_the_target(tuned):
    """... and trains on a few programs of a task the network does not have (here at most 8 of other's 24:
    train_programs=32 bounds another network's task to a quarter of that), all of its own task's."""
    root, store, other, mine = tuned
    alone = Trainer([mine], mine.target, warmup=8, transfer=False)
    assert alone.read_new(store) == TRIALS
    both = Trainer([mine], mine.target, warmup=8, transfer=True, train_programs=32)
    assert both.read_new(store) == 2 * TRIALS
    assert set(both.xgb.data) == {other.workload_key, mine.workload_key}
    report = retrain(both, store, ModelStore(root), NewestModel())
    assert report.trained and report.record_count == 2 * TRIALS and report.metrics["n_programs"] == TRIALS + 8
    assert both.read_new(store) == 0                               # nothing read twice


def test_a_stored_model_of_another_kind_is_not_loaded(tuned, tmp_path):
    """A booster stored before one row a program (kind "xgb-packsum", per-stage rows) reads other
    columns: the flow's load leaves the search on its random model, and the next retrain stores one of
    today's kind, which loads and ranks programs."""
    _, store, _, mine = tuned
    models = ModelStore(str(tmp_path / "models"))
    trainer = Trainer([mine], mine.target, warmup=8)
    trainer.read_new(store)
    trainer.xgb.fit()
    models.save(mine.target, trainer.xgb.save_bytes(), {}, record_count=TRIALS, kind="xgb-packsum")
    holder = NewestModel()
    assert load_newest(models, mine.target, holder) == "" and holder.version == "" and holder.is_random
    report = retrain(trainer, store, models, holder)
    assert report.trained and models.load_newest(mine.target)[1]["kind"] == MODEL_KIND
    again = NewestModel()
    assert load_newest(models, mine.target, again) == report.version and not again.is_random
    scores = again.predict(mine, SketchPolicy(mine, seed=0).sample(16))
    assert scores.shape == (16,) and len(set(scores.tolist())) > 1


def test_records_of_a_task_never_stored_are_skipped_and_named(tuned, tmp_path):
    root, store, other, mine = tuned
    copy = tmp_path / "records"
    shutil.copytree(root, copy)
    os.remove(copy / TASKS_DIR / f"{other.workload_key}.json")     # a store written before task files
    trainer = Trainer([mine], mine.target, warmup=8, transfer=True)
    assert trainer.read_new(RecordStore(str(copy))) == TRIALS
    assert trainer.unknown == {other.workload_key}


def test_the_transfer_benchmark_trains_on_every_task_of_the_history(tuned, tmp_path, capsys):
    """bench transfer's model (bench.transfer.history_model) has read both stored tasks' records for a
    task that has none, as the flow's retrain step does; a history without records for the target, or
    without the folder, or an unknown network, is one line and exit 2 before any tuning."""
    from bench.transfer import history_model, main
    root, _, other, mine = tuned
    newcomer = make_task(make_dag("matmul", 128, 128, 128))
    model, programs, keys, unknown = history_model([root], [newcomer], seed=0)
    assert programs == 2 * TRIALS and keys == 2 and not unknown
    assert model.booster is not None and model.n_programs == programs     # (48 < 100: still "random" by warm-up)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as exit_:
        history_model([str(empty)], [newcomer], seed=0)
    assert "no records for" in str(exit_.value.code)
    assert main(["resnet-18", "--history", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --history {tmp_path / 'nowhere'}: no such folder"
    assert main(["resnet-7", "--history", root]) == 2
    assert capsys.readouterr().err.strip().startswith("error: unknown network 'resnet-7'; known: ")


def test_the_transfer_benchmark_resumes_the_tasks_the_history_shares(tuned, tmp_path):
    """bench transfer's transfer run tunes into a store holding the history's records of the network's own
    tasks: a task the history shares resumes from its stored best, one it lacks starts with none."""
    from bench.transfer import history_model, retimed_parts, shared_records
    from tensortune.flows.tuning import NetworkTuner
    root, store, other, mine = tuned
    with pytest.raises(SystemExit) as exit_:          # all of the history resumes: no model to learn
        history_model([root], [mine, other], seed=0, exclude=(mine.workload_key, other.workload_key))
    assert "own tasks, which resume" in str(exit_.value.code)
    newcomer = make_task(make_dag("matmul", 128, 128, 128))
    shared = shared_records([root], [mine, newcomer])
    assert list(shared) == [mine.workload_key] and len(shared[mine.workload_key]) == TRIALS
    transfer = RecordStore(str(tmp_path / "transfer"))
    transfer.append(shared[mine.workload_key])
    tuner = NetworkTuner([mine, newcomer], 2 * TRIALS, None, records=transfer, params=PARAMS)
    assert tuner.history == [TRIALS, 0]
    stored = store.records_of(mine.workload_key)
    assert tuner.sched.best_costs[0] == pytest.approx(stored.loc[stored.error_code == 0, "mean_latency"].min())
    assert tuner.result.best_steps[1] is None
    # the resumed task's best timed again now: a finite part of the estimate; the other task has no part
    m = ProgramMeasurer(LocalBuilder(), LocalRunner(config=TimingConfig(min_repeat_ms=5, repeat=1)))
    try:
        parts = retimed_parts(m, {"transfer": tuner}, {mine.workload_key}, passes=2)
        assert 0 < parts["transfer"] < 1 and retimed_parts(m, {"transfer": tuner}, set()) == {"transfer": 0.0}
    finally:
        m.close()


def test_the_tune_benchmarks_transfer_row_leaves_the_tasks_own_records_out(tuned, tmp_path, capsys):
    """bench tune --history: the transfer row's model learns from the other tasks only (what another
    task's history is worth), and a missing store is one line and exit 2 before anything is tuned."""
    from bench.transfer import history_model
    from bench.tune import main
    root, _, other, mine = tuned
    model, programs, keys, _ = history_model([root], [mine], seed=0, exclude=(mine.workload_key,))
    assert programs == TRIALS and set(model.data) == {other.workload_key}
    assert main(["--workloads", "matmul", "--history", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --history {tmp_path / 'nowhere'}: no such folder"


def test_bench_network_retimes_a_store_the_flow_wrote_and_names_the_tasks_it_lacks(tuned, tmp_path):
    """`python -m bench network --retime --records DIR` reads a user's store (what `tensortune tune` writes)
    as well as its own runs' DIR/<network>/gradient; a task the store has no program for is named, not
    built with the runtime's default schedule and timed as if it were tuned."""
    from bench.network import MissingPrograms, retime_store, stored_result
    root, _, other, mine = tuned
    assert retime_store(root, "resnet-18") == root
    runs = tmp_path / "runs"
    (runs / "resnet-18" / "gradient").mkdir(parents=True)
    assert retime_store(str(runs), "resnet-18") == str(runs / "resnet-18" / "gradient")
    assert retime_store(str(runs), "bert-base") is None             # neither a run's layout nor a store
    result = stored_result("two", [other, mine], root, [])
    assert all(result.best_steps) and result.trials == 2 * TRIALS
    newcomer = make_task(make_dag("matmul", 128, 128, 128))
    with pytest.raises(MissingPrograms, match=f"no program for 1 of the 3 tasks of two .*{newcomer.name}"):
        stored_result("two", [other, mine, newcomer], root, [])
    # of a group of alternative forms (a conv and its Winograd form), one stored program is enough
    assert stored_result("two", [other, mine, newcomer], root, [(1, 2)]).best_steps[2] is None


def test_the_first_round_benchmark_refuses_bad_sizes_in_one_line(capsys):
    from bench.first_round import main
    for sizes in ("16", "16,16", "0,16", "a,b"):
        assert main(["resnet-18", "--sizes", sizes]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: --sizes needs two or more distinct positive sizes, got {sizes!r}"
    assert main(["resnet-18", "--trials", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --trials needs a positive budget, got 0"
    assert main(["resnet-7"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: unknown network 'resnet-7'; known: ")


@pytest.mark.slow
def test_the_first_round_benchmark_compares_sizes_on_one_budget(tmp_path, capsys):
    """Both runs spend the whole budget, the short first round in more rounds; both networks pass their
    check and are timed in pairs."""
    import json

    from bench.first_round import main
    out = tmp_path / "row.json"
    assert main(["resnet-18", "--image-size", "32", "--trials", "40", "--sizes", "2,1", "--pairs", "2",
                 "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["per_round"] == 2 and row["first_2_rounds"] == 20 and row["first_1_rounds"] > 20
    assert sum(row["first_2_trials_per_task"]) == sum(row["first_1_trials_per_task"]) == 40
    assert row["first_2_check"] == row["first_1_check"] == "ok" and row["failed_pairs"] == 0
    assert row["first_2_ms"] > 0 and row["first_1_ms"] > 0
