"""Runs the jobs of the embedded default: one ``python -m workers.driver`` process per job.

Each job gets a run directory ``<data_dir>/runs/<tenant>/<name>/`` with ``job.json`` (the spec),
``driver.log`` and what the driver writes (``metrics.jsonl``, checkpoints). A monitor thread turns
what it observes into phases through the state machine: a started process is Starting, its first
metrics line makes it Running, exit 0 Succeeded, any other exit Failed with the exit code and the
log's last line (resumable from the last checkpoint). Suspend sends SIGINT, which the driver answers
by checkpointing after the current step; resume starts the driver again with ``--resume``.

Drivers run in their own session, so they outlive a restart of the service. Each run directory
holds ``driver.pid`` (pid and the process's start time, which tells a live driver from a reused
pid). On start, a job left Starting/Running by a previous service process is re-attached if its
driver still runs: it is watched as before, and when it exits the outcome is read from what it
wrote (its last step reaching ``steps`` is Succeeded; otherwise Failed, reason ``WorkerExited``).
If the driver is gone, the job is Succeeded if it finished, else Failed with reason
``ServiceRestarted``, resumable. Nothing stays Running forever.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rljob.jobs import Job, JobNotFound, JobStore
from rljob.kube import KubernetesJobStore
from rljob.metrics import MetricsLog
from rljob.paths import path_problems
from rljob.status import EXIT_OUT_OF_MEMORY, TERMINAL, IllegalTransition, JobStatus, Phase, Progress, Reason


class Executor(Protocol):
    """What the routes call after recording a user's action."""

    runs_locally: bool  # its jobs write their logs and metrics under the service's data dir

    def submit(self, job: Job) -> None: ...

    def suspend(self, job: Job) -> None: ...

    def resume(self, job: Job) -> None: ...

    def cancel(self, job: Job) -> None: ...


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None
    if there is no such process or it has exited (a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


UNKNOWN_EXIT = -1000  # a re-attached driver is not our child: its exit code cannot be read
# a resume waits this long for the suspended driver to save its step and exit, then kills it
RESUME_WAIT_S = 120.0


class _Process:
    """A driver process: started here (``Popen``) or re-attached after a restart (pid only)."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None, started: str = "") -> None:
        self.pid, self.popen = pid, popen
        self.started = started or (_start_time(pid) or "")

    def poll(self) -> int | None:
        """None while it runs; the exit code when known; ``UNKNOWN_EXIT`` for a re-attached one."""
        if self.popen is not None:
            return self.popen.poll()
        return None if _start_time(self.pid) == self.started else UNKNOWN_EXIT

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the driver's whole process group: its session holds the local Ray processes."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()


@dataclass
class _Running:
    job: Job
    proc: _Process
    log: Path
    metrics: MetricsLog
    seen_step: int = 0
    offset: int = 0  # bytes of metrics.jsonl already read
    stopping: bool = False  # suspended: its exit is not the job's outcome


@dataclass(frozen=True)
class DriverLimits:
    """What one driver (and the local Ray processes it starts, which inherit all three) may take."""

    memory_bytes: int | None = None  # address space of each process (RLIMIT_AS); None: no limit
    cpus: int | None = None  # CPUs it may run on (affinity); None: all
    nice: int = 10  # added to the service's niceness, so the API answers while drivers compute


def _confine(pid: int, tenant: str, limits: DriverLimits) -> None:
    """Apply ``limits`` to a just-started driver, before it starts Ray (its imports take seconds)."""
    with contextlib.suppress(ProcessLookupError):
        if limits.memory_bytes:
            resource.prlimit(pid, resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        # niceness relative to the service's own (raising it needs no privilege)
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + limits.nice))
        if limits.cpus:
            allowed = sorted(os.sched_getaffinity(0))
            start = zlib.crc32(tenant.encode()) % len(allowed)  # tenants spread over the CPUs
            picked = {allowed[(start + i) % len(allowed)] for i in range(min(limits.cpus, len(allowed)))}
            os.sched_setaffinity(pid, picked)


def driver_command(spec_file: Path, out: Path, job: Job, resume: bool) -> list[str]:
    """The driver process of ``job``."""
    cmd = [sys.executable, "-m", "workers.driver", str(spec_file), "--output", str(out)]
    return cmd + ["--job", job.name, "--namespace", job.tenant] + (["--resume"] if resume else [])


def run_dir(data_dir: Path, tenant: str, name: str) -> Path:
    return data_dir / "runs" / tenant / name


def tenant_home(data_dir: Path, tenant: str) -> Path:
    """Where a tenant's drivers run and its jobs' relative paths resolve (:mod:`rljob.paths`)."""
    return data_dir / "tenants" / tenant


def _finished(job: Job, metrics: MetricsLog) -> bool:
    rows = metrics.rows()
    return bool(rows) and int(str(rows[-1]["step"])) >= job.spec.steps


class LocalExecutor:
    runs_locally = True

    def __init__(
        self,
        store: JobStore,
        data_dir: Path,
        poll_s: float = 0.5,
        read_only: list[Path] | None = None,
        limits: Callable[[str], DriverLimits] = lambda tenant: DriverLimits(),
    ) -> None:
        self.store, self.data_dir, self.poll_s = store, data_dir, poll_s
        self.read_only = read_only or []  # the service's read-only roots (FP8RL_MODEL_ROOTS)
        self.limits = limits  # what a tenant's drivers may take of this machine
        self._procs: dict[tuple[str, str], _Running] = {}
        self._lock = threading.Lock()
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
        out = run_dir(self.data_dir, job.tenant, job.name)
        metrics = MetricsLog(out / "metrics.jsonl")
        try:
            record = json.loads((out / "driver.pid").read_text())
            proc = _Process(int(record["pid"]), started=str(record["started"]))
        except (OSError, ValueError, KeyError):
            proc = None
        if proc is not None and proc.poll() is None:
            with self._lock:
                self._procs[(job.tenant, job.name)] = _Running(job, proc, out / "driver.log", metrics)
        elif _finished(job, metrics):
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

    def submit(self, job: Job) -> None:
        home = tenant_home(self.data_dir, job.tenant)
        home.mkdir(parents=True, exist_ok=True)
        # checked at POST; again here, since a symlink may have changed since (nothing is opened)
        outside = path_problems(job.spec, home, self.read_only)
        if outside:
            problem = "; ".join(f"{p.field}: {p.message}" for p in outside)
            self._move(job, Phase.FAILED, Reason.PATH_OUTSIDE_TENANT, problem)
            return
        out = run_dir(self.data_dir, job.tenant, job.name)
        out.mkdir(parents=True, exist_ok=True)
        spec_file = out / "job.json"
        spec_file.write_text(job.spec.model_dump_json())
        resume = (out / "checkpoints").exists() or (out / "metrics.jsonl").exists()
        cmd = driver_command(spec_file, out, job, resume)
        log = out / "driver.log"
        with log.open("ab") as f:
            # in the tenant's directory: the job's relative paths resolve there (rljob.paths)
            popen = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=home
            )
        _confine(popen.pid, job.tenant, self.limits(job.tenant))
        proc = _Process(popen.pid, popen)
        (out / "driver.pid").write_text(json.dumps({"pid": proc.pid, "started": proc.started}))
        with self._lock:
            self._procs[(job.tenant, job.name)] = _Running(job, proc, log, MetricsLog(out / "metrics.jsonl"))
        self._move(job, Phase.STARTING, Reason.PROCESS_STARTED, f"driver pid {proc.pid}")

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
        except JobNotFound:
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
        with contextlib.suppress(IllegalTransition, JobNotFound):
            self.store.update(job.tenant, job.name, change)

    def _observe(self, key: tuple[str, str], r: _Running) -> None:
        rows, r.offset = r.metrics.read_new(r.offset)
        if rows and int(rows[-1]["step"]) != r.seen_step:
            r.seen_step = int(rows[-1]["step"])
            progress = Progress.from_row(rows[-1], r.job.spec.steps)

            def change(s: JobStatus) -> JobStatus:
                s = s.model_copy(update={"progress": progress})
                return (
                    s.moved(Phase.RUNNING, Reason.TRAINING, f"step {progress.step}")
                    if s.phase is Phase.STARTING
                    else s
                )

            with contextlib.suppress(IllegalTransition, JobNotFound):
                self.store.update(r.job.tenant, r.job.name, change)
        code = r.proc.poll()
        if code is None:
            return
        with self._lock:
            if self._procs.get(key) is not r:
                return  # a newer driver of this job took its place
            del self._procs[key]
        if r.stopping:
            return  # suspended: the job's phase says so already
        try:
            current = self.store.get(r.job.tenant, r.job.name).status.phase
        except JobNotFound:
            return
        if current is Phase.SUSPENDED or current is Phase.CANCELLED:
            return
        if code == 0 or (code == UNKNOWN_EXIT and _finished(r.job, r.metrics)):
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
            self._move(r.job, Phase.FAILED, Reason.WORKER_EXITED, f"driver exited {how}: {last}")

    def _monitor(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                items = list(self._procs.items())
            for key, r in items:
                self._observe(key, r)


def read_metrics(data_dir: Path, job: Job) -> list[dict[str, object]]:
    return MetricsLog(run_dir(data_dir, job.tenant, job.name) / "metrics.jsonl").rows()


class OperatorHandoff:
    """The executor of ``--store kubernetes``: the operator runs the jobs, so submitting is the
    create itself; suspend and resume flip ``spec.suspend``; cancel is the delete (the operator's
    finalizer removes the RayJob)."""

    runs_locally = False

    def __init__(self, store: KubernetesJobStore) -> None:
        self.store = store

    def submit(self, job: Job) -> None:
        pass

    def suspend(self, job: Job) -> None:
        self.store.set_suspend(job.tenant, job.name, True)

    def resume(self, job: Job) -> None:
        self.store.set_suspend(job.tenant, job.name, False)

    def cancel(self, job: Job) -> None:
        pass
