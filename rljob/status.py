"""Job status: phases as a state machine, conditions with reasons, and the latest progress.

Shared by the control plane (SQL store), the operator (RLJob ``.status``) and the driver (which
reports progress). Every phase change goes through :func:`transition`, which refuses moves the
machine does not allow, so no tier can put a job into an impossible state.

    Pending ──▶ Starting ──▶ Running ──▶ Succeeded
       │  ╲         │  ╲        │  ╲
       │   ╲        │   ╲       │   ╲──▶ Failed ──(resume)──▶ Pending
       │    ╲───────┴────╲──────┴──────▶ Suspended ──(resume)──▶ Pending
       └──────────────────────────────▶ Cancelled    (from any non-terminal phase)
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rljob import metrics as m


class Phase(StrEnum):
    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


TERMINAL = frozenset({Phase.SUCCEEDED, Phase.CANCELLED})
# The driver's exit code when an allocation failed (MemoryError, e.g. over the RLIMIT_AS the
# service sets per tenant): the service reads it as reason OutOfMemory.
EXIT_OUT_OF_MEMORY = 3
# ... and when the job saw more data-plane faults than resources.max_<role>_restarts allows (a crash
# loop: the service and the RayJob do not start the driver again)
EXIT_TOO_MANY_FAULTS = 4

ACTIVE = frozenset({Phase.PENDING, Phase.STARTING, Phase.RUNNING})


class Reason(StrEnum):
    """The fixed reasons a status records (``status.reason``, a condition's ``reason``, an
    event's reason). A few are built from what KubeRay reports (``Driver<JobStatus>``,
    ``RayJob<deploymentStatus>``) and are not listed."""

    CREATED = "Created"
    # the user's actions (REST or kubectl), recorded by the control plane or the operator
    USER_SUSPENDED = "UserSuspended"
    USER_RESUMED = "UserResumed"
    USER_CANCELLED = "UserCancelled"
    # the embedded executor
    PROCESS_STARTED = "ProcessStarted"
    SERVICE_RESTARTED = "ServiceRestarted"
    PATH_OUTSIDE_TENANT = "PathOutsideTenant"
    OUT_OF_MEMORY = "OutOfMemory"
    WORKER_EXITED = "WorkerExited"
    DRIVER_RESTARTED = "DriverRestarted"  # a failed driver started again with --resume (bounded)
    TOO_MANY_FAULTS = "TooManyFaults"  # more actor faults than resources.max_<role>_restarts
    DEADLINE_EXCEEDED = "DeadlineExceeded"  # ran past its wall-clock limit (max_job_seconds)
    # the driver, recovering from a data-plane fault in place (condition FAULTS_RECOVERED)
    GENERATOR_RESTARTED = "GeneratorRestarted"
    TRAINER_RESTARTED = "TrainerRestarted"
    # the operator, reading the RLJob and its RayJob
    INVALID_SPEC = "InvalidSpec"
    NAME_CONFLICT = "NameConflict"  # an object of one of the job's names is someone else's
    SPEC_CHANGE_REFUSED = "SpecChangeRefused"
    SPEC_APPLIED = "SpecApplied"
    APPLIED = "Applied"  # the SpecChangeRefused condition cleared
    JOB_RUNNING = "JobRunning"
    RAYJOB_CREATED = "RayJobCreated"
    RAYJOB_RECREATED = "RayJobRecreated"
    RAYJOB_RESTARTED = "RayJobRestarted"
    RAYJOB_RETRIED = "RayJobRetried"  # a failed job on a new Ray cluster (backoffLimit, rayAuth secret)
    RAYJOB_SUSPENDED = "RayJobSuspended"
    RAY_CLUSTER_STARTING = "RayClusterStarting"
    RETRYING = "Retrying"
    TRAINING = "Training"
    DRIVER_STARTING = "DriverStarting"
    SUSPENDED = "Suspended"
    COMPLETED = "Completed"
    DRIVER_COMPLETED = "DriverCompleted"  # the driver's metrics said every step was done
    # the driver's verdict on the mismatch SLO (condition MISMATCH_SLO)
    MISMATCH_WITHIN_SLO = "MismatchWithinSLO"
    MISMATCH_SLO_BREACHED = "MismatchSLOBreached"
    # the SLO's response (condition PRECISION_ACTIONS, precision.mismatch_slo.action respond)
    PRECISION_AS_SPECIFIED = "PrecisionAsSpecified"
    PRECISION_RAISED = "PrecisionRaised"
    UNKNOWN = "Unknown"

    @classmethod
    def of_action(cls, action: str) -> Reason:
        """The reason a user's ``suspend``, ``resume`` or ``cancel`` records."""
        return {"suspend": cls.USER_SUSPENDED, "resume": cls.USER_RESUMED, "cancel": cls.USER_CANCELLED}[
            action
        ]


ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.PENDING: frozenset({Phase.STARTING, Phase.SUSPENDED, Phase.FAILED, Phase.CANCELLED}),
    Phase.STARTING: frozenset(
        {Phase.RUNNING, Phase.SUSPENDED, Phase.FAILED, Phase.CANCELLED, Phase.SUCCEEDED}
    ),
    # back to Starting when the Ray job restarts (KubeRay retrying, or its RayJob recreated)
    Phase.RUNNING: frozenset(
        {Phase.STARTING, Phase.SUCCEEDED, Phase.SUSPENDED, Phase.FAILED, Phase.CANCELLED}
    ),
    Phase.SUSPENDED: frozenset({Phase.PENDING, Phase.CANCELLED}),
    Phase.FAILED: frozenset({Phase.PENDING, Phase.CANCELLED}),  # resume from the last checkpoint
    Phase.SUCCEEDED: frozenset(),
    Phase.CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    """A phase change the state machine does not allow (the API answers 409 with this message)."""

    def __init__(self, current: Phase, target: Phase, action: str | None = None) -> None:
        self.current, self.target = current, target
        allowed = ", ".join(sorted(p.value for p in ALLOWED[current])) or "none (the job is finished)"
        what = (
            f"cannot {action} a job"
            if action
            else f"cannot move a job from {current.value} to {target.value}"
        )
        super().__init__(f"{what} in phase {current.value}; allowed next phases: {allowed}")


