"""The ``fp8rl`` command line. Thin: each command parses its options and calls the package that
does the work, imported lazily so that ``fp8rl --help`` starts fast and needs no GPU."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from fp8rl import (
    __version__,
    bench_kernels_cli,  # noqa: F401  # registers its commands on bench_app
)
from fp8rl.bench_cli import bench_app
from fp8rl.client_cli import client_app
from fp8rl.data_cli import data_app
from fp8rl.model_cli import model_app
from fp8rl.specs import load_spec_or_exit

app = typer.Typer(
    help="fp8rl: end-to-end FP8 reinforcement-learning post-training of LLMs.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(bench_app, name="bench")
app.add_typer(model_app, name="model")
app.add_typer(data_app, name="data")


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


@app.command("run")
def run_cmd(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="Job spec (YAML or JSON).")],
    recipe: Annotated[
        str | None, typer.Option(help="Override precision.recipe: bf16 | fp8-gen | fp8-e2e.")
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Override the number of RL steps.")] = None,
    output: Annotated[Path | None, typer.Option(help="Override output_dir.")] = None,
    resume: Annotated[
        bool, typer.Option(help="Continue from the newest checkpoint in the output dir.")
    ] = False,
    seed: Annotated[int | None, typer.Option(help="Override rollout.seed.")] = None,
    is_mode: Annotated[
        str | None,
        typer.Option(help="Override algorithm.importance_sampling.mode (none | tis | icepop | ...)."),
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus /metrics on this port (0: any free port).")
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar (else one line per step).")] = True,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override any field, KEY=VALUE (dotted KEY, VALUE read as YAML), e.g. "
            "precision.fp8_kv_cache=true. Repeatable.",
        ),
    ] = None,
    inject_fault: Annotated[
        list[str] | None,
        typer.Option(
            help="Fault drill ROLE[INDEX]:KIND@STEP (KIND kill | raise | hang | engine), e.g. "
            "generator:kill@10: that actor fails during that step and the job recovers in place. Repeatable."
        ),
    ] = None,
) -> None:
    """Run one RL job on local Ray (or RAY_ADDRESS): generate, reward, train, sync, repeat."""
    from fp8rl.run import run_from_cli

    overrides: dict[str, Any] = {"recipe": recipe, "steps": steps, "output": output, "seed": seed}
    overrides |= {"is_mode": is_mode, "set": set_ or []}
    raise typer.Exit(run_from_cli(spec_path, overrides, resume, metrics_port, progress, inject_fault or []))


@app.command("layer-diff")
def layer_diff_cmd(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="Job spec (YAML or JSON).")],
    checkpoint: Annotated[
        Path | None, typer.Option(help="A run's checkpoints/step_N directory (default: initial weights).")
    ] = None,
    prompts: Annotated[int, typer.Option(min=1, max=1024, help="Prompts sampled (one response each).")] = 8,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    tokens: Annotated[
        int,
        typer.Option(
            min=1,
            max=64,
            help="Tokens the per-layer attribution averages over: the responses' most-differing "
            "tokens, one per response (the module table traces the first).",
        ),
    ] = 1,
    swap: Annotated[
        bool,
        typer.Option(
            "--swap",
            help="Instead: each decoder layer moved to BF16 in both engines, by how much it lowers "
            "the traced tokens' log-prob gap (what the SLO's bf16-layers action would buy).",
        ),
    ] = False,
) -> None:
    """Where the native generator and trainer first differ, module by module, on the token whose
    log-probs differ most (none under precision.exact), and the decoder layers that add most."""
    from fp8rl.layer_diff import report, swap_report

    spec = load_spec_or_exit(spec_path)
    if not swap:
        typer.echo(report(spec, checkpoint, prompts, seed, tokens))
        return
    try:
        typer.echo(swap_report(spec, checkpoint, prompts, seed, tokens))
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err


@app.command("audit")
def audit_cmd(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="Job spec (YAML or JSON).")],
    prompts: Annotated[int, typer.Option(help="Task prompts in the calibration batch.")] = 32,
    seed: Annotated[int, typer.Option(help="Prompt sampling seed.")] = 0,
    role: Annotated[str, typer.Option(help="Whose conversion: generator or trainer.")] = "generator",
    top: Annotated[int, typer.Option(help="Layers listed by outlier ratio.")] = 10,
) -> None:
    """The quantization audit with each linear layer's max |W|, max |x| and input outlier ratio
    (max over channels of max|x| / p99.9|x|) on a batch of the task's prompts."""
    from fp8rl.audit import report as audit_report

    typer.echo(audit_report(load_spec_or_exit(spec_path), prompts, seed, role, top))


