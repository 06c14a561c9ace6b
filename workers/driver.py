"""The job driver: one per job, on the laptop (``fp8rl run``) or in a KubeRay RayJob.

It starts the job's actors (``workers.job_actors``, the one object that knows Ray) and runs the
steps (``workers.rl_step``). Every
``validation.interval`` steps (and at the last) the generators then answer the task's held-out
problems, and the step's line gets ``val/accuracy`` and ``val/reward_mean``; the policy RL starts
from is validated too, before step 1, in a line of its own (``step`` 0, the validation keys only).
Metrics go to ``metrics.jsonl`` (one line per step), Prometheus and the progress bar.

Nothing is lost on a stop or crash: checkpoints are atomic (``workers.checkpoint``), and
``resume=True`` restarts from the newest one, dropping metric lines of steps after it, so every
step appears exactly once. Prompts and sampling seeds are functions of (seed, step), so the
resumed steps see the same prompts. ``main`` is the entrypoint of a RayJob and of the service's
local drivers; ``rljob.run_dir.driver_argv`` builds their command line, and ``RunDir`` names the
files written here.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from rljob import metrics as m
from rljob.metrics import AsyncStepMetrics, InitialValidation, MetricsLog, StepMetrics, ValidatedStepMetrics
from rljob.run_dir import DRIVER_MODULE, RunDir
from rljob.spec import JobSpec
from rljob.status import EXIT_OUT_OF_MEMORY
from workers import checkpoint
from workers.async_rl import AsyncLoop
from workers.engines.factory import check_engines
from workers.job_actors import JobActors, ray_init, ray_shutdown
from workers.metrics import PromExporter
from workers.rl_step import METRICS_ROW, rl_step, save, sync_weights, validate, validation_due, warmup
from workers.tasks import Task
from workers.tokenizer import build_tokenizer


@dataclass
class RunOptions:
    """How to run a job (what is not part of the job itself)."""

    resume: bool = False
    metrics_port: int | None = None  # None: no HTTP server; 0: any free port
    job: str = ""
    namespace: str = "default"
    stop: threading.Event = field(default_factory=threading.Event)
    on_step: Callable[[StepMetrics | InitialValidation], None] | None = None  # progress display
    log: Callable[[str], None] = print
    ray_address: str | None = None


@dataclass
class RunResult:
    output_dir: Path
    last_step: int
    stopped: bool
    rows: list[Mapping[str, Any]]  # the log's lines: resumed ones as read, then this run's
    metrics_port: int | None


def _prepare_output(spec: JobSpec, out: Path, resume: bool) -> tuple[int, Path | None]:
    """Check the output dir; return (first step, checkpoint to load)."""
    out.mkdir(parents=True, exist_ok=True)
    last = checkpoint.latest(out)
    if not resume:
        if last is not None or RunDir(out).metrics.exists():
            raise FileExistsError(
                f"{out} already holds a run; pass --resume to continue it, or choose another --output"
            )
        return 1, None
    if last is None:
        return 1, None
    return last[0] + 1, last[1]


def _restore_line(log: MetricsLog, rows: list[Mapping[str, Any]], ckpt: Path) -> dict[str, Any] | None:
    """The checkpointed step's metrics line, appended to ``log`` if a kill fell between the
    checkpoint and the line (the checkpoint carries it, ``rl_step.save``); None when it is there."""
    state = json.loads((ckpt / "state.json").read_text())
    row = state.get(METRICS_ROW)
    if row is None or any(r[m.STEP] == state["step"] for r in rows):
        return None
    log.append(row)
    return dict(row)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def run(spec: JobSpec, output_dir: str | Path | None = None, opts: RunOptions | None = None) -> RunResult:
    """Run ``spec`` to its last step (or until ``opts.stop`` is set); see the module docstring."""
    opts = opts or RunOptions()
    out = Path(output_dir or spec.output_dir)
    check_engines(spec)  # an engine that is not installed fails here, before Ray does any work
    # a bad task, held-out split (validation.size) or tokenizer fails here, before Ray starts
    task, tok = Task.for_job(spec), build_tokenizer(spec)
    first_step, ckpt = _prepare_output(spec, out, opts.resume)
    run_dir = RunDir(out)
    _write_json(run_dir.spec_resolved, spec.model_dump(mode="json"))
    log = MetricsLog(run_dir.metrics)
    rows: list[Mapping[str, Any]] = list(log.truncate(first_step - 1)) if opts.resume else []
    prom = PromExporter(opts.job or out.name, opts.namespace, spec.precision.recipe)
    port = prom.serve(opts.metrics_port) if opts.metrics_port is not None else None
    if port is not None:
        opts.log(f"Prometheus metrics on http://0.0.0.0:{port}/metrics")
    if first_step > spec.steps:
        opts.log(f"{out} already completed step {spec.steps}; raise --steps to continue")
        prom.stop()
        return RunResult(out, first_step - 1, False, rows, port)
    started_ray = ray_init(spec, opts.ray_address)
    actors: JobActors | None = None
    step = first_step - 1
    try:
        longest = max(len(tok.encode(task.prompt(p))) for p in task.problems())
        actors = JobActors(spec, tok.vocab_size, tok, longest)
        audits = {"trainer": actors.trainer_audit, "generator": actors.generator_audit}
        _write_json(run_dir.quantization_audit, audits)
        for role, audit in audits.items():
            opts.log(f"quantization audit ({role}):\n{audit['table']}")
        if ckpt is not None:
            actors.load(ckpt)
            opts.log(f"resumed from {ckpt} at step {first_step}")
            restored = _restore_line(log, rows, ckpt)
            if restored is not None:
                rows.append(restored)
                opts.log(f"restored the metrics line of step {first_step - 1} from its checkpoint")
        elif spec.warmup.sft_steps:
            warmup(spec, task, tok, actors, out, opts.log)
        sync_weights(actors)  # generators start from the trainer's weights
        if spec.validation.interval and not any(r[m.STEP] == 0 for r in rows):
            # the policy RL starts from (after the warm-up): a row of its own, step 0
            row0 = cast(InitialValidation, {m.STEP: 0, **validate(spec, task, tok, actors, 0)})
            log.append(row0)
            rows.append(row0)
            prom.observe(row0)
            if opts.on_step is not None:
                opts.on_step(row0)
        # rollout.max_staleness >= 1: generation overlaps training (workers.async_rl); the batches
        # in flight when the loop ends (a stop) are dropped, and regenerated by a resume
        loop = AsyncLoop(spec, task, tok, actors, first_step) if spec.rollout.max_staleness else None
        for step in range(first_step, spec.steps + 1):
            row: AsyncStepMetrics = (
                loop.step(step) if loop else cast(AsyncStepMetrics, rl_step(spec, task, tok, actors, step))
            )
            if validation_due(spec, step):  # after the step's weight sync: the updated policy
                row = cast(ValidatedStepMetrics, {**row, **validate(spec, task, tok, actors, step)})
            due = step % spec.checkpoint_interval == 0 or step == spec.steps
            if due:  # before the metrics line: a line never refers to weights that were not saved
                save(actors, out, step, row)
            log.append(row)
            rows.append(row)
            prom.observe(row)
            if opts.on_step is not None:
                opts.on_step(row)
            if opts.stop.is_set():
                if not due:
                    save(actors, out, step, row)
                opts.log(f"stopped after step {step}; continue with --resume")
                break
        return RunResult(out, step, opts.stop.is_set(), rows, port)
    finally:
        if actors is not None:
            actors.shutdown()
        if started_ray:
            ray_shutdown()
        prom.stop()


def parser() -> argparse.ArgumentParser:
    """The driver's command line, as ``rljob.run_dir.driver_argv`` writes it."""
    p = argparse.ArgumentParser(prog=f"python -m {DRIVER_MODULE}", description=main.__doc__)
    p.add_argument("spec", help="job spec file (YAML/JSON, or an RLJob manifest)")
    p.add_argument("--output", help="override output_dir")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    p.add_argument("--job", default="", help="job label of the metrics")
    p.add_argument("--namespace", default="default", help="namespace label of the metrics")
    return p


