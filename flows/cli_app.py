"""The `tensortune` typer app that every command module adds its commands to (flows.cli runs it)."""
from __future__ import annotations

from importlib import metadata

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="tensortune: Ansor-style auto-scheduling of tensor programs.")


def _version(value: bool) -> None:
    if value:
        try:
            version = metadata.version("tensortune")
        except metadata.PackageNotFoundError:
            version = "unknown (not installed)"
        typer.echo(f"tensortune {version}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")) -> None:
    """tensortune: Ansor-style auto-scheduling of tensor programs."""
