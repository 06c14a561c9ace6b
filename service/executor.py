"""What the routes call after recording a user's action: the ``Executor`` protocol.

Two implementations, picked from the settings by ``service.main`` (which also starts and stops
it with the app): ``service.local_executor.LocalExecutor`` (``--store sql``: a driver process per
job on this machine) and ``service.operator_handoff.OperatorHandoff`` (``--store kubernetes``:
the operator runs the jobs).
"""

from __future__ import annotations

from typing import Protocol

from rljob.jobs import Job


class Executor(Protocol):
    """Runs the jobs the routes record."""

    runs_locally: bool  # its jobs write their logs and metrics under the service's data dir

    def start(self) -> None:
        """Before the app serves: pick up the jobs a previous service process left."""

    def shutdown(self) -> None:
        """After the app stopped serving (drivers keep running)."""

    def submit(self, job: Job) -> None: ...

    def suspend(self, job: Job) -> None: ...

    def resume(self, job: Job) -> None: ...

    def cancel(self, job: Job) -> None: ...
