"""The ``fp8rl`` command line. Thin: each command parses its options and calls the package that
does the work, imported lazily so that ``fp8rl --help`` starts fast and needs no GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fp8rl import __version__

app = typer.Typer(
    help="fp8rl: end-to-end FP8 reinforcement-learning post-training of LLMs.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(
    help="Performance benchmarks; each prints ratios measured in one run.", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fp8rl {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """fp8rl: end-to-end FP8 reinforcement-learning post-training of LLMs."""


@bench_app.command("fp8")
def bench_fp8(
    shapes: Annotated[
        str,
        typer.Option(help="llm | square | all | quick | TOKENSxINxOUT[,...]"),
    ] = "all",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    mode: Annotated[str, typer.Option(help="fwd (forward) | train (forward + backward)")] = "fwd",
    repeat: Annotated[int | None, typer.Option(help="timed runs per shape (median reported)")] = None,
    warmup: Annotated[int | None, typer.Option(help="untimed runs first")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results as JSON")] = None,
) -> None:
    """FP8 linear vs BF16 linear at LLM shapes and 8192^3 (activation quantization included)."""
    from workers.fp8 import bench

    try:
        shape_list = bench.parse_shapes(shapes)
        info, rows = bench.run(
            shape_list,
            device=device,
            mode=mode,
            warmup=warmup,
            repeat=repeat,
            progress=lambda msg: typer.echo(msg, err=True),
        )
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    typer.echo(bench.format_table(info, rows))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(bench.to_json(info, rows))
        typer.echo(f"wrote {json_out}", err=True)


if __name__ == "__main__":  # pragma: no cover
    app()
