"""Job stores behind one protocol, ``JobStore``. ``SqlJobStore`` keeps jobs in SQLite (the embedded
default): one row per (tenant, name), the spec and status as JSON. ``rljob.kube.KubernetesJobStore``
keeps each job as an RLJob custom resource instead.

Writes go through one writer thread, one at a time (so a status change's read-check-write is
atomic, and a name is recorded once however many ask for it at once), and it commits them in
groups: every write that arrives while a commit is on disk joins the next one, so fifty concurrent
POSTs pay for a few fsyncs, not fifty in a row. A write returns only once the commit holding it
has returned, and the database runs ``synchronous=FULL``: the WAL is fsynced at every commit, so a
job acknowledged with 201 survives a SIGKILL of the service and a power loss alike. Reads use
connections of their own (WAL readers never wait for the writer, nor it for them), so a GET is not
held up by a commit on disk.

A row the models cannot read (a spec or status written by an older version, or by hand) never
stops the service: the first read that meets it marks it (its ``invalid`` column says what is
wrong, and the executor and the limits stop counting it), listings and the executor skip it, a GET
answers 409 with the problem, and DELETE removes it. Every other job is served as before.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from rljob.jobs import (
    InvalidRecord,
    Job,
    JobExists,
    JobNotFound,
    Limits,
    check_limits,
    check_storage,
    gpus_of,
)
from rljob.spec import JobSpec, describe_errors
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
    invalid TEXT,
    bytes   INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, name)
)
"""
_COLUMNS = "tenant, name, spec, status, created, updated"
_READABLE = "invalid IS NULL"  # rows the models read; the others are marked with what is wrong
log = logging.getLogger(__name__)
GROUP_MAX = 256  # writes committed together at most
T = TypeVar("T")
Write = Callable[[sqlite3.Connection], Any]  # runs in the writer thread, inside its transaction
Writes = queue.SimpleQueue[tuple[Write, Future[Any]] | None]  # None: stop


def _now() -> datetime:
    return datetime.now(UTC)


def _unreadable(name: str, problem: str) -> InvalidRecord:
    err = InvalidRecord(
        f"job {name!r} is stored in a form this version cannot read ({problem[:500]}); nothing runs "
        f"it: delete it (DELETE /v1/jobs/{name}) and submit it again"
    )
    err.problem = problem
    return err


def _problem(err: Exception) -> str:
    if isinstance(err, ValidationError):
        return "; ".join(describe_errors(err))
    return f"{type(err).__name__}: {err}"


def _row(row: tuple[str, ...]) -> Job:
    """The job of a row; ``InvalidRecord`` if the models refuse its spec or status."""
    tenant, name, spec, status, created, updated = row
    try:
        return Job(
            tenant,
            name,
            JobSpec.model_validate_json(spec),
            JobStatus.model_validate_json(status),
            datetime.fromisoformat(created),
            datetime.fromisoformat(updated),
        )
    except (ValidationError, ValueError, TypeError) as err:
        raise _unreadable(name, _problem(err)) from None


_ACTIVE_PHASES = sorted(p.value for p in ACTIVE)
_USAGE = (
    "SELECT COUNT(*), COALESCE(SUM(gpus), 0) FROM jobs WHERE tenant = ? AND phase IN "
    f"({', '.join('?' * len(_ACTIVE_PHASES))}) AND {_READABLE}"
)


def _stored(db: sqlite3.Connection, tenant: str) -> tuple[int, int]:
    """(jobs, bytes of their spec and status) ``tenant`` keeps, in every phase."""
    count, size = db.execute(
        "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM jobs WHERE tenant = ?", (tenant,)
    ).fetchone()
    return int(count), int(size)


def _usage(db: sqlite3.Connection, tenant: str) -> tuple[int, int]:
    """(active jobs, GPUs they request) of ``tenant``, counted from the ``jobs_usage`` index."""
    count, gpus = db.execute(_USAGE, [tenant, *_ACTIVE_PHASES]).fetchone()
    return int(count), int(gpus)


def _write_loop(db: sqlite3.Connection, writes: Writes) -> None:
    """The writer thread: take every write waiting (up to GROUP_MAX), commit them together."""
    while True:
        first = writes.get()
        if first is None:
            return
        group = [first]
        while len(group) < GROUP_MAX:
            try:
                nxt = writes.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                writes.put(None)  # stop after this group
                break
            group.append(nxt)
        _commit(db, group)


