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
    """A stored job whose spec the models reject (an RLJob written with kubectl past the CRD)."""


class TenantNamespaceMissing(Exception):
    """``--store kubernetes``: the tenant's namespace does not exist on the cluster."""


class OverLimit(Exception):
    """Recording the job would take its tenant over its job or GPU limit (the message says which
    and what to do)."""


@dataclass(frozen=True)
class Limits:
    """A tenant's caps on active jobs and on the GPUs they request together."""

    jobs: int
    gpus: int


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

    def update(self, tenant: str, name: str, change: Callable[[JobStatus], JobStatus]) -> Job: ...

    def delete(self, tenant: str, name: str) -> None: ...

    def usage(self, tenant: str) -> tuple[int, int]: ...

    def ping(self) -> None: ...

    def close(self) -> None: ...


def gpus_of(spec: JobSpec) -> int:
    """GPUs a job requests: generators and trainers times their GPUs each."""
    r = spec.resources
    return r.generators * r.gpus_per_generator + r.trainers * r.gpus_per_trainer


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
