"""``fp8rl run``: load and override the spec, show progress, stop cleanly on Ctrl-C."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from rljob import metrics as m
from rljob.spec import JobSpec, SpecError, load_spec, parse_spec
from rljob.status import EXIT_TOO_MANY_FAULTS


def apply_overrides(spec: JobSpec, overrides: dict[str, Any]) -> JobSpec:
    """The spec with command-line overrides applied (validated like the file itself)."""
    data = spec.model_dump(mode="json")
    if overrides.get("recipe") is not None:
        data["precision"]["recipe"] = overrides["recipe"]
    if overrides.get("steps") is not None:
        data["steps"] = overrides["steps"]
    if overrides.get("output") is not None:
        data["output_dir"] = str(overrides["output"])
    if overrides.get("seed") is not None:
        data["rollout"]["seed"] = overrides["seed"]
    if overrides.get("is_mode") is not None:
        data["algorithm"]["importance_sampling"]["mode"] = overrides["is_mode"]
    for item in overrides.get("set") or []:
        set_field(data, item)
    return parse_spec(data, "(after command-line overrides)")


def set_field(data: dict[str, Any], item: str) -> None:
    """Apply one ``--set KEY=VALUE`` to a spec's JSON form: ``KEY`` a dotted path to a field that
    exists (``precision.fp8_kv_cache``), ``VALUE`` read as YAML (``true``, ``3``, ``[0, 1]``,
    ``e4m3``). The spec's own validation judges the value afterwards."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise SpecError(
            "(command line)", [f"--set {item!r}: expected KEY=VALUE, e.g. precision.fp8_kv_cache=true"]
        )
    node: Any = data
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            where = ".".join(parts[:depth]) or "the spec"
            fields = ", ".join(sorted(node)) if isinstance(node, dict) else "none: it is a value"
            raise SpecError(
                "(command line)", [f"--set {key}: {where} has no field {part!r} (fields: {fields})"]
            )
        if depth == len(parts) - 1:
            node[part] = yaml.safe_load(text) if text.strip() else text
        else:
            node = node[part]


def _format_row(row: Mapping[str, Any]) -> str:
    if m.REWARD_MEAN not in row:  # the step-0 validation, before RL
        return f"step {row['step']}: val accuracy {row[m.VAL_ACCURACY]:.3f} (before RL)"
    return (
        f"step {row['step']}: reward {row['reward/mean']:.3f}  "
        f"mismatch {row['mismatch/token_mult_prob_error']:.4f}  "
        f"gen {row['throughput/generation_tokens_per_s']:.0f} tok/s  "
        f"train {row['throughput/train_tokens_per_s']:.0f} tok/s  "
        f"step {row['timing/step_s']:.2f}s"
        + (f"  val accuracy {row['val/accuracy']:.3f}" if m.VAL_ACCURACY in row else "")
    )


def raised_in_an_actor(err: BaseException) -> bool:
    """Whether ``err`` was raised inside a Ray actor or task and re-raised here (Ray's error type
    then also derives from the cause's, a ValueError stays a ValueError, and its text carries the
    actor's traceback)."""
    from ray.exceptions import RayError

    return isinstance(err, RayError)


def run_from_cli(
    spec_path: Path,
    overrides: dict[str, Any],
    resume: bool,
    metrics_port: int | None,
    progress: bool,
    inject_fault: list[str] | None = None,
) -> int:
    """Returns the exit code: 0 done, 1 the run failed on its way (a non-finite FP8 value, a
    grader that failed on too many responses, any error raised in an actor: not the spec's
    fault), 2 bad spec/output or an engine that cannot run here (raised before the run, in this
    process), 4 more actor faults than the job recovers from
    (``rljob.status.EXIT_TOO_MANY_FAULTS``), 130 stopped by Ctrl-C."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from workers.engines.factory import EngineUnavailable
    from workers.fp8.guard import NonFiniteError
    from workers.job import driver
    from workers.rl.faults import FaultDrill, RestartLimitError
    from workers.tasks.grading import GraderFailure

    console = Console(stderr=True, soft_wrap=True, highlight=False)

    def error(err: BaseException) -> None:  # its text as it is: gloo's name files in [brackets]
        console.print(f"[red]error:[/red] {escape(str(err))}", highlight=False)

    try:
        spec = apply_overrides(load_spec(spec_path), overrides)
        drills = [FaultDrill.parse(text) for text in inject_fault or []]
    except (SpecError, ValueError) as err:
        error(err)
        return 2
    stop = threading.Event()

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        console.print("stopping after this step (checkpoint saved); Ctrl-C again to abort")

    previous = signal.signal(signal.SIGINT, on_sigint)
    live = progress and console.is_terminal
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        console=console,
        disable=not live,
    )
    task_id = bar.add_task(spec.precision.recipe, total=spec.steps, info="starting Ray")

    def on_step(row: Mapping[str, Any]) -> None:
        bar.update(task_id, completed=row["step"], info=_format_row(row))
        if not live:
            console.print(_format_row(row), highlight=False)

    opts = driver.RunOptions(
        resume=resume,
        metrics_port=metrics_port,
        stop=stop,
        on_step=on_step,
        log=lambda text: console.print(text, markup=False),
        drills=drills,
    )
    try:
        with bar:
            result = driver.run(spec, spec.output_dir, opts)
    except (NonFiniteError, GraderFailure) as err:  # raised in the run (an actor's, through Ray)
        console.print(f"[red]the run failed:[/red] {escape(str(err))}", highlight=False)
        return 1
    except (FileExistsError, ValueError, EngineUnavailable) as err:
        if not isinstance(err, EngineUnavailable) and raised_in_an_actor(err):
            # an actor's error in training, its traceback in its text: not the spec's fault
            console.print(f"[red]the run failed in an actor:[/red] {escape(str(err))}", highlight=False)
            return 1
        error(err)
        return 2
    except RestartLimitError as err:
        error(err)
        return EXIT_TOO_MANY_FAULTS
    finally:
        signal.signal(signal.SIGINT, previous)
    console.print(f"run directory: {result.output_dir} (last step {result.last_step})")
    faults = {k: int(sum(float(r.get(k, 0.0)) for r in result.rows)) for k in m.FAULT_KEYS}
    if any(faults.values()):
        console.print(
            f"faults recovered in place: {faults[m.FAULTS_GENERATOR_RESTARTS]} generator and "
            f"{faults[m.FAULTS_TRAINER_RESTARTS]} trainer restart(s), {faults[m.FAULTS_STEPS_RECOMPUTED]} "
            "step(s) computed again (faults.jsonl in the run directory)"
        )
    if result.stopped:
        print(f"resume with: fp8rl run {spec_path} --resume --output {result.output_dir}", file=sys.stderr)
        return 130
    return 0
