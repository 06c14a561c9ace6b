"""One driver's run of a job, step by step, and its recovery from data-plane faults in place.

:class:`JobRun` holds the job's actors (:class:`~workers.job.actor_group.JobActors`), its metrics log
and Prometheus exporter. The driver (``run`` in the driver's module) prepares the output
directory and Ray, then calls :meth:`JobRun.begin` (actors up, checkpoint or warm-up, the first
sync, the step-0 validation), and for each step :meth:`JobRun.train` (generate, train, sync) and
:meth:`JobRun.finish` (validation, checkpoint, the metrics line). An
:class:`~workers.rl.faults.ActorFault` on the way goes to :meth:`JobRun.recover`: a lost generator
costs fresh actors that take the trainers' current state and the step's generation; a lost
trainer costs fresh actors from the last checkpoint and the steps after it, computed again and
logged once (docs/faults.md).
"""

from __future__ import annotations

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
    PRECISION_ACTIONS,
    AsyncStepMetrics,
    InitialValidation,
    MetricsLog,
    StepMetrics,
    ValidatedStepMetrics,
)
from rljob.precision_actions import effective
from rljob.prometheus import RESTART_ROLES
from rljob.run_dir import RunDir
from rljob.spec import JobSpec
from workers.fp8.kv_cache import calibrates_kv
from workers.job.actor_group import JobActors
from workers.job.grader_actors import RayGraderPool, grader_actors, model_scorer
from workers.job.mismatch_watch import MismatchWatch
from workers.job.prom_exporter import PromExporter
from workers.job.response_watch import response_warnings
from workers.models import checkpoint
from workers.models.tokenizer import Tokenizer
from workers.rl.faults import ActorFault, CallTimeouts, FaultDrill, RestartLimitError
from workers.rl.loop import RlLoop, StepOutcome
from workers.rl.protocol import StepContext
from workers.rl.step import METRICS_ROW, calibrate_kv, save, sync_weights
from workers.rl.validation import validate, validation_due
from workers.rl.warmup import warmup
from workers.tasks import Task


@dataclass
class RunOptions:
    """How to run a job (what is not part of the job itself)."""

    resume: bool = False
    metrics_port: int | None = None  # None: no HTTP server; 0: any free port
    metrics_linger_s: float = 0.0  # serve /metrics this long after the last step (the operator's last read)
    job: str = ""
    namespace: str = "default"
    stop: threading.Event = field(default_factory=threading.Event)
    on_step: Callable[[StepMetrics | InitialValidation], None] | None = None  # progress display
    log: Callable[[str], None] = print
    ray_address: str | None = None
    drills: list[FaultDrill] = field(default_factory=list)  # provoked faults (fp8rl run --inject-fault)


def restore_line(log: MetricsLog, rows: list[Mapping[str, Any]], ckpt: Path) -> dict[str, Any] | None:
    """The checkpointed step's metrics line, appended to ``log`` if a kill fell between the
    checkpoint and the line (the checkpoint carries it, ``workers.rl.step.save``); None when it is there."""
    state = json.loads((ckpt / "state.json").read_text())
    row = state.get(METRICS_ROW)
    if row is None or any(r[m.STEP] == state["step"] for r in rows):
        return None
    log.append(row)
    return dict(row)


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


