"""The control-plane client's commands of ``fp8rl``: submit, list, get, cancel, suspend, resume
and logs, each a call of :class:`fp8rl.client.Client` (:mod:`fp8rl.cli` adds them to its own, in place)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from fp8rl.specs import load_spec_or_exit

client_app = typer.Typer()  # its commands join the top level of ``fp8rl`` (fp8rl.cli)

Server = Annotated[str | None, typer.Option(help="Control-plane URL (FP8RL_SERVER).")]
Token = Annotated[str | None, typer.Option(help="Bearer token (FP8RL_TOKEN).")]
Output = Annotated[str, typer.Option("-o", "--output", help="table | json")]


def _client(server: str | None, token: str | None) -> Any:
    from fp8rl.client import Client, ClientError

    try:
        return Client(server, token)
    except ClientError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err


def _show(jobs: list[dict[str, Any]] | dict[str, Any], output: str) -> None:
    from fp8rl.client import table

    if output == "json":
        typer.echo(json.dumps(jobs, indent=2))
    else:
        typer.echo(table(jobs if isinstance(jobs, list) else [jobs]))


def _do(call: Any) -> Any:
    from fp8rl.client import ClientError

    try:
        return call()
    except ClientError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from err


@client_app.command("submit")
def submit_cmd(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="Job spec (YAML or JSON).")],
    name: Annotated[str, typer.Option(help="Job name (DNS label, unique per tenant).")],
    server: Server = None,
    token: Token = None,
    output: Output = "table",
) -> None:
    """Submit a job spec to the control plane."""
    spec = load_spec_or_exit(spec_path)
    client = _client(server, token)
    _show(_do(lambda: client.submit(name, spec.model_dump(mode="json"))), output)


@client_app.command("list")
def list_cmd(
    phase: Annotated[str | None, typer.Option(help="Only jobs in this phase.")] = None,
    server: Server = None,
    token: Token = None,
    output: Output = "table",
) -> None:
    """List your jobs."""
    client = _client(server, token)
    _show(_do(lambda: client.list(phase, limit=500))["items"], output)


@client_app.command("get")
def get_cmd(name: str, server: Server = None, token: Token = None, output: Output = "table") -> None:
    """Show one job: phase, progress, and (with -o json) spec and conditions."""
    client = _client(server, token)
    _show(_do(lambda: client.get(name)), output)


@client_app.command("cancel")
def cancel_cmd(name: str, server: Server = None, token: Token = None) -> None:
    """Cancel a job and delete its record."""
    client = _client(server, token)
    _do(lambda: client.cancel(name))
    typer.echo(f"job {name} cancelled and deleted")


@client_app.command("suspend")
def suspend_cmd(name: str, server: Server = None, token: Token = None, output: Output = "table") -> None:
    """Suspend a job after its current step (with a checkpoint)."""
    client = _client(server, token)
    _show(_do(lambda: client.action(name, "suspend")), output)


@client_app.command("resume")
def resume_cmd(name: str, server: Server = None, token: Token = None, output: Output = "table") -> None:
    """Resume a suspended or failed job from its last checkpoint."""
    client = _client(server, token)
    _show(_do(lambda: client.action(name, "resume")), output)


@client_app.command("logs")
def logs_cmd(
    name: str,
    follow: Annotated[
        bool, typer.Option("-f", "--follow", help="Keep streaming while the job runs.")
    ] = False,
    server: Server = None,
    token: Token = None,
) -> None:
    """Print a job's driver log."""
    client = _client(server, token)

    def stream() -> None:
        for chunk in client.logs(name, follow):
            typer.echo(chunk, nl=False)

    _do(stream)