@app.command("serve")
def serve_cmd(
    host: Annotated[str | None, typer.Option(help="Address to listen on (FP8RL_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (FP8RL_PORT).")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Port of the Prometheus series, fp8rl_jobs (FP8RL_METRICS_PORT).")
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="SQLite and run directories (FP8RL_DATA_DIR).")
    ] = None,
    tokens_file: Annotated[
        Path | None, typer.Option(help="YAML/JSON {token: tenant} (FP8RL_TOKENS_FILE).")
    ] = None,
    store: Annotated[
        str | None, typer.Option(help="sql (embedded default) or kubernetes (RLJobs) (FP8RL_STORE).")
    ] = None,
    kubeconfig: Annotated[
        str | None, typer.Option(help="With --store kubernetes outside a pod (FP8RL_KUBECONFIG).")
    ] = None,
    allow_unsandboxed_graders: Annotated[
        bool,
        typer.Option(
            "--allow-unsandboxed-graders",
            help="Accept python and code graders (tenants' code) without a grader sandbox "
            "(FP8RL_ALLOW_UNSANDBOXED_GRADERS); only where every tenant is trusted.",
        ),
    ] = False,
) -> None:
    """The control plane. --store sql: SQLite + jobs run as local drivers (the embedded default).
    --store kubernetes: each job is an RLJob in the tenant's namespace, run by `fp8rl operator`."""
    import uvicorn

    from service.auth import TokenFileError
    from service.listener import ListenerLimits, uvicorn_options
    from service.main import create_app
    from service.sandbox import SandboxUnavailable
    from service.settings import Settings

    given = {
        "host": host,
        "port": port,
        "metrics_port": metrics_port,
        "data_dir": data_dir,
        "tokens_file": tokens_file,
        "store": store,
        "kubeconfig": kubeconfig,
        "allow_unsandboxed_graders": allow_unsandboxed_graders or None,
    }
    os.umask(0o077)  # the database, run directories and logs: the service's user's alone
    try:
        settings = Settings(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]
        application = create_app(settings, run_jobs=True)
    except (ValueError, TokenFileError, SandboxUnavailable) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    sandbox = getattr(application.state.executor, "sandbox", None)
    if sandbox is not None:
        typer.echo(f"fp8rl serve: {sandbox.describe()}", err=True)
        from service.graders import GraderUnavailable

        try:
            runtime = application.state.graders.probe()
        except GraderUnavailable as err:  # refused as without a sandbox until one answers
            typer.echo(f"fp8rl serve: the grader runtime did not answer: {err}", err=True)
        else:
            unsafe = " (tenants' code accepted anyway: --allow-unsandboxed-graders)"
            allowed = unsafe if settings.allow_unsandboxed_graders and not runtime.sandboxed else ""
            typer.echo(f"fp8rl serve: python and code graders run in {runtime.how}{allowed}", err=True)
    limits = ListenerLimits(
        header_timeout_s=settings.header_timeout_s,
        idle_timeout_s=settings.idle_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_connections=settings.max_connections,
    )
    uvicorn.run(
        application, host=settings.host, port=settings.port, log_level="info", **uvicorn_options(limits)
    )


@app.command("operator")
def operator_cmd(
    namespace: Annotated[
        list[str] | None, typer.Option("--namespace", "-n", help="Watch this namespace (repeatable).")
    ] = None,
    kubeconfig: Annotated[str | None, typer.Option(help="Kubeconfig file (default: KUBECONFIG).")] = None,
    config: Annotated[
        Path | None, typer.Option(help="YAML of operator defaults (FP8RL_OPERATOR_* otherwise).")
    ] = None,
    liveness: Annotated[
        str | None, typer.Option(help="Serve a liveness probe, e.g. http://0.0.0.0:8080/healthz.")
    ] = None,
    verbose: Annotated[bool, typer.Option(help="Debug logging.")] = False,
) -> None:
    """The operator: RLJobs become KubeRay RayJobs; their status comes back to the RLJob."""
    from pydantic import ValidationError

    from operators.settings import OperatorSettings

    try:
        settings = OperatorSettings.load(config)  # fail here, with the field, not inside kopf
    except (OSError, ValidationError) as err:
        typer.echo(f"error: operator config: {err}", err=True)
        raise typer.Exit(2) from err
    from operators.main import run

    run(settings, namespace or (), kubeconfig, liveness, verbose)


# the control-plane client's commands (submit, list, get, ...), at the top level and in this place
app.registered_commands.extend(client_app.registered_commands)


