"""Runs the jobs of the embedded default: one driver process per job
(:func:`service.local_runs.driver_command`).

Each job gets a run directory ``<data_dir>/runs/<tenant>/<name>/`` (``rljob.run_dir.RunDir``)
with ``job.json`` (the spec), ``driver.log`` and what the driver writes (``metrics.jsonl``,
checkpoints). A monitor thread turns what it observes into phases through the state machine: a
started process is Starting, its first metrics line makes it Running, exit 0 Succeeded. A driver
that fails otherwise is started again with ``--resume`` up to ``driver_retries`` times (Starting,
reason ``DriverRestarted``): the last line behind the driver's own recovery from actor faults;
then, and at once after a bad spec (exit 2), out of memory or more actor faults than the job
allows, the job is Failed with the exit code and the log's last line (resumable from the last
checkpoint). Each fault the driver recovered from in place (``faults.jsonl``) sets the job's
``FaultsRecovered`` condition: the last fault, and the job's restarts so far.
Suspend sends SIGINT, which the driver answers by checkpointing after the current step; resume
starts the driver again with ``--resume``.

Drivers get a minimal environment, not the service's (``service.driver_process.driver_environment``:
what the driver and its runtimes read, never the service's secrets; ``driver_env`` adds names),
with their tenant's own HOME and caches, and run in a sandbox where one is available
(``service.sandbox``). At most ``max_drivers`` run at once; other jobs wait Pending, oldest first.
A running job over its wall-clock or resident-memory limit (``DriverLimits``) is stopped, Failed
and resumable.

Drivers outlive a restart of the service (``service.driver_process``). On start, a job left
Starting/Running by a previous service process is re-attached if its driver still runs: it is
watched as before, and when it exits the outcome is read from what it wrote (its last step
reaching ``steps`` is Succeeded; otherwise Failed, reason ``WorkerExited``). If the driver is
gone, the job is Succeeded if it finished, else Failed with reason ``ServiceRestarted``,
resumable. Nothing stays Running forever.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob import metrics as m
from rljob.jobs import InvalidRecord, Job, JobNotFound, JobStore
from rljob.metrics import MetricsLog
from rljob.mismatch_slo import condition_of
from rljob.paths import path_problems, shown_home, tenant_home
from rljob.precision_actions import condition_of as precision_condition_of
from rljob.status import (
    EXIT_OUT_OF_MEMORY,
    EXIT_TOO_MANY_FAULTS,
    FAULTS_RECOVERED,
    MISMATCH_SLO,
    PRECISION_ACTIONS,
    TERMINAL,
    IllegalTransition,
    JobStatus,
    Phase,
    Progress,
    Reason,
)
from service.driver_process import (
    UNKNOWN_EXIT,
    DriverLimits,
    DriverProcess,
    confinement,
    driver_environment,
    sessions_memory,
    tenant_environment,
)
from service.local_runs import driver_command, fault_condition, finished, over_memory_message, run_dir
from service.sandbox import Sandbox

log = logging.getLogger(__name__)
# a resume waits this long for the suspended driver to save its step and exit, then kills it
RESUME_WAIT_S = 120.0
BAD_INPUT_EXIT = 2  # the driver's exit on a bad spec or output directory: starting again cannot help


@dataclass
class _Running:
    job: Job
    proc: DriverProcess
    log: Path
    metrics: MetricsLog
    seen_step: int = 0
    offset: int = 0  # bytes of metrics.jsonl already read
    stopping: bool = False  # suspended: its exit is not the job's outcome
    retries: int = 0  # drivers of this job started again after a failure (driver_retries)
    faults_seen: int = 0  # bytes of faults.jsonl already in the job's condition
    started: float = 0.0  # wall clock at start: rows stamped before it are an earlier driver's
    first_started: float = 0.0  # wall clock when this run of the job began (restarts keep it)


class LocalExecutor:
    runs_locally = True

    def __init__(
        self,
        store: JobStore,
        data_dir: Path,
        poll_s: float = 0.5,
        read_only: list[Path] | None = None,
        limits: Callable[[str], DriverLimits] = lambda tenant: DriverLimits(),
        driver_retries: int = 2,
        driver_env: Sequence[str] = (),
        max_drivers: int | None = None,
        sandbox: Sandbox | None = None,
        hf_token: Callable[[str], str | None] = lambda tenant: None,
    ) -> None:
        self.store, self.data_dir, self.poll_s = store, data_dir, poll_s
        self.driver_env = tuple(driver_env)  # names passed to drivers beyond driver_environment's own
        self.driver_retries = driver_retries  # a failed driver is started again this often (--resume)
        self.read_only = read_only or []  # the service's read-only roots (FP8RL_MODEL_ROOTS)
        self.limits = limits  # what a tenant's drivers may take of this machine
        self.max_drivers = max_drivers  # local drivers at once, every tenant's; None: no cap
        self.sandbox = sandbox or Sandbox(None, "no sandbox asked for")
        self.hf_token = hf_token  # a tenant's Hugging Face token, where its settings give one
        self._procs: dict[tuple[str, str], _Running] = {}
        self._lock = threading.Lock()
        self._starting = threading.Lock()  # one start at a time: a job is never started twice
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._monitor, name="fp8rl-executor", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Recover after a restart (re-attach live drivers), start pending jobs, then watch."""
        jobs, _ = self.store.query(None, None, limit=1_000_000)
        for job in jobs:
            if job.status.phase in (Phase.STARTING, Phase.RUNNING):
                self._recover(job)
            elif job.status.phase is Phase.PENDING:
                self.submit(job)
        self._thread.start()

    def _recover(self, job: Job) -> None:
        run = run_dir(self.data_dir, job.tenant, job.name)
        metrics = MetricsLog(run.metrics)
        proc = DriverProcess.attach(run.driver_pid)
        if proc is not None and proc.poll() is None:
            # its wall-clock limit counts from when its pid record was written (its own start)
            began = run.driver_pid.stat().st_mtime
            with self._lock:
                self._procs[(job.tenant, job.name)] = _Running(
                    job, proc, run.driver_log, metrics, started=began, first_started=began
                )
        elif finished(job, metrics):
            self._move(job, Phase.SUCCEEDED, Reason.COMPLETED, "finished while the control plane was down")
        else:
            self._move(
                job,
                Phase.FAILED,
                Reason.SERVICE_RESTARTED,
                "the driver stopped while the control plane was down; resume the job",
            )

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    # -- actions (called by the routes) ---------------------------------------------------------

    def submit(self, job: Job, retries: int = 0, why: str = "", first_started: float | None = None) -> None:
        """Start ``job``'s driver (``--resume`` when its run directory holds a run), unless
        ``max_drivers`` drivers run already: then it stays Pending, and the monitor starts it when
        one ends (oldest Pending job first). ``retries``: the drivers of this job that failed and
        were started again (``why``: the last failure); a restart takes the slot its failed driver
        left."""
        key = (job.tenant, job.name)
        with self._starting:
            with self._lock:
                current, busy = self._procs.get(key), len(self._procs)
            if retries == 0:
                if current is not None and current.proc.poll() is None:
                    return  # its driver runs (the queue and a route both asked)
                if self.max_drivers is not None and busy >= self.max_drivers:
                    return  # queued: Pending until a driver slot frees
            self._start(job, retries, why, first_started)

    def _start_queued(self) -> None:
        """Start the oldest Pending jobs while driver slots are free."""
        if self.max_drivers is None:
            return
        with self._lock:
            free = self.max_drivers - len(self._procs)
        if free <= 0:
            return
        pending, _ = self.store.query(None, Phase.PENDING, limit=free)
        for job in pending:
            self.submit(job)

    def _start(self, job: Job, retries: int, why: str, first_started: float | None) -> None:
        home = tenant_home(self.data_dir, job.tenant)
        home.mkdir(parents=True, exist_ok=True)
        # checked at POST; again here, since a symlink may have changed since (nothing is opened)
        outside = path_problems(job.spec, home, self.read_only, shown_home=shown_home(job.tenant))
        if outside:
            problem = "; ".join(f"{p.field}: {p.message}" for p in outside)
            self._move(job, Phase.FAILED, Reason.PATH_OUTSIDE_TENANT, problem)
            return
        run = run_dir(self.data_dir, job.tenant, job.name)
        run.root.mkdir(parents=True, exist_ok=True)
        run.job_spec.write_text(job.spec.model_dump_json())
        resume = run.checkpoints.exists() or run.metrics.exists()
        # in the tenant's directory: the job's relative paths resolve there (rljob.paths)
        env = driver_environment(os.environ, self.driver_env)  # read now: a setting may change
        cache = self.data_dir / "cache" / job.tenant  # the tenant's HOME and caches, not the service's
        cache.mkdir(parents=True, exist_ok=True)
        env = tenant_environment(env, cache, self.hf_token(job.tenant))
        if self.sandbox.bwrap:  # the grader sandbox inside it: the same program (bound in by wrap)
            env["FP8RL_BWRAP"] = self.sandbox.bwrap
        argv = self.sandbox.wrap(driver_command(run, job, resume), home=home, run=run.root, cache=cache)
        proc = DriverProcess.start(
            argv, run.driver_log, cwd=home, env=env, confine=confinement(job.tenant, self.limits(job.tenant))
        )
        proc.save(run.driver_pid)
        now = time.time()
        running = _Running(
            job,
            proc,
            run.driver_log,
            MetricsLog(run.metrics),
            retries=retries,
            started=now,
            first_started=first_started if first_started is not None else now,
        )
        running.faults_seen = -1  # the condition is refreshed from the file on the first look
        with self._lock:
            self._procs[(job.tenant, job.name)] = running
        if retries:
            self._restarted(job, f"{why}; started again with --resume ({retries} of {self.driver_retries})")
        else:
            self._move(job, Phase.STARTING, Reason.PROCESS_STARTED, f"driver pid {proc.pid}")

    def _restarted(self, job: Job, message: str) -> None:
        """Starting again, reason ``DriverRestarted`` (from Running, or still Starting)."""

        def change(s: JobStatus) -> JobStatus:
            if s.phase is Phase.RUNNING:
                return s.moved(Phase.STARTING, Reason.DRIVER_RESTARTED, message)
            if s.phase is Phase.STARTING:
                noted = s.noted(Phase.STARTING.value, Reason.DRIVER_RESTARTED, message)
                return noted.model_copy(update={"reason": Reason.DRIVER_RESTARTED, "message": message})
            return s

        with contextlib.suppress(IllegalTransition, JobNotFound, InvalidRecord):
            self.store.update(job.tenant, job.name, change)

    def suspend(self, job: Job) -> None:
        with self._lock:
            running = self._procs.get((job.tenant, job.name))
            if running is not None:
                running.stopping = True
        self._signal(job, signal.SIGINT)

    def resume(self, job: Job) -> None:
        """Start the driver again; a suspended driver still saving its step is waited for first
        (two drivers must never share a run directory), in the background."""
        with self._lock:
            old = self._procs.get((job.tenant, job.name))
        if old is None or old.proc.poll() is not None:
            self.submit(job)
            return
        threading.Thread(target=self._resume_after, args=(old, job), name="fp8rl-resume", daemon=True).start()

    def _resume_after(self, old: _Running, job: Job) -> None:
        deadline = time.monotonic() + RESUME_WAIT_S
        while old.proc.poll() is None and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.1)
        if old.proc.poll() is None:
            old.proc.kill()  # it was told to stop and did not: it must not write beside the new one
        with self._lock:
            if self._procs.get((job.tenant, job.name)) is old:
                del self._procs[(job.tenant, job.name)]
        try:
            current = self.store.get(job.tenant, job.name)
        except (JobNotFound, InvalidRecord):
            return
        if current.status.phase is Phase.PENDING:  # not suspended or cancelled again meanwhile
            self.submit(current)

    def cancel(self, job: Job) -> None:
        with self._lock:
            running = self._procs.pop((job.tenant, job.name), None)
        if running is not None:
            running.proc.kill()
        if job.status.phase not in TERMINAL:
            self._move(job, Phase.CANCELLED, Reason.USER_CANCELLED, "cancelled")

    def _signal(self, job: Job, sig: int) -> None:
        with self._lock:
            running = self._procs.get((job.tenant, job.name))
        if running is not None:
            running.proc.send_signal(sig)

    # -- observation ----------------------------------------------------------------------------

    def _move(self, job: Job, target: Phase, reason: str, message: str = "") -> None:
        def change(s: JobStatus) -> JobStatus:
            return s if s.phase is target else s.moved(target, reason, message)

        # the user may have moved it meanwhile (e.g. cancelled or deleted): their move wins
        with contextlib.suppress(IllegalTransition, JobNotFound, InvalidRecord):
            self.store.update(job.tenant, job.name, change)

    def _over_limit(self, key: tuple[str, str], r: _Running, used: int | None) -> bool:
        """Stop a running job over its wall-clock or resident-memory limit (``used``: the bytes
        its processes use, where it has that limit): Failed, resumable. True if it was stopped."""
        limits = self.limits(r.job.tenant)
        if limits.wall_clock_s is not None and time.time() - r.first_started > limits.wall_clock_s:
            reason, message = (
                Reason.DEADLINE_EXCEEDED,
                f"the job ran {limits.wall_clock_s:g} s, its wall-clock limit (max_job_seconds); resume "
                "it to go on from its last checkpoint",
            )
        elif limits.resident_bytes is not None and used is not None and used > limits.resident_bytes:
            reason, message = Reason.OUT_OF_MEMORY, over_memory_message(used, limits.resident_bytes)
        else:
            return False
        with self._lock:
            if self._procs.get(key) is r:
                del self._procs[key]
        r.proc.kill()
        self._move(r.job, Phase.FAILED, reason, message)
        return True

    def _observe(self, key: tuple[str, str], r: _Running, used: int | None = None) -> None:
        rows, r.offset = r.metrics.read_new(r.offset)
        if rows and int(rows[-1]["step"]) != r.seen_step:
            r.seen_step = int(rows[-1]["step"])
            progress = Progress.from_row(rows[-1], r.job.spec.steps)
            # a resumed driver is Running once it writes a step of its own: the rows an earlier
            # driver left (read again from the start) only carry the progress over
            own = float(rows[-1].get(m.TIME, r.started)) >= r.started

            def change(s: JobStatus) -> JobStatus:
                s = s.model_copy(update={"progress": progress})
                return (
                    s.moved(Phase.RUNNING, Reason.TRAINING, f"step {progress.step}")
                    if s.phase is Phase.STARTING and own
                    else s
                )

            with contextlib.suppress(IllegalTransition, JobNotFound, InvalidRecord):
                self.store.update(r.job.tenant, r.job.name, change)
            self._note_slo(r, rows[-1])
        self._note_faults(r)
        code = r.proc.poll()
        if code is None:
            self._over_limit(key, r, used)
            return
        with self._lock:
            if self._procs.get(key) is not r:
                return  # a newer driver of this job took its place
            del self._procs[key]
        if r.stopping:
            return  # suspended: the job's phase says so already
        try:
            current = self.store.get(r.job.tenant, r.job.name).status.phase
        except (JobNotFound, InvalidRecord):
            return
        if current is Phase.SUSPENDED or current is Phase.CANCELLED:
            return
        if code == 0 or (code == UNKNOWN_EXIT and finished(r.job, r.metrics)):
            self._move(r.job, Phase.SUCCEEDED, Reason.COMPLETED, f"finished step {r.seen_step}")
        elif code == EXIT_OUT_OF_MEMORY:
            limit = self.limits(r.job.tenant).memory_bytes
            what = (
                f"its memory limit of {limit // 2**20} MiB (max_memory_mb)"
                if limit
                else "the machine's memory"
            )
            self._move(
                r.job, Phase.FAILED, Reason.OUT_OF_MEMORY, f"the driver ran out of memory: over {what}"
            )
        else:
            lines = r.log.read_text(errors="replace").strip().splitlines() if r.log.exists() else []
            last = lines[-1][:300] if lines else ""
            how = "with an unknown code (re-attached)" if code == UNKNOWN_EXIT else f"with code {code}"
            if code == EXIT_TOO_MANY_FAULTS:
                self._move(r.job, Phase.FAILED, Reason.TOO_MANY_FAULTS, last)
            elif code != BAD_INPUT_EXIT and r.retries < self.driver_retries:
                self.submit(r.job, r.retries + 1, f"driver exited {how}: {last}", r.first_started)
            else:
                self._move(r.job, Phase.FAILED, Reason.WORKER_EXITED, f"driver exited {how}: {last}")

    def _note_slo(self, r: _Running, row: Mapping[str, Any]) -> None:
        """The job's ``MismatchSLO`` and ``PrecisionActions`` conditions from its newest line
        (``rljob.mismatch_slo``, ``rljob.precision_actions``), each when the line has its keys."""
        found = condition_of(row, r.job.spec.precision.mismatch_slo)
        if found is not None:
            met, reason, message = found
            with contextlib.suppress(IllegalTransition, JobNotFound, InvalidRecord):
                self.store.update(
                    r.job.tenant, r.job.name, lambda s: s.with_condition(MISMATCH_SLO, met, reason, message)
                )
        acted = precision_condition_of(row, r.job.spec.precision.mismatch_slo)
        if acted is not None:
            on, why, what = acted
            with contextlib.suppress(IllegalTransition, JobNotFound, InvalidRecord):
                self.store.update(
                    r.job.tenant, r.job.name, lambda s: s.with_condition(PRECISION_ACTIONS, on, why, what)
                )

    def _note_faults(self, r: _Running) -> None:
        """The job's ``FaultsRecovered`` condition, when ``faults.jsonl`` has grown."""
        path = run_dir(self.data_dir, r.job.tenant, r.job.name).faults
        if not path.exists():
            return
        size = path.stat().st_size  # the driver only appends: a new size is a new fault
        if size == r.faults_seen:
            return
        r.faults_seen = size
        condition = fault_condition(path)
        if condition is None:
            return
        reason, message = condition
        with contextlib.suppress(IllegalTransition, JobNotFound, InvalidRecord):
            self.store.update(r.job.tenant, r.job.name, lambda s: s.noted(FAULTS_RECOVERED, reason, message))

    def _monitor(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                items = list(self._procs.items())
            watched = [r.proc.pid for _, r in items if self.limits(r.job.tenant).resident_bytes]
            memory = sessions_memory(watched)
            for key, r in items:
                try:
                    self._observe(key, r, memory.get(r.proc.pid))
                except Exception:  # one job's surprise never stops the watch over the others
                    log.exception("watching job %r of tenant %r failed; watching on", key[1], key[0])
            try:
                self._start_queued()
            except Exception:
                log.exception("starting queued jobs failed; trying again at the next poll")
