"""The `tensortune` command line: one typer app, one sub-command per user job.

The command modules add their commands to `flows.cli_app.app` when imported; importing them here makes
this file the single entry point (and `flows.cli.app` the app with every command on it).
"""
from __future__ import annotations

from tensortune.flows import (  # noqa: F401 - each adds its commands
    compile_cli,
    deploy_cli,
    flow_cli,
    history_cli,
    interop_cli,
    network_cli,
    tune_cli,
)
from tensortune.flows.cli_app import app


def main() -> None:
    app()
