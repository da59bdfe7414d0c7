"""bench search: one proposal per task from a resumed store, timed, the same programs in every pass."""
from __future__ import annotations

import json
import random

import pytest

from bench.search import main
from tensortune.codegen.measure import MeasureResult
from tensortune.flows.tuning import network_tasks, to_records
from tensortune.search.sketch_policy import SketchPolicy
from tensortune.storage.records import RecordStore


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["--records", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --records {tmp_path / 'missing'}: no such folder"
    assert main(["--records", str(tmp_path), "--passes", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --passes must be at least 1, got 0"
    assert main(["no-such-net", "--records", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_a_resumed_store_gives_the_same_proposals_in_every_pass(tmp_path, capsys):
    """The first two tasks of the main job's network, one with a stored history (the cost model trains
    on it), each proposing a round in two fresh tuners: the rows say how long, the digests that both
    passes proposed the same programs (what lets two commits be compared on the same work)."""
    _, tasks = network_tasks("resnet-18", "llvm -num-threads=2", image_size=32)
    conv = tasks[1]
    programs = SketchPolicy(conv, seed=3).sample(40)
    rng = random.Random(0)
    results = [MeasureResult([rng.uniform(1e-4, 1e-3)], 0) for _ in programs]
    store = RecordStore(str(tmp_path / "records"))
    store.append(to_records(conv, programs, results, round_=0))
    out = tmp_path / "search.json"
    assert main(["--records", str(tmp_path / "records"), "--tasks", "2", "--trials", "40", "--population", "64",
                 "--passes", "2", "--threads", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["stored_programs"] == len(programs)
    assert [r["name"] for r in doc["rows"]] == [t.name for t in tasks[:2]]
    # a round is min(64, 40 trials / 2 tasks); the transpose's whole space is smaller
    assert doc["rows"][1]["programs"] == 20 and 0 < doc["rows"][0]["programs"] <= 20
    assert all(len(r["search_s_passes"]) == 2 and min(r["search_s_passes"]) > 0 for r in doc["rows"])
    # the phases are parts of the proposal: drawing, scoring and mutating, no more than the whole
    conv_row = doc["rows"][1]
    assert conv_row["sample_s"] > 0 and conv_row["predict_s"] > 0 and conv_row["evolve_s"] > 0
    assert all(r["sample_s"] + r["predict_s"] + r["evolve_s"] <= r["search_s"] for r in doc["rows"])
    assert len(doc["digests"]) == 2 and doc["digests"][0] == doc["digests"][1]
    assert "programs identical across passes" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--records", str(tmp_path), "--passes", "x"])
