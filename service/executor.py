"""Runs the jobs of the embedded default: one ``python -m workers.driver`` process per job.

Each job gets a run directory ``<data_dir>/runs/<tenant>/<name>/`` with ``job.json`` (the spec),
``driver.log`` and what the driver writes (``metrics.jsonl``, checkpoints). A monitor thread turns
what it observes into phases through the state machine: a started process is Starting, its first
metrics line makes it Running, exit 0 Succeeded, any other exit Failed with the exit code and the
log's last line (resumable from the last checkpoint). Suspend sends SIGINT, which the driver answers
by checkpointing after the current step; resume starts the driver again with ``--resume``.

Nothing stays Running forever: on start, jobs left Starting/Running by a previous service process
(whose driver is gone) are marked Failed with reason ``ServiceRestarted`` and can be resumed.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from rljob.status import TERMINAL, IllegalTransition, JobStatus, Phase, Progress
from service.store import Job, JobNotFound, SqlJobStore
from workers.metrics import MetricsLog


@dataclass
class _Running:
    job: Job
    proc: subprocess.Popen[bytes]
    log: Path
    metrics: MetricsLog
    seen_step: int = 0
    offset: int = 0  # bytes of metrics.jsonl already read


def run_dir(data_dir: Path, tenant: str, name: str) -> Path:
    return data_dir / "runs" / tenant / name


class LocalExecutor:
    def __init__(self, store: SqlJobStore, data_dir: Path, poll_s: float = 0.5) -> None:
        self.store, self.data_dir, self.poll_s = store, data_dir, poll_s
        self._procs: dict[tuple[str, str], _Running] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._monitor, name="fp8rl-executor", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Recover after a restart, start pending jobs, then watch."""
        jobs, _ = self.store.query(None, None, limit=1_000_000)
        for job in jobs:
            if job.status.phase in (Phase.STARTING, Phase.RUNNING):
                self._move(
                    job, Phase.FAILED, "ServiceRestarted", "the control plane restarted; resume the job"
                )
            elif job.status.phase is Phase.PENDING:
                self.submit(job)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    # -- actions (called by the routes) ---------------------------------------------------------

    def submit(self, job: Job) -> None:
        out = run_dir(self.data_dir, job.tenant, job.name)
        out.mkdir(parents=True, exist_ok=True)
        spec_file = out / "job.json"
        spec_file.write_text(job.spec.model_dump_json())
        resume = (out / "checkpoints").exists() or (out / "metrics.jsonl").exists()
        cmd = [sys.executable, "-m", "workers.driver", str(spec_file), "--output", str(out)]
        cmd += ["--job", job.name, "--namespace", job.tenant] + (["--resume"] if resume else [])
        log = out / "driver.log"
        with log.open("ab") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        with self._lock:
            self._procs[(job.tenant, job.name)] = _Running(job, proc, log, MetricsLog(out / "metrics.jsonl"))
        self._move(job, Phase.STARTING, "ProcessStarted", f"driver pid {proc.pid}")

    def suspend(self, job: Job) -> None:
        self._signal(job, signal.SIGINT)

    def resume(self, job: Job) -> None:
        self.submit(job)

    def cancel(self, job: Job) -> None:
        with self._lock:
            running = self._procs.pop((job.tenant, job.name), None)
        if running is not None:
            running.proc.kill()
            running.proc.wait()
        if job.status.phase not in TERMINAL:
            self._move(job, Phase.CANCELLED, "UserCancelled", "cancelled")

    def _signal(self, job: Job, sig: int) -> None:
        with self._lock:
            running = self._procs.get((job.tenant, job.name))
        if running is not None and running.proc.poll() is None:
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
                    s.moved(Phase.RUNNING, "Training", f"step {progress.step}")
                    if s.phase is Phase.STARTING
                    else s
                )

            with contextlib.suppress(IllegalTransition, JobNotFound):
                self.store.update(r.job.tenant, r.job.name, change)
        code = r.proc.poll()
        if code is None:
            return
        with self._lock:
            self._procs.pop(key, None)
        try:
            current = self.store.get(r.job.tenant, r.job.name).status.phase
        except JobNotFound:
            return
        if current is Phase.SUSPENDED or current is Phase.CANCELLED:
            return
        if code == 0:
            self._move(r.job, Phase.SUCCEEDED, "Completed", f"finished step {r.seen_step}")
        else:
            lines = r.log.read_text(errors="replace").strip().splitlines() if r.log.exists() else []
            last = lines[-1][:300] if lines else ""
            self._move(r.job, Phase.FAILED, "WorkerExited", f"driver exited with code {code}: {last}")

    def _monitor(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                items = list(self._procs.items())
            for key, r in items:
                self._observe(key, r)


def read_metrics(data_dir: Path, job: Job) -> list[dict[str, object]]:
    return MetricsLog(run_dir(data_dir, job.tenant, job.name) / "metrics.jsonl").rows()
