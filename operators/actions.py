"""The actions the operator's plan returns (``operators.plan``) and the reconciler executes
(``operators.reconcile``), in order; and ``Observed``, the objects of an RLJob's names as read.
Plain data: each action says what to do, never how."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rljob import resource as rl
from rljob.status import JobStatus


@dataclass(frozen=True)
class Event:
    """A core/v1 Event on the RLJob (``kubectl describe rljob``)."""

    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class CreateConfigMap:
    """Create the job-spec ConfigMap (one that exists already is left as it is)."""

    body: dict[str, Any]


@dataclass(frozen=True)
class ReplaceConfigMap:
    """Replace the data of the existing job-spec ConfigMap."""

    body: dict[str, Any]


@dataclass(frozen=True)
class CreateNetworkPolicy:
    """Create the job's NetworkPolicy."""

    body: dict[str, Any]


@dataclass(frozen=True)
class ReplaceNetworkPolicySpec:
    """Replace the spec of the job's own NetworkPolicy (the settings changed since it was made)."""

    body: dict[str, Any]


@dataclass(frozen=True)
class CreateRayTokenSecret:
    """Create the job's Ray token Secret with a new random token (one that exists is kept). The
    token is drawn when the action runs, so that the plan stays a function of what was read."""

    job: rl.RLJob


@dataclass(frozen=True)
class CreateRayJob:
    """Create the RayJob; ``event`` is posted only if this call created it (not on 409: another
    operator run was first)."""

    body: dict[str, Any]
    event: Event


@dataclass(frozen=True)
class DeleteRayJob:
    """Delete the RLJob's RayJob (same name and namespace) if it is still the object of ``uid``
    (a precondition: never one made since it was read); one already gone is fine."""

    uid: str


@dataclass(frozen=True)
class PatchRayJobSuspend:
    """Set the RayJob's ``spec.suspend``."""

    suspend: bool


@dataclass(frozen=True)
class WriteStatus:
    """Write the RLJob's whole status, at the ``resourceVersion`` that was read."""

    status: JobStatus


Action = (
    CreateNetworkPolicy
    | ReplaceNetworkPolicySpec
    | CreateRayTokenSecret
    | CreateConfigMap
    | ReplaceConfigMap
    | CreateRayJob
    | DeleteRayJob
    | PatchRayJobSuspend
    | WriteStatus
    | Event
)


@dataclass(frozen=True)
class Observed:
    """The objects of the RLJob's names as read (None: absent or not read), whoever they belong to."""

    rayjob: dict[str, Any] | None = None
    configmap: dict[str, Any] | None = None
    networkpolicy: dict[str, Any] | None = None
