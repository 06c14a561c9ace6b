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
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from rljob import metrics as m
from rljob.metrics import (
    RESTART_ROLES,
    AsyncStepMetrics,
    InitialValidation,
    MetricsLog,
    StepMetrics,
    ValidatedStepMetrics,
)
from rljob.run_dir import DRIVER_MODULE, RunDir
from rljob.spec import JobSpec
from rljob.status import EXIT_OUT_OF_MEMORY, EXIT_TOO_MANY_FAULTS
from workers import checkpoint
from workers.async_rl import AsyncLoop
from workers.engines.factory import check_engines
from workers.faults import ActorFault, CallTimeouts, FaultDrill, RestartLimitError
from workers.job_actors import JobActors, ray_init, ray_shutdown
from workers.metrics import PromExporter
from workers.rl_step import METRICS_ROW, rl_step, save, sync_weights, validate, validation_due, warmup
from workers.tasks import Task
from workers.tokenizer import Tokenizer, build_tokenizer


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
    drills: list[FaultDrill] = field(default_factory=list)  # provoked faults (fp8rl run --inject-fault)


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
    for drill in opts.drills:
        actors = spec.resources.generators if drill.role == "generator" else spec.resources.trainers
        if drill.step > spec.steps or drill.index >= actors:
            raise ValueError(
                f"--inject-fault {drill.role}{drill.index}:{drill.kind}@{drill.step}: the job has steps "
                f"1-{spec.steps} and {actors} {drill.role}(s), numbered from 0"
            )
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
    job = _Job(spec, task, tok, out, log, rows, prom, opts)
    try:
        step = job.begin(first_step, ckpt)
        row: AsyncStepMetrics | None = None  # the step's line once it is trained (and synced)
        while step <= spec.steps:
            try:
                if row is None:
                    row = job.train(step)
                job.finish(step, row)
                row = None
                if opts.stop.is_set():
                    break
                step += 1
            except ActorFault as fault:
                step, row = job.recover(fault, step, row)
        return RunResult(out, min(step, spec.steps), opts.stop.is_set(), job.rows, port)
    finally:
        job.shutdown()
        if started_ray:
            ray_shutdown()
        prom.stop()