def main(argv: list[str] | None = None) -> int:
    """The driver's entrypoint (``rljob.run_dir.driver_argv``): a RayJob's, and each local job's
    of the service (no progress bar, a line per step)."""
    from rljob.spec import SpecError, load_spec

    args = parser().parse_args(argv)
    try:
        spec = load_spec(args.spec)
    except SpecError as err:
        print(f"error: {err}", flush=True)
        return 2

    def line(row: StepMetrics | InitialValidation) -> None:
        keys = (m.STEP, m.REWARD_MEAN, m.TOKEN_MULT_PROB_ERROR, m.VAL_ACCURACY)
        values: Mapping[str, Any] = row
        print(json.dumps({k: values[k] for k in keys if k in values}), flush=True)

    opts = RunOptions(
        resume=args.resume,
        metrics_port=args.metrics_port,
        job=args.job,
        namespace=args.namespace,
        on_step=line,
    )
    # SIGINT/SIGTERM (suspend, pod eviction): finish the step, checkpoint, exit 130
    import signal

    previous = {
        sig: signal.signal(sig, lambda signum, frame: opts.stop.set())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        result = run(spec, args.output, opts)
    except MemoryError:
        # over the process's memory limit (the service sets RLIMIT_AS per tenant): say so, and exit
        # with the code the service reads as OutOfMemory
        print("error: out of memory: the driver went over its memory limit", flush=True)
        return EXIT_OUT_OF_MEMORY
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 130 if result.stopped else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
