"""Every CLI mistake a user makes is answered before anything starts: one `error:` line, a non-zero exit,
no traceback, no Prefect server or flow run (issue 20). Run through typer's runner, in process."""
from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from tensortune.flows.cli import app
from tensortune.flows.cli_input import MODELS
from tensortune.flows.deploy_cli import host_problem
from tensortune.search.cost_model import DEFAULT_MODEL, MODEL_OBJECTIVES
from tensortune.storage.records import MeasureRecord, RecordStore


def _closed_port() -> int:
    with socket.socket() as s:          # bound, never listening: a connection to it is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("TENSORTUNE_RECORDS", raising=False)
    monkeypatch.delenv("TENSORTUNE_CLUSTER", raising=False)
    (tmp_path / "a-file").write_text("not a store")
    (tmp_path / "random.onnx").write_bytes(bytes(range(256)) * 4)
    store = tmp_path / "store"
    store.mkdir()
    # a store with one record file cut short (a disk that filled, a copy that stopped) and one with a
    # file that is no record file at all
    corrupt = RecordStore(str(tmp_path / "corrupt"))
    corrupt.append([MeasureRecord(workload_key="k", target="llvm", steps="[]", latencies=[1e-3])])
    part = next((tmp_path / "corrupt").rglob("*.parquet"))
    part.write_bytes(part.read_bytes()[:200])
    stray = RecordStore(str(tmp_path / "stray"))
    stray.append([MeasureRecord(workload_key="k", target="llvm", steps="[]", latencies=[1e-3])])
    (tmp_path / "stray" / "notes.txt").write_text("not a record file")
    return {"file": str(tmp_path / "a-file"), "missing": str(tmp_path / "nowhere"), "store": str(store),
            "onnx": str(tmp_path / "random.onnx"), "corrupt": str(tmp_path / "corrupt"),
            "stray": str(tmp_path / "stray")}