class _Job:
    """One driver's run of a job: its actors, its log, and the recovery from data-plane faults
    (:mod:`workers.faults`). A generator fault restarts the actors with the trainers' current
    state (a snapshot, not a checkpoint) and generates the step again; a trainer fault restarts
    them from the last checkpoint and computes the steps after it again, their lines replaced.
    Every recovery is one line of the log and of ``faults.jsonl``, and counts in the next line's
    ``faults/*`` keys; ``resources.max_<role>_restarts`` bounds them over the job."""

    def __init__(
        self,
        spec: JobSpec,
        task: Task,
        tok: Tokenizer,
        out: Path,
        log: MetricsLog,
        rows: list[Mapping[str, Any]],
        prom: PromExporter,
        opts: RunOptions,
    ) -> None:
        self.spec, self.task, self.tok, self.out, self.log = spec, task, tok, out, log
        self.rows, self.prom, self.opts = rows, prom, opts
        self.actors: JobActors | None = None
        self.loop: AsyncLoop | None = None
        self.drills = list(opts.drills)
        # this job's restarts so far (the rows of earlier drivers count: the bound is per job)
        self.restarts = {role: sum(int(r.get(key, 0)) for r in rows) for role, key in RESTART_ROLES.items()}
        self.counts = dict.fromkeys(m.FAULT_KEYS, 0.0)  # recovered since the last line: the next line's
        res = spec.resources  # the bounds of the actors' calls, their history kept across restarts
        self.timeouts = CallTimeouts(res.hang_timeout_s, res.startup_timeout_s)

    # -- the steps ---------------------------------------------------------------------------------
    def begin(self, first_step: int, ckpt: Path | None) -> int:
        """Start the actors and bring them to ``first_step``: the checkpoint, or the warm-up; then
        the first weight sync and the step-0 validation. A fault on the way starts it all again
        (from the newest checkpoint: the warm-up writes one)."""
        t0, handled = time.monotonic(), list[ActorFault]()
        while True:
            try:
                self._start_actors(audit=not handled)
                first = self._from(first_step, ckpt)
                for fault in handled:
                    self._record(fault, 0, "every actor started again", t0, 0)
                return first
            except ActorFault as fault:
                self._count(fault)
                handled.append(fault)
                last = checkpoint.latest(self.out)
                first_step, ckpt = (last[0] + 1, last[1]) if last else (1, None)

    def train(self, step: int) -> AsyncStepMetrics:
        """Generate, train and sync step ``step`` (asynchronous: train it while the next generate)."""
        assert self.actors is not None
        for drill in [d for d in self.drills if d.step == step]:
            self.drills.remove(drill)  # once per driver: fresh actors are not armed again
            self.actors.arm(drill.role, drill.index, drill.kind)
            self.opts.log(f"fault drill: {drill.role} {drill.index} will {drill.kind} in step {step}")
        if self.loop is not None:
            return self.loop.step(step)
        return cast(AsyncStepMetrics, rl_step(self.spec, self.task, self.tok, self.actors, step))

    def finish(self, step: int, row: AsyncStepMetrics) -> None:
        """Validate (when due), checkpoint (when due, before the line: a line never refers to
        weights that were not saved) and write the step's line, with the faults recovered in it."""
        assert self.actors is not None
        if validation_due(self.spec, step):  # after the step's weight sync: the updated policy
            val = validate(self.spec, self.task, self.tok, self.actors, step)
            row = cast(ValidatedStepMetrics, {**row, **val})
        line = cast(AsyncStepMetrics, {**row, **self.counts})
        due = step % self.spec.checkpoint_interval == 0 or step == self.spec.steps
        if due:
            save(self.actors, self.out, step, line)
        self.log.append(line)
        self.rows.append(line)
        self.counts = dict.fromkeys(m.FAULT_KEYS, 0.0)
        self.prom.observe(line)
        if self.opts.on_step is not None:
            self.opts.on_step(line)
        if self.opts.stop.is_set():  # (the progress display may have set it)
            if not due:
                save(self.actors, self.out, step, line)
            self.opts.log(f"stopped after step {step}; continue with --resume")

    def shutdown(self) -> None:
        if self.actors is not None:
            self.actors.shutdown()
            self.actors = None

    # -- recovery ----------------------------------------------------------------------------------
    def recover(
        self, fault: ActorFault, step: int, row: AsyncStepMetrics | None
    ) -> tuple[int, AsyncStepMetrics | None]:
        """Recover from ``fault`` in step ``step`` (``row``: the step's line if it was trained
        before the fault); returns the step to go on with and its line if it is trained. A fault
        while recovering counts too, and is recovered from in turn."""
        t0, handled = time.monotonic(), list[ActorFault]()
        trained = cast(AsyncStepMetrics | None, fault.trained or row)
        snapshot: Path | None = None  # the trainers' state, once saved
        while True:
            try:
                self._count(fault)
                handled.append(fault)
                if snapshot is None and fault.role == "generator":
                    try:
                        snapshot = self._snapshot(fault)
                    except ActorFault as stuck:  # the trainers cannot hand over their state
                        self.opts.log(f"fault: the trainers' state could not be saved: {stuck}")
                        fault = stuck
                        continue
                if snapshot is None:  # a trainer lost: its state is the checkpoint's
                    first, action = self._back_to_checkpoint()
                    for lost in handled:
                        self._record(lost, step, action, t0, step - first if lost is handled[-1] else 0)
                    return first, None
                self._start_actors()
                assert self.actors is not None
                self.actors.load(snapshot)
                sync = sync_weights(self.actors)
                shutil.rmtree(snapshot, ignore_errors=True)
                if trained is None:
                    self._restart_loop(step)
                    action = f"replaced; step {step} generated again"
                else:
                    self._restart_loop(step + 1)  # the step was trained: its weights were just sent
                    action = f"replaced after step {step} was trained; its weights sent again"
                for lost in handled:
                    self._record(lost, step, action, t0, 0)
                if trained is None:
                    return step, None
                took = time.monotonic() - t0
                parts = (m.TIMING_GENERATION_S, m.TIMING_REWARD_S, m.TIMING_TRAIN_S)
                done: Mapping[str, Any] = trained
                spent = sum(float(done.get(k, 0.0)) for k in parts)
                timing = {m.TIMING_WEIGHT_SYNC_S: took, m.TIMING_STEP_S: spent + took}
                return step, cast(AsyncStepMetrics, {**timing, **trained, **sync})
            except ActorFault as again:
                self.opts.log(f"fault: while recovering from step {step}'s: {again}")
                fault = again

    def _back_to_checkpoint(self) -> tuple[int, str]:
        """Fresh actors from the newest checkpoint (or from the start); the lines after it go,
        their fault counts carried into the next line. Returns the step to go on with and what
        was done."""
        self._start_actors()
        last = checkpoint.latest(self.out)
        resume = last[0] if last else 0
        dropped = [r for r in self.rows if int(r[m.STEP]) > resume]
        for r in dropped:
            for key in m.FAULT_KEYS:
                self.counts[key] += float(r.get(key, 0.0))
        self.counts[m.FAULTS_STEPS_RECOMPUTED] += len(dropped)
        self.rows[:] = self.log.truncate(resume)
        first = self._from(resume + 1, last[1] if last else None)
        where = f"the checkpoint of step {resume}" if last else "the start"
        return first, f"every actor replaced; back to {where}, {len(dropped)} step(s) computed again"

    def _count(self, fault: ActorFault) -> None:
        """One more restart of ``fault.role``; over ``resources.max_<role>_restarts``, the job fails."""
        self.restarts[fault.role] += 1
        self.counts[RESTART_ROLES[fault.role]] += 1
        limit = getattr(self.spec.resources, f"max_{fault.role}_restarts")
        if self.restarts[fault.role] > limit:
            raise RestartLimitError(
                f"{fault}: {self.restarts[fault.role]} {fault.role} faults in this job, more than "
                f"resources.max_{fault.role}_restarts ({limit}); the job stops here (a crash loop is "
                "not recovered from). Read the actor's log, fix the cause, then continue with --resume"
            ) from fault

    def _snapshot(self, fault: ActorFault) -> Path:
        """Kill the lost actor (its partners in a collective fail instead of waiting for it), then
        save the trainers' current state (weights, optimizer; not a checkpoint) to a directory of
        the run, within ``resources.hang_timeout_s``."""
        assert self.actors is not None
        self.actors.kill(fault.role, fault.index)
        directory = RunDir(self.out).root / RECOVERY_DIR
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        self.actors.save(directory, hang_bound=True)
        return directory

    def _record(self, fault: ActorFault, step: int, action: str, t0: float, recomputed: int) -> None:
        seconds = time.monotonic() - t0
        where = f"step {step}" if step else "the job's start"
        self.opts.log(
            f"fault: {fault.role} {fault.index} {fault.what} during {fault.call} in {where}; "
            f"{action} ({seconds:.1f} s)"
        )
        entry = {
            "time": time.time(), "step": step, "role": fault.role, "index": fault.index, "what": fault.what,
            "call": fault.call, "action": action, "seconds": seconds, "steps_recomputed": recomputed,
        }  # fmt: skip
        with RunDir(self.out).faults.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    # -- actors ------------------------------------------------------------------------------------
    def _start_actors(self, audit: bool = False) -> None:
        """Kill the actors (if any) and start fresh ones; the first time, write their audits."""
        self.shutdown()
        longest = max(len(self.tok.encode(self.task.prompt(p))) for p in self.task.problems())
        self.actors = JobActors(self.spec, self.tok.vocab_size, self.tok, longest, self.timeouts)
        if audit:
            audits = {"trainer": self.actors.trainer_audit, "generator": self.actors.generator_audit}
            _write_json(RunDir(self.out).quantization_audit, audits)
            for role, table in audits.items():
                self.opts.log(f"quantization audit ({role}):\n{table['table']}")

    def _from(self, first_step: int, ckpt: Path | None) -> int:
        """Fresh actors to ``first_step``: load ``ckpt`` (or warm up), sync, validate step 0."""
        assert self.actors is not None
        spec, rows = self.spec, self.rows
        if ckpt is not None:
            self.actors.load(ckpt)
            self.opts.log(f"resumed from {ckpt} at step {first_step}")
            restored = _restore_line(self.log, rows, ckpt)
            if restored is not None:
                rows.append(restored)
                self.opts.log(f"restored the metrics line of step {first_step - 1} from its checkpoint")
        elif spec.warmup.sft_steps:
            warmup(spec, self.task, self.tok, self.actors, self.out, self.opts.log)
        sync_weights(self.actors)  # generators start from the trainer's weights
        if spec.validation.interval and not any(r[m.STEP] == 0 for r in rows):
            # the policy RL starts from (after the warm-up): a row of its own, step 0
            row0 = cast(InitialValidation, {m.STEP: 0, **validate(spec, self.task, self.tok, self.actors, 0)})
            self.log.append(row0)
            rows.append(row0)
            self.prom.observe(row0)
            if self.opts.on_step is not None:
                self.opts.on_step(row0)
        self._restart_loop(first_step)
        return first_step

    def _restart_loop(self, first_step: int) -> None:
        """rollout.max_staleness >= 1: generation overlaps training (workers.async_rl); a new loop
        after a fault, whose batches in flight are lost and generated again, never trained twice."""
        assert self.actors is not None
        spec = self.spec
        self.loop = (
            AsyncLoop(spec, self.task, self.tok, self.actors, first_step)
            if spec.rollout.max_staleness
            else None
        )


RECOVERY_DIR = ".recovery"  # the trainers' state while a generator fault's fresh actors start


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
