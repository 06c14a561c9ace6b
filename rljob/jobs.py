"""The job record every tier shares: ``Job``, the ``JobStore`` protocol the service's routes and
executors program against, and the errors a store raises. Two stores implement it:
``service.store.SqlJobStore`` (SQLite, the embedded default) and ``rljob.kube.KubernetesJobStore``
(RLJob custom resources, which the operator reads and writes too)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from rljob.spec import JobSpec
from rljob.status import JobStatus, Phase


class JobExists(Exception):
    pass


class JobNotFound(Exception):
    pass


class InvalidRecord(Exception):
    """A stored job whose spec or status the models reject (an RLJob written with kubectl past the
    CRD; a SQL row an earlier version wrote). ``problem``: what is wrong, without the advice."""

    problem: str = ""


class TenantNamespaceMissing(Exception):
    """``--store kubernetes``: the tenant's namespace does not exist on the cluster."""


class OverLimit(Exception):
    """Recording the job would take its tenant over its job or GPU limit (the message says which
    and what to do)."""


@dataclass(frozen=True)
class Limits:
    """A tenant's caps on active jobs and on the GPUs they request together, and on the jobs it
    keeps stored in every phase and their size (spec and status as JSON, bytes); None: no cap."""

    jobs: int
    gpus: int
    stored_jobs: int | None = None
    stored_bytes: int | None = None


@dataclass
class Job:
    tenant: str
    name: str
    spec: JobSpec
    status: JobStatus
    created: datetime
    updated: datetime


class JobStore(Protocol):
    """What the routes and executors need from a store. ``tenant=None`` in ``query`` means all."""

    def create(self, tenant: str, name: str, spec: JobSpec, limits: Limits | None = None) -> Job:
        """Record a new job; with ``limits``, only if the tenant's active jobs stay within them
        (else ``OverLimit``), checked in the same transaction as the insert where the store
        has one."""
        ...

    def get(self, tenant: str, name: str) -> Job: ...

    def query(
        self, tenant: str | None, phase: Phase | None = None, limit: int = 50, offset: int = 0
    ) -> tuple[list[Job], int]: ...

    def update(
        self,
        tenant: str,
        name: str,
        change: Callable[[JobStatus], JobStatus],
        limits: Limits | None = None,
    ) -> Job:
        """Apply ``change`` to the job's status; with ``limits``, refuse (``OverLimit``) a change
        that makes the job active where the tenant's other active jobs leave no room."""
        ...

    def delete(self, tenant: str, name: str) -> None: ...

    def usage(self, tenant: str) -> tuple[int, int]: ...

    def count_by_phase(self) -> dict[tuple[str, str], int]:
        """(tenant, phase) -> jobs, over every tenant, without reading the jobs themselves: the
        metrics port asks at every scrape."""
        ...

    def ping(self) -> None: ...

    def close(self) -> None: ...


def gpus_of(spec: JobSpec) -> int:
    """GPUs a job requests: generators and trainers times their GPUs each."""
    r = spec.resources
    return r.generators * r.gpus_per_generator + r.trainers * r.gpus_per_trainer


def check_storage(tenant: str, stored: int, size: int, adding: int, limits: Limits) -> None:
    """Raise ``OverLimit`` if a tenant that keeps ``stored`` jobs of ``size`` bytes in all may not
    store one more of ``adding`` bytes."""
    if limits.stored_jobs is not None and stored >= limits.stored_jobs:
        raise OverLimit(
            f"tenant {tenant!r} keeps {stored} jobs (limit {limits.stored_jobs}, max_stored_jobs, every "
            "phase counted); delete finished or cancelled jobs first"
        )
    if limits.stored_bytes is not None and size + adding > limits.stored_bytes:
        raise OverLimit(
            f"tenant {tenant!r}'s stored jobs take {size} bytes and this one {adding} (limit "
            f"{limits.stored_bytes}, max_stored_bytes); delete finished or cancelled jobs first"
        )


def check_limits(tenant: str, spec: JobSpec, active: int, used: int, limits: Limits) -> None:
    """Raise ``OverLimit`` if a tenant with ``active`` jobs using ``used`` GPUs may not add ``spec``."""
    if active >= limits.jobs:
        raise OverLimit(
            f"tenant {tenant!r} already has {active} active jobs "
            f"(limit {limits.jobs}); wait for one to finish, or cancel or suspend one"
        )
    wanted = gpus_of(spec)
    if used + wanted > limits.gpus:
        raise OverLimit(
            f"job asks for {wanted} GPUs and tenant {tenant!r} uses {used} of {limits.gpus}; "
            "lower resources.gpus_per_* or wait for a job to finish"
        )
