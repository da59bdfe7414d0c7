"""The `tensortune` command line: one typer app, one sub-command per user job."""
from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="tensortune: Ansor-style auto-scheduling of tensor programs.")


def _register_commands() -> None:
    # Each module adds its commands to `app`; importing them here keeps cli.py the single entry point.
    from flows import history_cli, tune_cli  # noqa: F401
    from flows import network_cli  # noqa: F401
    from flows import flow_cli  # noqa: F401


def main() -> None:
    _register_commands()
    app()
