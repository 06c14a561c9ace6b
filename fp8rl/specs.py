"""Loading a job spec for a command: shared by ``fp8rl.cli`` and ``fp8rl.bench_cli`` (so that
neither imports the other)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rljob.spec import JobSpec


def load_spec_or_exit(path: Path) -> JobSpec:
    """The job spec at ``path``, or exit 2 with every bad field listed."""
    from rljob.spec import SpecError, load_spec

    try:
        return load_spec(path)
    except SpecError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
