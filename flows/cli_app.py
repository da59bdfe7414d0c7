"""The `tensortune` typer app that every command module adds its commands to (flows.cli runs it)."""
from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="tensortune: Ansor-style auto-scheduling of tensor programs.")