class JobRun:
    """One driver's run of a job: its actors, its log, and the recovery from data-plane faults
    (:mod:`workers.rl.faults`). A generator fault restarts the actors with the trainers' current
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
        self.own_spec = spec  # the job's; self.spec: what its precision actions make of it
        self.rebuild = False  # the precision actions changed: fresh actors before the next step
        self.rows, self.prom, self.opts = rows, prom, opts
        self.actors: JobActors | None = None
        self.loop: RlLoop | None = None
        self.drills = list(opts.drills)
        # this job's restarts so far (the rows of earlier drivers count: the bound is per job)
        self.restarts = {role: sum(int(r.get(key, 0)) for r in rows) for role, key in RESTART_ROLES.items()}
        self.counts = dict.fromkeys(m.FAULT_KEYS, 0.0)  # recovered since the last line: the next line's
        res = spec.resources  # the bounds of the actors' calls, their history kept across restarts
        self.timeouts = CallTimeouts(res.hang_timeout_s, res.startup_timeout_s)
        self.longest_prompt = max(len(tok.encode(task.prompt(p))) for p in task.problems())
        task.graders.scorer_factory = model_scorer  # a model grader's model: an actor of its own
        actors = grader_actors()  # graders' code: the job's Ray actors (workers.job.grader_actors)
        task.graders.use_pool(lambda memory_mb: RayGraderPool(actors, memory_mb))
        self.warned: set[str] = set()  # the fractions the log has warned about (response_warnings)
        self.mismatch = MismatchWatch(spec, out, opts.log)  # the SLO and the per-layer attribution

    # -- the steps ---------------------------------------------------------------------------------
    def begin(self, first_step: int, ckpt: Path | None) -> int:
        """Start the actors and bring them to ``first_step``: the checkpoint, or the warm-up; then
        the first weight sync and the step-0 validation. A fault on the way starts it all again
        (from the newest checkpoint: the warm-up writes one)."""
        t0, handled = time.monotonic(), list[ActorFault]()
        while True:
            try:
                self._adopt(ckpt)
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

    @property
    def ctx(self) -> StepContext:
        """The job's spec, task, tokenizer and current actors, as the steps take them."""
        assert self.actors is not None
        return StepContext(self.spec, self.task, self.tok, self.actors)

    def train(self, step: int) -> StepOutcome:
        """Generate, train and sync step ``step`` (asynchronous: train it while the next generate);
        an actor fault in it is in the outcome, for :meth:`recover`."""
        if self.rebuild:
            self._rebuild(step)
        assert self.actors is not None and self.loop is not None
        for drill in [d for d in self.drills if d.step == step]:
            self.drills.remove(drill)  # once per driver: fresh actors are not armed again
            self.actors.arm(drill.role, drill.index, drill.kind)
            self.opts.log(f"fault drill: {drill.role} {drill.index} will {drill.kind} in step {step}")
        outcome = self.loop.step(step)
        self.mismatch.probes = outcome.probes
        return outcome

    def finish(self, step: int, row: AsyncStepMetrics) -> None:
        """Validate (when due), checkpoint (when due, before the line: a line never refers to
        weights that were not saved) and write the step's line, with the faults recovered in it."""
        assert self.actors is not None
        if validation_due(self.spec, step):  # after the step's weight sync: the updated policy
            val = validate(self.ctx, step)
            row = cast(ValidatedStepMetrics, {**row, **val})
        line = cast(AsyncStepMetrics, {**row, **self.counts, **self.mismatch.observe(step, row, self.rows)})
        line = cast(AsyncStepMetrics, {**line, **self.mismatch.attribution(step, self.actors)})
        self._respond(step)
        line[PRECISION_ACTIONS] = float(len(self.mismatch.actions.taken))
        due = step % self.spec.checkpoint_interval == 0 or step == self.spec.steps
        if due:
            self._save(step, line)
        self.log.append(line)
        self.rows.append(line)
        self.counts = dict.fromkeys(m.FAULT_KEYS, 0.0)
        self.prom.observe(line)
        self._warn(line)
        if self.opts.on_step is not None:
            self.opts.on_step(line)
        if self.opts.stop.is_set():  # (the progress display may have set it)
            if not due:
                self._save(step, line)
            self.opts.log(f"stopped after step {step}; continue with --resume")

    def _save(self, step: int, line: Mapping[str, Any]) -> None:
        """The checkpoint of ``step``: the trainers, the line, and the precision actions in effect."""
        assert self.actors is not None
        save(self.actors, self.out, step, line, self.mismatch.checkpoint_state())

    # -- the mismatch SLO's precision actions (rljob.precision_actions) --------------------------------
    def _respond(self, step: int) -> None:
        """The SLO's response after ``step`` (:meth:`MismatchWatch.respond`): fresh actors before
        the next step when it changed the actions."""
        if self.mismatch.respond(step):
            self.rebuild = True

    def _adopt(self, ckpt: Path | None) -> None:
        """The precision actions ``ckpt`` kept (none without one), and the spec they make."""
        self.rebuild = False
        self.spec = effective(self.own_spec, self.mismatch.adopt(ckpt))

    def _rebuild(self, step: int) -> None:
        """Fresh actors built from the spec the precision actions make (both engines, through the
        path that builds them from a spec), with the trainers' current state, then the weight
        sync; the loop starts again at ``step``, batches generated before are generated again."""
        assert self.actors is not None
        self.rebuild = False
        self.spec = effective(self.own_spec, self.mismatch.actions)  # first: a fault's recovery builds it
        directory = RunDir(self.out).root / RECOVERY_DIR
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        self.actors.save(directory)
        self._start_actors()
        assert self.actors is not None
        self.actors.load(directory)
        if calibrates_kv(self.spec):
            calibrate_kv(self.ctx, step)
        sync_weights(self.actors)
        shutil.rmtree(directory, ignore_errors=True)
        self._restart_loop(step)

    def _warn(self, row: Mapping[str, Any]) -> None:
        for warning in response_warnings(self.spec, row, self.warned):
            self.opts.log(warning)

    def shutdown(self) -> None:
        if self.actors is not None:
            self.actors.shutdown()
            self.actors = None

    # -- recovery ----------------------------------------------------------------------------------
    def recover(
        self, fault: ActorFault, step: int, trained: AsyncStepMetrics | None
    ) -> tuple[int, AsyncStepMetrics | None]:
        """Recover from ``fault`` in step ``step`` (``trained``: the step's line if it was trained
        before the fault, :class:`~workers.rl.loop.StepOutcome`); returns the step to go on with
        and its line if it is trained. A fault while recovering counts too, and is recovered from
        in turn."""
        t0, handled = time.monotonic(), list[ActorFault]()
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
                timing = {m.TIMING_WEIGHT_SYNC_S: took, m.TIMING_STEP_S: spent + took, m.TIME: time.time()}
                return step, cast(AsyncStepMetrics, {**timing, **trained, **sync})
            except ActorFault as again:
                self.opts.log(f"fault: while recovering from step {step}'s: {again}")
                fault = again

    def _back_to_checkpoint(self) -> tuple[int, str]:
        """Fresh actors from the newest checkpoint (or from the start); the lines after it go,
        their fault counts carried into the next line. Returns the step to go on with and what
        was done."""
        last = checkpoint.latest(self.out)
        self._adopt(last[1] if last else None)
        self._start_actors()
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
        self.actors = JobActors(self.spec, self.tok.vocab_size, self.tok, self.longest_prompt, self.timeouts)
        if audit:
            audits = {"trainer": self.actors.trainer_audit, "generator": self.actors.generator_audit}
            write_json(RunDir(self.out).quantization_audit, audits)
            for role, table in audits.items():
                self.opts.log(f"quantization audit ({role}):\n{table['table']}")

    def _from(self, first_step: int, ckpt: Path | None) -> int:
        """Fresh actors to ``first_step``: load ``ckpt`` (or warm up), sync, validate step 0."""
        assert self.actors is not None
        spec, rows = self.spec, self.rows
        if ckpt is not None:
            self.actors.load(ckpt)
            self.opts.log(f"resumed from {ckpt} at step {first_step}")
            restored = restore_line(self.log, rows, ckpt)
            if restored is not None:
                rows.append(restored)
                self.opts.log(f"restored the metrics line of step {first_step - 1} from its checkpoint")
        elif spec.warmup.sft_steps:
            warmup(self.ctx, self.out, self.opts.log)
        if calibrates_kv(spec):  # vLLM's FP8 KV cache gets scales before its first rollout
            calibrate_kv(self.ctx, first_step)
        sync_weights(self.actors)  # generators start from the trainer's weights
        if spec.validation.interval and not any(r[m.STEP] == 0 for r in rows):
            # the policy RL starts from (after the warm-up): a row of its own, step 0
            row0 = cast(InitialValidation, {m.STEP: 0, **validate(self.ctx, 0)})
            self.log.append(row0)
            rows.append(row0)
            self.prom.observe(row0)
            self._warn(row0)
            if self.opts.on_step is not None:
                self.opts.on_step(row0)
        self._restart_loop(first_step)
        return first_step

    def _restart_loop(self, first_step: int) -> None:
        """The RL loop from ``first_step`` (:mod:`workers.rl.loop`); a new one after a fault, whose
        batches in flight are lost and generated again, never trained twice."""
        self.loop = RlLoop(self.ctx, first_step)


RECOVERY_DIR = ".recovery"  # the trainers' state while fresh actors start (a generator fault, an action)