def check_transition(current: Phase, target: Phase, action: str | None = None) -> None:
    if target not in ALLOWED[current]:
        raise IllegalTransition(current, target, action)


# user actions and the phase each leads to
ACTIONS: dict[str, Phase] = {"suspend": Phase.SUSPENDED, "resume": Phase.PENDING, "cancel": Phase.CANCELLED}


class Condition(BaseModel):
    """A Kubernetes-style condition: ``type`` is True/False since ``last_transition``, with a reason."""

    model_config = ConfigDict(extra="forbid")

    type: str
    status: bool
    reason: str
    message: str = ""
    last_transition: datetime = Field(default_factory=lambda: datetime.now(UTC))


# the condition a job gets once its driver recovered from a data-plane fault: True, the reason of the
# last fault's role, and a message with the fault and the job's restarts so far
FAULTS_RECOVERED = "FaultsRecovered"
# the job's mismatch against its precision.mismatch_slo: True within it (MismatchWithinSLO), False
# breached (MismatchSLOBreached), with the numbers (rljob.mismatch_slo.condition_of)
MISMATCH_SLO = "MismatchSLO"
# with precision.mismatch_slo.action respond: True while the SLO's precision actions are in effect
# (PrecisionRaised), False while the job runs as its spec says (rljob.precision_actions.condition_of)
PRECISION_ACTIONS = "PrecisionActions"


# how many attempts a status keeps (the newest): a job retried without end must not grow its record
MAX_ATTEMPTS = 20


