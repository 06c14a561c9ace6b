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

    def create(self, tenant: str, name: str, spec: JobSpec) -> Job: ...

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