MISTAKES = [
    (["tune-op", "matmul", "--args", "128,128", "--trials", "1"], 2, "matmul takes 3 sizes (N, M, K), got 2"),
    (["tune-op", "matmul", "--trials", "0"], 2, "--trials must be between 1 and"),
    (["tune-op", "matmul", "--trials", "-5"], 2, "--trials must be between 1 and"),
    (["tune-op", "matmul", "--trials", str(10 ** 12)], 2, "--trials must be between 1 and"),
    (["tune-op", "matmul", "--per-round", "0"], 2, "--per-round must be between 1 and"),
    (["tune-op", "matmul", "--model", "foo", "--trials", "1"], 2,
     "unknown cost model 'foo'; use xgb-blend or xgb or xgb-rank or random"),
    (["tune-op", "matmul", "--records", "{file}", "--trials", "1"], 2, "is a file"),
    (["best", "--records", "{missing}"], 2, "no record store at"),
    (["best", "--records", "{file}"], 2, "is a file, not a record store"),
    (["history", "--records", "{missing}"], 2, "no record store at"),
    (["best", "--records", "file://{missing}"], 2, "no record store at file://"),
    (["history", "--task", "no_such_task", "--records", "{store}"], 1, "no records of task 'no_such_task'"),
    (["show", "matmul", "--records", "{missing}"], 2, "no record store at"),
    (["run-network", "resnet-18", "--records", "{missing}"], 2, "no record store at"),
    (["run-network", "resnet-18", "--records", "{file}"], 2, "is a file"),
    (["tune", "nosuchnet"], 2, "unknown network 'nosuchnet'"),
    (["tune", "{onnx}"], 2, "not a valid ONNX model"),
    (["tune", "{missing}.onnx"], 2, "no such file"),
    (["tune", "resnet-18", "--trials", "0"], 2, "--trials must be between 1 and"),
    (["tune", "resnet-18", "--per-round", "0"], 2, "--per-round must be between 1 and"),
    (["tune", "resnet-18", "--records", "{file}/records"], 2, "is a file"),
    (["tune", "resnet-18", "--target", "llvm -num-threads=0"], 2, "num-threads"),
    (["tune", "resnet-18", "--cluster", "nonsense"], 2, "is not a scheduler address"),
    (["tune", "resnet-18", "--cluster", "tcp://127.0.0.1:{closed}"], 1, "no Dask scheduler answers"),
    (["tune", "resnet-18", "--port", "70000"], 2, "--port must be a TCP port"),
    (["tune-op", "matmul", "--args", "64,64,64,64"], 2, "matmul takes 3 sizes (N, M, K), got 4"),
    (["show", "matmul", "--args", "64,64,64,64"], 2, "matmul takes 3 sizes (N, M, K), got 4"),
    (["extract", "resnet-18", "--target", "bogus"], 2, "unknown target 'bogus'"),
    (["extract", "resnet-18", "--target", ""], 2, "--target is empty"),
    (["run-network", "resnet-18", "--target", "bogus"], 2, "unknown target 'bogus'"),
    (["run-network", "resnet-18", "--compiled", "--target", "cuda -arch=sm_90"], 2, "--compiled runs a CPU library"),
    (["best", "--records", "{store}", "--target", "bogus"], 2, "unknown target 'bogus'"),
    (["compile", "resnet-18", "-o", "{file}/lib"], 2, "a-file is a file"),
    (["make-certs", "{file}/certs"], 2, "a-file is a file"),
    (["make-certs", ""], 2, "the certificate folder is empty"),
    (["make-certs", "certs", "--host", "bad host!"], 2, "is not a host name or IP address"),
    (["make-certs", "certs", "--host", "10.0.0.5:8786"], 2, "a port does not belong in --host"),
    (["history", "--records", "{store}", "--per-round"], 2, "--per-round needs --task"),
    (["tune-op", "matmul", "--retime", "-1"], 2, "--retime must be at least 0, got -1"),
    (["run-network", "resnet-18", "--threads", "0"], 2, "--threads must be at least 1, got 0"),
    (["tune", "resnet-18", "--population", "8"], 2, "--population must be at least 16, got 8"),
    (["tune", "resnet-18", "--train-programs", "-1"], 2, "--train-programs must be at least 0, got -1"),
    (["extract", "resnet-18", "--image-size", "0"], 2, "--image-size must be at least 1, got 0"),
    # a store that cannot be read fails before the work: no traceback after a build or a banner
    *[(argv, 1, f"record store {{{which}}} holds 1 file(s) that are not readable") for which in ("corrupt", "stray")
      for argv in (["best", "--records", f"{{{which}}}"], ["history", "--records", f"{{{which}}}"],
                   ["show", "matmul", "--records", f"{{{which}}}"],
                   ["run-network", "resnet-18", "--records", f"{{{which}}}"],
                   ["compile", "resnet-18", "-o", "lib", "--records", f"{{{which}}}"],
                   ["tune-op", "matmul", "--trials", "1", "--records", f"{{{which}}}"],
                   ["tune", "resnet-18", "--records", f"{{{which}}}"],
                   ["export-tvm", "--records", f"{{{which}}}", "--out", "x.json"])],
]


@pytest.mark.parametrize("argv,code,message", MISTAKES, ids=[" ".join(m[0][:3]) for m in MISTAKES])
def test_a_mistake_is_one_line_and_a_nonzero_exit(paths, argv, code, message):
    argv = [a.format(closed=_closed_port(), **paths) for a in argv]
    message = message.format(**paths)
    result = CliRunner().invoke(app, argv)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == code, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert "Traceback" not in result.output and "Prefect API" not in result.output


@pytest.mark.parametrize("host", ["localhost", "10.0.0.5", "::1", "*.example.com", "dask_scheduler",
                                  "node-3.cluster.example.com."])
def test_a_host_a_certificate_can_carry_is_taken(host):
    assert host_problem(host) is None


def test_the_cli_checks_model_names_against_the_models_there_are():
    """The CLI checks --model before it imports the search (cli_input.MODELS); the names it accepts are
    the learned models search.cost_model builds and the random one, the default first."""
    assert MODELS == (*MODEL_OBJECTIVES, "random") and MODELS[0] == DEFAULT_MODEL