@app.command("report")
def report_cmd(
    run_dirs: Annotated[list[Path], typer.Argument(metavar="DIR...", help="Run output directories.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="PNG to write.")] = Path("report.png"),
    window: Annotated[int, typer.Option(help="Moving-average window, steps.")] = 5,
    per_run: Annotated[
        bool,
        typer.Option(
            "--per-run",
            help="One curve per run (default: one per variant, mean over its seeds, when it has several).",
        ),
    ] = False,
) -> None:
    """Plot reward, throughput and mismatch of one or several runs into a PNG, and print a table
    (with the last validation accuracy when a run has validation)."""
    from fp8rl.report import by_recipe, format_validation_table, load_run, report, summary, validation_table

    try:
        runs = [load_run(d) for d in run_dirs]
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    path = report(runs, output, window, by_variant=False if per_run else None)
    rows = summary(runs)
    recipes = by_recipe(rows)
    val = any(r["val_accuracy"] is not None for r in rows)  # the column only when a run validated
    typer.echo(
        f"{'run':<32} {'steps':>6} {'first reward':>13} {'final reward':>13} {'token_mult_prob_error':>22}"
        + (f" {'val accuracy':>13}" if val else "")
    )
    for r in rows:
        acc = "-" if r["val_accuracy"] is None else f"{r['val_accuracy']:.3f}"
        typer.echo(
            f"{r['run']:<32} {r['steps']:>6} {r['first_reward']:>13.3f} {r['final_reward']:>13.3f} "
            f"{r['token_mult_prob_error']:>22.5f}" + (f" {acc:>13}" if val else "")
        )
    if any(r["runs"] > 1 for r in recipes):  # several runs (seeds) of a recipe: mean +- std
        typer.echo(
            f"\n{'recipe':<10} {'runs':>5} {'final reward':>17} {'token_mult_prob_error':>22}"
            + (f" {'val accuracy':>17}" if val else "")
        )
        for r in recipes:
            cells = [
                "-" if r[k] is None else f"{r[k][0]:.{p}f} +- {r[k][1]:.{p}f}"
                for k, p in (("final_reward", 3), ("token_mult_prob_error", 5), ("val_accuracy", 3))
            ]
            typer.echo(
                f"{r['recipe']:<10} {r['runs']:>5} {cells[0]:>17} {cells[1]:>22}"
                + (f" {cells[2]:>17}" if val else "")
            )
        typer.echo("(mean +- sample standard deviation over the runs of each recipe)")
    table = validation_table(rows)
    if any(r["runs"] > 1 for r in table):  # seeds with validation: the table the FP8 papers print
        typer.echo("\n" + format_validation_table(table))
    typer.echo(f"wrote {path}")


@app.command("export")
def export_cmd(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="A run's output directory.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Model directory to write (new, or empty).")],
    step: Annotated[int | None, typer.Option(help="Checkpoint step to export (default: the newest).")] = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format", help="hf-fp8 (block-FP8: vLLM, SGLang, transformers) | hf-bf16 (plain BF16)."
        ),
    ] = "hf-fp8",
) -> None:
    """Write a run's checkpoint as a Hugging Face model directory (safetensors, config.json and
    the tokenizer) that vLLM, SGLang and transformers load. hf-fp8 stores the decoder linears as
    E4M3 with 128x128-block scales; for an fp8-e2e run they are the trainer's own FP8 weights."""
    from workers.models.hf_export import export_run

    try:
        result = export_run(run_dir, step, out, fmt, log=typer.echo)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    typer.echo(f"exported step {result.step} of {run_dir} to {result.out} ({fmt})")
    typer.echo(f"  files: {', '.join(p.name for p in result.files)}")
    typer.echo(
        f"  linear layers: {len(result.fp8_layers)} FP8, {len(result.bf16_layers)} BF16 "
        f"({', '.join(result.bf16_layers[:4])}{', ...' if len(result.bf16_layers) > 4 else ''})"
    )
    typer.echo(f"  weights: {result.bytes} bytes ({result.bytes / 2**20:.2f} MiB)")


if __name__ == "__main__":  # pragma: no cover
    app()


def _text_or_file(value: str) -> str:
    """``@PATH``: the file's text; anything else as it is."""
    return Path(value[1:]).read_text() if value.startswith("@") else value


@app.command("grade")
def grade_cmd(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="Job spec (YAML or JSON).")],
    item: Annotated[str, typer.Option(help="The data row as JSON, or @FILE holding it.")] = "{}",
    sample: Annotated[str, typer.Option(help="The response text, or @FILE holding it.")] = "",
) -> None:
    """Run the job's graders on one data row and one response, as a job would score it; print the
    reward and each grader's score, error and timeout as JSON. Python and code graders run in
    the grader sandbox where bubblewrap runs (the first line says where)."""
    from workers.tasks.one_sample import grade_one
    from workers.tasks.sandbox import Launcher, SandboxUnavailable

    spec = load_spec_or_exit(spec_path)
    try:
        row = json.loads(_text_or_file(item))
        text = _text_or_file(sample)
    except (OSError, json.JSONDecodeError) as err:
        typer.echo(f"error: --item/--sample: {err}", err=True)
        raise typer.Exit(2) from err
    if not isinstance(row, dict):
        typer.echo('error: --item: a JSON object (the data row), e.g. \'{"answer": "7"}\'', err=True)
        raise typer.Exit(2)
    try:
        launcher = Launcher.choose()
        typer.echo(f"graders' code runs in {launcher.how}", err=True)
        result = grade_one(spec.task.grader_list(), row, text, launcher, Path.cwd())
    except (ValueError, SandboxUnavailable) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    typer.echo(json.dumps(result, indent=2))