def _commit(db: sqlite3.Connection, group: list[tuple[Write, Future[Any]]]) -> None:
    outcomes: list[tuple[Future[Any], Any, BaseException | None]] = []
    try:
        db.execute("BEGIN IMMEDIATE")
        for write, done in group:
            try:
                outcomes.append((done, write(db), None))
            except sqlite3.Error:
                raise  # the database failed, not this write: the group is rolled back below
            except Exception as err:  # this write refused, before changing anything
                outcomes.append((done, None, err))
        db.execute("COMMIT")
    except BaseException as err:
        if db.in_transaction:
            db.execute("ROLLBACK")
        for _, done in group:
            done.set_exception(err)
        return
    for done, result, error in outcomes:  # only now: every write answered is on disk
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)


class SqlJobStore:
    """Jobs in one SQLite file (WAL), safe to share between the API threads and the executor.

    Each write is a function of the writer's connection that either raises before it changes
    anything (a name taken, an illegal transition: that write alone fails) or makes all its
    changes; a database error rolls the whole group back and fails every write in it.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._db = self._connect()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        if "invalid" not in columns:  # a database of an earlier version
            self._db.execute("ALTER TABLE jobs ADD COLUMN invalid TEXT")
        if "bytes" not in columns:
            self._db.execute("ALTER TABLE jobs ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0")
            self._db.execute("UPDATE jobs SET bytes = length(spec) + length(status)")
        # what a tenant keeps (every phase), counted from this index alone at each POST
        self._db.execute("CREATE INDEX IF NOT EXISTS jobs_stored ON jobs (tenant, bytes)")
        # usage() counts a tenant's active jobs and sums their GPUs from this index alone: without
        # gpus in it, every POST read each active row, spec JSON and all (overflow pages)
        self._db.execute("DROP INDEX IF EXISTS jobs_tenant_phase")
        self._db.execute("CREATE INDEX IF NOT EXISTS jobs_usage ON jobs (tenant, phase, gpus)")
        self._readers: list[sqlite3.Connection] = []  # idle read connections
        self._opened: list[sqlite3.Connection] = []  # every read connection, to close them
        self._opened_lock = threading.Lock()
        self._writes: Writes = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=_write_loop, args=(self._db, self._writes), name="sqlite-writer", daemon=True
        )
        self._writer.start()
        weakref.finalize(self, self._writes.put, None)  # a store dropped unclosed stops its writer

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA synchronous=FULL")  # an fsync per commit: acknowledged means on disk
        db.execute("PRAGMA busy_timeout=10000")
        return db

    def _write(self, write: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``write`` in the writer's next group commit; return its result once committed."""
        if not self._writer.is_alive():
            raise RuntimeError("the job store is closed")
        done: Future[T] = Future()
        self._writes.put((write, done))
        return done.result()

    # -- reads --------------------------------------------------------------------------------

    @contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        """A read connection of this call's own (at most one per concurrent reader is opened)."""
        try:
            db = self._readers.pop()
        except IndexError:
            db = self._connect()
            with self._opened_lock:
                self._opened.append(db)
        try:
            yield db
        finally:
            self._readers.append(db)

    # -- JobStore -----------------------------------------------------------------------------

    def create(self, tenant: str, name: str, spec: JobSpec, limits: Limits | None = None) -> Job:
        now = _now()
        status = JobStatus()
        spec_json, status_json = spec.model_dump_json(), status.model_dump_json()
        size = len(spec_json) + len(status_json)
        row = (
            tenant,
            name,
            spec_json,
            status_json,
            status.phase.value,
            gpus_of(spec),
            now.isoformat(),
            now.isoformat(),
            size,
        )

        def insert(db: sqlite3.Connection) -> bool:
            if limits is not None:  # in the writer's transaction: no other write comes between
                exists = db.execute("SELECT 1 FROM jobs WHERE tenant = ? AND name = ?", (tenant, name))
                if exists.fetchone() is not None:
                    return False
                check_storage(tenant, *_stored(db, tenant), size, limits)
                check_limits(tenant, spec, *_usage(db, tenant), limits)
            cur = db.execute(
                "INSERT OR IGNORE INTO jobs "
                "(tenant, name, spec, status, phase, gpus, created, updated, bytes) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                row,
            )
            return cur.rowcount == 1  # 0: the (tenant, name) key is taken

        if not self._write(insert):
            raise JobExists(name)
        return Job(tenant, name, spec, status, now, now)  # what was written, without reading it back

    def get(self, tenant: str, name: str) -> Job:
        with self._reader() as db:
            row = db.execute(
                f"SELECT {_COLUMNS}, invalid FROM jobs WHERE tenant = ? AND name = ?", (tenant, name)
            ).fetchone()
        if row is None:
            raise JobNotFound(name)
        if row[-1] is not None:
            raise _unreadable(name, row[-1])
        return self._read_or_mark(row[:-1])

    def _read_or_mark(self, row: tuple[str, ...]) -> Job:
        """The job of ``row``; a row the models refuse is marked (once) before ``InvalidRecord``."""
        try:
            return _row(row)
        except InvalidRecord as err:
            self._mark(row[0], row[1], err.problem)
            raise

    def _mark(self, tenant: str, name: str, problem: str) -> None:
        log.warning(
            "job %r of tenant %r cannot be read (%s): marked, and skipped from now on", name, tenant, problem
        )

        def mark(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE jobs SET invalid = ? WHERE tenant = ? AND name = ? AND invalid IS NULL",
                (problem[:1000], tenant, name),
            )

        self._write(mark)

    def query(
        self, tenant: str | None, phase: Phase | None = None, limit: int = 50, offset: int = 0
    ) -> tuple[list[Job], int]:
        for _ in range(2):  # a row met unreadable is marked, and the page read again without it
            jobs, total, unread = self._query_once(tenant, phase, limit, offset)
            if not unread:
                return jobs, total
        return jobs, total

    def _query_once(
        self, tenant: str | None, phase: Phase | None, limit: int, offset: int
    ) -> tuple[list[Job], int, int]:
        where, args = [_READABLE], []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if phase is not None:
            where.append("phase = ?")
            args.append(phase.value)
        clause = f"WHERE {' AND '.join(where)}"
        with self._reader() as db:
            db.execute("BEGIN")  # one snapshot: the count and the page agree
            try:
                total = db.execute(f"SELECT COUNT(*) FROM jobs {clause}", args).fetchone()[0]
                rows = db.execute(
                    f"SELECT {_COLUMNS} FROM jobs {clause} ORDER BY created, name LIMIT ? OFFSET ?",
                    [*args, limit, offset],
                ).fetchall()
            finally:
                db.execute("COMMIT")
        jobs, unread = [], 0
        for r in rows:
            try:
                jobs.append(self._read_or_mark(r))
            except InvalidRecord:
                unread += 1
        return jobs, int(total), unread

    def update(
        self,
        tenant: str,
        name: str,
        change: Callable[[JobStatus], JobStatus],
        limits: Limits | None = None,
    ) -> Job:
        """Apply ``change`` to the stored status atomically (it may raise IllegalTransition). With
        ``limits``, a change that makes the job active (a resume) is refused with ``OverLimit``
        where the tenant's other active jobs leave no room, in the same transaction."""

        def read_change_write(db: sqlite3.Connection) -> tuple[str, ...]:
            row = db.execute(
                f"SELECT {_COLUMNS}, invalid FROM jobs WHERE tenant = ? AND name = ?", (tenant, name)
            ).fetchone()
            if row is None:
                raise JobNotFound(name)
            if row[-1] is not None:
                raise _unreadable(name, row[-1])
            try:
                old = JobStatus.model_validate_json(row[3])
            except ValidationError as err:
                raise _unreadable(name, _problem(err)) from None
            new = change(old)
            if limits is not None and old.phase not in ACTIVE and new.phase in ACTIVE:
                check_limits(tenant, JobSpec.model_validate_json(row[2]), *_usage(db, tenant), limits)
            status, updated = new.model_dump_json(), _now().isoformat()
            db.execute(
                "UPDATE jobs SET status = ?, phase = ?, updated = ?, bytes = ? WHERE tenant = ? AND name = ?",
                (status, new.phase.value, updated, len(row[2]) + len(status), tenant, name),
            )
            return (*row[:3], status, row[4], updated)

        return self._read_or_mark(self._write(read_change_write))

    def delete(self, tenant: str, name: str) -> None:
        def delete(db: sqlite3.Connection) -> int:
            return db.execute("DELETE FROM jobs WHERE tenant = ? AND name = ?", (tenant, name)).rowcount

        if self._write(delete) == 0:
            raise JobNotFound(name)

    def count_by_phase(self) -> dict[tuple[str, str], int]:
        """One GROUP BY over the (tenant, phase, gpus) index: no row is read or parsed."""
        with self._reader() as db:
            rows = db.execute(
                f"SELECT tenant, phase, COUNT(*) FROM jobs WHERE {_READABLE} GROUP BY tenant, phase"
            ).fetchall()
        return {(tenant, phase): int(n) for tenant, phase, n in rows}

    def usage(self, tenant: str) -> tuple[int, int]:
        """(active jobs, GPUs they request) of a tenant, for its limits (from the index alone)."""
        with self._reader() as db:
            return _usage(db, tenant)

    def ping(self) -> None:
        with self._reader() as db:
            db.execute("SELECT 1 FROM jobs LIMIT 1").fetchall()

    def close(self) -> None:
        """Finish the writes already queued, then close every connection."""
        if self._writer.is_alive():
            self._writes.put(None)
            self._writer.join()
        self._db.close()
        with self._opened_lock:
            for db in self._opened:
                db.close()
