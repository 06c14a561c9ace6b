"""Job stores behind one protocol, ``JobStore``. ``SqlJobStore`` keeps jobs in SQLite (the embedded
default): one row per (tenant, name), the spec and status as JSON. A UNIQUE constraint makes
concurrent creates of one name record it exactly once; status changes are read-check-write under
one lock, through the state machine in ``rljob.status``. ``rljob.kube.KubernetesJobStore``
keeps each job as an RLJob custom resource instead."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from rljob.jobs import Job, JobExists, JobNotFound, gpus_of
from rljob.spec import JobSpec
from rljob.status import ACTIVE, JobStatus, Phase

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    tenant  TEXT NOT NULL,
    name    TEXT NOT NULL,
    spec    TEXT NOT NULL,
    status  TEXT NOT NULL,
    phase   TEXT NOT NULL,
    gpus    INTEGER NOT NULL,
    created TEXT NOT NULL,
    updated TEXT NOT NULL,
    PRIMARY KEY (tenant, name)
)
"""


def _now() -> datetime:
    return datetime.now(UTC)


class SqlJobStore:
    """Jobs in one SQLite file (WAL), safe to share between the API threads and the executor."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        self._db.execute("CREATE INDEX IF NOT EXISTS jobs_tenant_phase ON jobs (tenant, phase)")
        self._lock = threading.Lock()

    def _row(self, row: tuple[str, ...]) -> Job:
        tenant, name, spec, status, created, updated = row
        return Job(
            tenant,
            name,
            JobSpec.model_validate_json(spec),
            JobStatus.model_validate_json(status),
            datetime.fromisoformat(created),
            datetime.fromisoformat(updated),
        )

    def create(self, tenant: str, name: str, spec: JobSpec) -> Job:
        now = _now().isoformat()
        status = JobStatus()
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO jobs (tenant, name, spec, status, phase, gpus, created, updated) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        tenant,
                        name,
                        spec.model_dump_json(),
                        status.model_dump_json(),
                        status.phase.value,
                        gpus_of(spec),
                        now,
                        now,
                    ),
                )
            except sqlite3.IntegrityError:
                raise JobExists(name) from None
        return self.get(tenant, name)

    def get(self, tenant: str, name: str) -> Job:
        with self._lock:
            row = self._db.execute(
                "SELECT tenant, name, spec, status, created, updated FROM jobs WHERE tenant = ? AND name = ?",
                (tenant, name),
            ).fetchone()
        if row is None:
            raise JobNotFound(name)
        return self._row(row)

    def query(
        self, tenant: str | None, phase: Phase | None = None, limit: int = 50, offset: int = 0
    ) -> tuple[list[Job], int]:
        where, args = [], []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if phase is not None:
            where.append("phase = ?")
            args.append(phase.value)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        with self._lock:
            total = self._db.execute(f"SELECT COUNT(*) FROM jobs {clause}", args).fetchone()[0]
            rows = self._db.execute(
                f"SELECT tenant, name, spec, status, created, updated FROM jobs {clause} "
                "ORDER BY created, name LIMIT ? OFFSET ?",
                [*args, limit, offset],
            ).fetchall()
        return [self._row(r) for r in rows], int(total)

    def update(self, tenant: str, name: str, change: Callable[[JobStatus], JobStatus]) -> Job:
        """Apply ``change`` to the stored status atomically (it may raise IllegalTransition)."""
        with self._lock:
            row = self._db.execute(
                "SELECT status FROM jobs WHERE tenant = ? AND name = ?", (tenant, name)
            ).fetchone()
            if row is None:
                raise JobNotFound(name)
            new = change(JobStatus.model_validate_json(row[0]))
            self._db.execute(
                "UPDATE jobs SET status = ?, phase = ?, updated = ? WHERE tenant = ? AND name = ?",
                (new.model_dump_json(), new.phase.value, _now().isoformat(), tenant, name),
            )
        return self.get(tenant, name)

    def delete(self, tenant: str, name: str) -> None:
        with self._lock:
            cur = self._db.execute("DELETE FROM jobs WHERE tenant = ? AND name = ?", (tenant, name))
        if cur.rowcount == 0:
            raise JobNotFound(name)

    def usage(self, tenant: str) -> tuple[int, int]:
        """(active jobs, GPUs they request) of a tenant, for its limits."""
        phases = [p.value for p in ACTIVE]
        with self._lock:
            count, gpus = self._db.execute(
                f"SELECT COUNT(*), COALESCE(SUM(gpus), 0) FROM jobs WHERE tenant = ? AND phase IN "
                f"({', '.join('?' * len(phases))})",
                [tenant, *phases],
            ).fetchone()
        return int(count), int(gpus)

    def ping(self) -> None:
        with self._lock:
            self._db.execute("SELECT 1 FROM jobs LIMIT 1").fetchall()

    def close(self) -> None:
        self._db.close()
