"""The job driver: one per job, on the laptop (``fp8rl run``) or in a KubeRay RayJob.

It starts the job's actors (``workers.job.actor_group``, the one object that knows Ray) and runs the
steps (``workers.rl.step``). Every
``validation.interval`` steps (and at the last) the generators then answer the task's held-out
problems, and the step's line gets ``val/accuracy`` and ``val/reward_mean``; the policy RL starts
from is validated too, before step 1, in a line of its own (``step`` 0, the validation keys only).
Metrics go to ``metrics.jsonl`` (one line per step), Prometheus and the progress bar; a line whose
responses are mostly truncated or unreadable is also said in the log, once per run
(``workers.job.job_run.response_warnings``).

Nothing is lost on a stop or crash: checkpoints are atomic (``workers.models.checkpoint``), and
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
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob import metrics as m
from rljob.metrics import AsyncStepMetrics, InitialValidation, MetricsLog, StepMetrics
from rljob.run_dir import DRIVER_MODULE, RunDir
from rljob.spec import JobSpec
from rljob.status import EXIT_OUT_OF_MEMORY, EXIT_TOO_MANY_FAULTS
from workers.engines.factory import check_engines
from workers.job.job_run import JobRun, write_json
from workers.job.job_run import RunOptions as RunOptions  # the driver's options, imported from here
from workers.job.numerics import numerics_record
from workers.job.prom_exporter import PromExporter
from workers.job.ray_cluster import ray_init, ray_shutdown
from workers.job.supervisor import ATTEMPT_ENV, PREVIOUS_EXIT_ENV
from workers.models import checkpoint
from workers.models.tokenizer import Tokenizer, build_tokenizer
from workers.rl.faults import ActorFault, RestartLimitError
from workers.tasks import Task


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


def check_local_models(spec: JobSpec) -> None:
    """A ``model.name`` / ``tokenizer.name`` written as a local path (absolute, ``./``, ``../``)
    that is not a directory fails here with the field, before Ray starts (transformers would take
    it for a Hub id and say so in a traceback)."""
    for field, name in (("model.name", spec.model.name), ("tokenizer.name", spec.tokenizer.name)):
        if name and name.startswith(("/", "./", "../")) and not Path(name).is_dir():
            raise ValueError(
                f"{field}: {name} is not a directory. A pretrained model is a Hugging Face directory: "
                "`fp8rl model fetch smollm2-135m-instruct` (or `fp8rl model import FILE.gguf`) prints one "
                f"to use here (docs/models.md)"
            )


def run(spec: JobSpec, output_dir: str | Path | None = None, opts: RunOptions | None = None) -> RunResult:
    """Run ``spec`` to its last step (or until ``opts.stop`` is set); see the module docstring."""
    opts = opts or RunOptions()
    out = Path(output_dir or spec.output_dir)
    check_engines(spec)  # an engine that is not installed fails here, before Ray does any work
    check_local_models(spec)
    # a bad task, held-out split (validation.size) or tokenizer fails here, before Ray starts
    tok = build_tokenizer(spec)
    task = Task.for_job(spec, tok)
    try:
        return _run_task(spec, out, opts, tok, task)
    finally:
        task.close()  # the graders' sandbox pool


def _run_task(spec: JobSpec, out: Path, opts: RunOptions, tok: Tokenizer, task: Task) -> RunResult:
    # before Ray starts: python graders compiled in a sandboxed process here, schemas checked (the
    # job then grades on its Ray actors, workers.job.grader_actors)
    task.graders.pool_size = 1
    not_ready = task.graders.check()
    if not_ready:
        raise ValueError(f"task.graders: {'; '.join(not_ready)}")
    for drill in opts.drills:
        actors = spec.resources.generators if drill.role == "generator" else spec.resources.trainers
        if drill.step > spec.steps or drill.index >= actors:
            raise ValueError(
                f"--inject-fault {drill.role}{drill.index}:{drill.kind}@{drill.step}: the job has steps "
                f"1-{spec.steps} and {actors} {drill.role}(s), numbered from 0"
            )
    first_step, ckpt = _prepare_output(spec, out, opts.resume)
    run_dir = RunDir(out)
    write_json(run_dir.spec_resolved, spec.model_dump(mode="json"))
    write_json(run_dir.numerics, numerics_record())
    log = MetricsLog(run_dir.metrics)
    rows: list[Mapping[str, Any]] = list(log.truncate(first_step - 1)) if opts.resume else []
    prom = PromExporter(opts.job or out.name, opts.namespace, spec.precision.recipe)
    prom.attempt(int(os.environ.get(ATTEMPT_ENV) or 1), os.environ.get(PREVIOUS_EXIT_ENV, ""))
    port = prom.serve(opts.metrics_port) if opts.metrics_port is not None else None
    if port is not None:
        opts.log(f"Prometheus metrics on http://0.0.0.0:{port}/metrics")
    if first_step > spec.steps:
        opts.log(f"{out} already completed step {spec.steps}; raise --steps to continue")
        prom.stop()
        return RunResult(out, first_step - 1, False, rows, port)
    started_ray = ray_init(spec, opts.ray_address)
    job = JobRun(spec, task, tok, out, log, rows, prom, opts)
    try:
        if task.graders.sandboxed:
            opts.log(f"graders' code runs in {task.graders.pool().where()}")
        step = job.begin(first_step, ckpt)
        row: AsyncStepMetrics | None = None  # the step's line once it is trained (and synced)
        while step <= spec.steps:
            try:
                if row is None:
                    outcome = job.train(step)
                    if outcome.fault is not None:  # the step as far as it got: recovery goes on from it
                        step, row = job.recover(outcome.fault, step, outcome.row)
                        continue
                    row = outcome.row
                assert row is not None
                job.finish(step, row)
                row = None
                if opts.stop.is_set():
                    break
                step += 1
            except ActorFault as fault:
                step, row = job.recover(fault, step, row)
        if step > spec.steps:
            prom.complete()
        return RunResult(out, min(step, spec.steps), opts.stop.is_set(), job.rows, port)
    finally:
        job.shutdown()
        task.close()  # the graders' actors, before their Ray stops
        if started_ray:
            ray_shutdown()
        if port is not None and opts.metrics_linger_s > 0 and not opts.stop.is_set():
            # the operator reads fp8rl_run_complete (and a failed run's last step) from here; not
            # after a stop (suspend, eviction), which must end within the pod's grace period
            time.sleep(opts.metrics_linger_s)
        prom.stop()


def parser() -> argparse.ArgumentParser:
    """The driver's command line, as ``rljob.run_dir.driver_argv`` writes it."""
    p = argparse.ArgumentParser(prog=f"python -m {DRIVER_MODULE}", description=main.__doc__)
    p.add_argument("spec", help="job spec file (YAML/JSON, or an RLJob manifest)")
    p.add_argument("--output", help="override output_dir")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    p.add_argument(
        "--metrics-linger",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep serving /metrics this long after the run ends (0-3600; the operator's last read)",
    )
    p.add_argument("--job", default="", help="job label of the metrics")
    p.add_argument("--namespace", default="default", help="namespace label of the metrics")
    p.add_argument(
        "--in-place-retries",
        type=int,
        default=0,
        metavar="N",
        help="start a failed driver again on the same Ray cluster up to N times (0-10) where that is safe "
        "(workers.job.supervisor)",
    )
    return p


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag N`` or ``--flag=N``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(f"{flag}="):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    """The driver's entrypoint (``rljob.run_dir.driver_argv``): a RayJob's, and each local job's
    of the service (no progress bar, a line per step)."""
    from rljob.spec import SpecError, load_spec

    args = parser().parse_args(argv)
    if not 0 <= args.metrics_linger <= 3600:
        print(f"error: --metrics-linger {args.metrics_linger}: give 0 to 3600 seconds", flush=True)
        return 2
    if not 0 <= args.in_place_retries <= 10:
        print(f"error: --in-place-retries {args.in_place_retries}: give 0 to 10", flush=True)
        return 2
    if args.in_place_retries:
        from workers.job.supervisor import supervise

        driver_args = _without(list(sys.argv[1:] if argv is None else argv), "--in-place-retries")
        return supervise(driver_args, args.in_place_retries, log=lambda line: print(line, flush=True))
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
        metrics_linger_s=args.metrics_linger,
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
    except RestartLimitError as err:  # a crash loop: say so in one line, and do not start again
        print(f"error: {err}", flush=True)
        return EXIT_TOO_MANY_FAULTS
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