class Attempt(BaseModel):
    """One run of the job's driver, as the operator saw it (kuberay#5211): on a Ray cluster made for
    it (``new``: a RayJob of the operator's, or KubeRay rebuilding one after a failure) or on the
    one the previous attempt ran on (``reused``: the driver started again in place,
    ``spec.cluster.inPlaceRetries``). ``outcome`` is Running until it ends."""

    model_config = ConfigDict(extra="forbid")

    number: int = Field(ge=1)
    cluster: Literal["new", "reused"]
    # why it began: the job's first RayJob, a retry after a failure (KubeRay's or the operator's
    # backoffLimit: a new cluster; an in-place retry: the same one), a RayJob made again (deleted by
    # someone, rebuilt from a changed spec) or a resume
    cause: Literal["created", "retried", "in-place", "recreated", "resumed"] = "created"
    outcome: Literal["Running", "Succeeded", "Failed", "Stopped"] = "Running"
    reason: str = ""
    message: str = ""
    started: datetime
    finished: datetime | None = None
    # what identifies the attempt among the operator's reads: the RayJob's uid, KubeRay's count of
    # its failed runs, the driver's own attempt on that cluster
    ray_job_uid: str = ""
    kuberay_failed: int = Field(0, ge=0)
    driver_attempt: int = Field(1, ge=1)


class Progress(BaseModel):
    """The latest step the driver reported."""

    model_config = ConfigDict(extra="forbid")

    step: int = 0
    total_steps: int = 0
    reward: float | None = None
    generation_tokens_per_s: float | None = None
    token_mult_prob_error: float | None = None
    updated: datetime | None = None

    @classmethod
    def from_row(cls, row: dict[str, float], total_steps: int) -> Progress:
        """From a ``metrics.jsonl`` line."""
        return cls(
            step=int(row[m.STEP]),
            total_steps=total_steps,
            reward=row.get(m.REWARD_MEAN),
            generation_tokens_per_s=row.get(m.GENERATION_TOKENS_PER_S),
            token_mult_prob_error=row.get(m.TOKEN_MULT_PROB_ERROR),
            updated=datetime.now(UTC),
        )


class JobStatus(BaseModel):
    """Phase, why it is in that phase, conditions and progress."""

    model_config = ConfigDict(extra="forbid")

    phase: Phase = Phase.PENDING
    reason: str = Reason.CREATED
    message: str = ""
    conditions: list[Condition] = Field(default_factory=list)
    progress: Progress = Field(default_factory=Progress)
    attempts: list[Attempt] = Field(default_factory=list, max_length=MAX_ATTEMPTS)

    def moved(self, target: Phase, reason: str, message: str = "", action: str | None = None) -> JobStatus:
        """A copy in phase ``target`` (checked), with the reason recorded as a condition."""
        check_transition(self.phase, target, action)
        conditions = [c for c in self.conditions if c.type != target.value]
        conditions.append(Condition(type=target.value, status=True, reason=reason, message=message))
        return self.model_copy(
            update={"phase": target, "reason": reason, "message": message, "conditions": conditions}
        )

    def noted(self, kind: str, reason: str, message: str) -> JobStatus:
        """A copy with condition ``kind`` True for ``reason`` (replacing one of that type); the
        phase is unchanged."""
        conditions = [c for c in self.conditions if c.type != kind]
        conditions.append(Condition(type=kind, status=True, reason=reason, message=message))
        return self.model_copy(update={"conditions": conditions})

    def with_condition(self, kind: str, on: bool, reason: str, message: str) -> JobStatus:
        """A copy with condition ``kind`` set to ``on``; itself when that condition already says
        so (its transition time kept), and the time kept too while ``on`` does not change."""
        old = next((c for c in self.conditions if c.type == kind), None)
        if old is not None and (old.status, old.reason, old.message) == (on, reason, message):
            return self
        new = Condition(type=kind, status=on, reason=reason, message=message)
        if old is not None and old.status == on:
            new = new.model_copy(update={"last_transition": old.last_transition})
        rest = [c for c in self.conditions if c.type != kind]
        return self.model_copy(update={"conditions": [*rest, new]})
