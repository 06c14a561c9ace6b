"""The executor of ``--store kubernetes``: the operator runs the jobs."""

from __future__ import annotations

from rljob.jobs import Job
from rljob.kube import KubernetesJobStore


class OperatorHandoff:
    """Submitting is the create itself; suspend and resume flip ``spec.suspend``; cancel is the
    delete (the operator's finalizer removes the RayJob)."""

    runs_locally = False

    def __init__(self, store: KubernetesJobStore) -> None:
        self.store = store

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def submit(self, job: Job) -> None:
        pass

    def suspend(self, job: Job) -> None:
        self.store.set_suspend(job.tenant, job.name, True)

    def resume(self, job: Job) -> None:
        self.store.set_suspend(job.tenant, job.name, False)

    def cancel(self, job: Job) -> None:
        pass
