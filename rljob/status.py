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

from pydantic import BaseModel, ConfigDict, Field


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

ACTIVE = frozenset({Phase.PENDING, Phase.STARTING, Phase.RUNNING})

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
            step=int(row["step"]),
            total_steps=total_steps,
            reward=row.get("reward/mean"),
            generation_tokens_per_s=row.get("throughput/generation_tokens_per_s"),
            token_mult_prob_error=row.get("mismatch/token_mult_prob_error"),
            updated=datetime.now(UTC),
        )


class JobStatus(BaseModel):
    """Phase, why it is in that phase, conditions and progress."""

    model_config = ConfigDict(extra="forbid")

    phase: Phase = Phase.PENDING
    reason: str = "Created"
    message: str = ""
    conditions: list[Condition] = Field(default_factory=list)
    progress: Progress = Field(default_factory=Progress)

    def moved(self, target: Phase, reason: str, message: str = "", action: str | None = None) -> JobStatus:
        """A copy in phase ``target`` (checked), with the reason recorded as a condition."""
        check_transition(self.phase, target, action)
        conditions = [c for c in self.conditions if c.type != target.value]
        conditions.append(Condition(type=target.value, status=True, reason=reason, message=message))
        return self.model_copy(
            update={"phase": target, "reason": reason, "message": message, "conditions": conditions}
        )
