"""The CLI mistakes of issue 20 that tests/test_cli_input.py leaves out: the read commands given a records
path that is a file, and a cluster that refuses the connection, which must fail at once (it used to
wait out the 10 s connect timeout). One `error:` line, a non-zero exit, nothing started."""
from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from tensortune.flows.cli import app
from tests.test_cli_input import _closed_port, paths  # noqa: F401 - paths is the fixture used below


def _one_error_line(argv: list[str], code: int, message: str) -> None:
    result = CliRunner().invoke(app, argv)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == code, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert "Traceback" not in result.output and "Prefect API" not in result.output


@pytest.mark.parametrize("argv", [["history", "--records", "{file}"], ["show", "matmul", "--records", "{file}"],
                                  ["history", "--task", "matmul", "--records", "{file}"]])
def test_a_read_command_given_a_file_for_records_is_one_line(paths, argv):  # noqa: F811
    _one_error_line([a.format(**paths) for a in argv], 2, "is a file, not a record store folder")


def test_a_refused_cluster_fails_at_once(paths):  # noqa: F811
    started = time.monotonic()
    _one_error_line(["tune", "resnet-18", "--cluster", f"tcp://127.0.0.1:{_closed_port()}", "--records",
                     paths["store"]], 1, "no Dask scheduler answers")
    assert time.monotonic() - started < 5                  # not the 10 s connect timeout
