"""What the local executor (:mod:`service.local_executor`) reads from and writes to a job's run
directory ``<data_dir>/runs/<tenant>/<name>/``: where it is, the driver command that fills it,
and the conditions read back from it (the faults the driver recovered from, whether the run
finished, why one over its memory limit was stopped).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rljob.jobs import Job
from rljob.metrics import MetricsLog
from rljob.run_dir import RunDir, driver_argv
from rljob.status import Reason


def run_dir(data_dir: Path, tenant: str, name: str) -> RunDir:
    """The run directory of a local job: ``<data_dir>/runs/<tenant>/<name>``."""
    return RunDir(data_dir / "runs" / tenant / name)


def driver_command(run: RunDir, job: Job, resume: bool) -> list[str]:
    """The driver process of ``job``: the service's own interpreter, and no Prometheus server
    (drivers on one machine would fight for the port; the service reads ``metrics.jsonl``)."""
    return driver_argv(
        run.job_spec,
        run.root,
        job=job.name,
        namespace=job.tenant,
        resume=resume,
        metrics_port=None,
        python=sys.executable,
    )


def fault_condition(faults: Path) -> tuple[str, str] | None:
    """The ``FaultsRecovered`` condition's reason and message from a run's ``faults.jsonl``: the
    last fault and the restarts of each role so far (None: no fault)."""
    if not faults.exists():
        return None
    entries = [json.loads(line) for line in faults.read_text().splitlines() if line.strip()]
    if not entries:
        return None
    last = entries[-1]
    where = f"step {last['step']}" if last["step"] else "the job's start"
    counts = {role: sum(e["role"] == role for e in entries) for role in ("generator", "trainer")}
    message = (
        f"{last['role']} {last['index']} {last['what']} during {last['call']} in {where}: "
        f"{last['action']} ({last['seconds']:.1f} s); restarts so far: "
        f"{counts['generator']} generator, {counts['trainer']} trainer"
    )
    reason = Reason.GENERATOR_RESTARTED if last["role"] == "generator" else Reason.TRAINER_RESTARTED
    return reason, message


def finished(job: Job, metrics: MetricsLog) -> bool:
    """Whether the run's last metrics line reached the job's ``steps``."""
    rows = metrics.rows()
    return bool(rows) and int(str(rows[-1]["step"])) >= job.spec.steps


def over_memory_message(used: int, limit: int) -> str:
    """Why a job over its resident-memory limit was stopped: ``used`` and ``limit`` in bytes, each
    in MiB, the use rounded up (a use of a byte over a 200 MiB limit reads 201 MiB, never "200 MiB,
    over its limit of 200 MiB")."""
    return (
        f"the job's processes used {-(-used // 2**20)} MiB, over its limit of {limit // 2**20} MiB "
        "(max_resident_mb); ask for less (smaller batches, fewer actors) or a higher limit"
    )


def read_metrics(data_dir: Path, job: Job) -> list[dict[str, object]]:
    return MetricsLog(run_dir(data_dir, job.tenant, job.name).metrics).rows()
