"""Pure status logic of the operator: what phase a RayJob's status means for its RLJob, how to get
there through the state machine, and what the driver's Prometheus exposition says: its progress,
and the conditions it reports (``FaultsRecovered``, ``MismatchSLO``)."""

from __future__ import annotations

import re
from collections import deque
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from operators.actions import Event
from rljob.mismatch_slo import MismatchSloSpec, condition_of
from rljob.precision_actions import condition_of as precision_condition_of
from rljob.prometheus import ACTOR_RESTARTS, PROMETHEUS, RESTART_ROLES, RUN_COMPLETE
from rljob.status import (
    ALLOWED,
    FAULTS_RECOVERED,
    MISMATCH_SLO,
    PRECISION_ACTIONS,
    TERMINAL,
    JobStatus,
    Phase,
    Progress,
    Reason,
)

Target = tuple[Phase, str, str]  # phase, reason, message


def target_of(rayjob: dict[str, Any], suspend: bool) -> Target:
    """The RLJob phase a RayJob's ``status`` (``jobDeploymentStatus`` + ``jobStatus``) stands for."""
    st = rayjob.get("status") or {}
    deployment = st.get("jobDeploymentStatus") or ""
    job = st.get("jobStatus") or ""
    reason, message = st.get("reason") or "", st.get("message") or ""
    if suspend:
        return (
            Phase.SUSPENDED,
            Reason.SUSPENDED,
            f"RayJob {deployment or 'suspending'}; resume continues from the checkpoint",
        )
    held = bool((rayjob.get("spec") or {}).get("suspend"))
    if deployment in ("Suspending", "Suspended") or (held and deployment in ("", "New", "Initializing")):
        # created suspended for a queue (Kueue admits a job by unsuspending it), or resuming
        return Phase.PENDING, Reason.RAYJOB_SUSPENDED, "the RayJob is still suspended (resuming, or queued)"
    if deployment in ("", "Initializing", "Waiting"):
        return Phase.STARTING, Reason.RAY_CLUSTER_STARTING, message or "waiting for the Ray cluster"
    if deployment == "Retrying":
        return Phase.STARTING, Reason.RETRYING, message or "KubeRay is retrying the job"
    if deployment == "Running":
        if job == "RUNNING":
            return Phase.RUNNING, Reason.TRAINING, message or "the driver is running"
        return Phase.STARTING, Reason.DRIVER_STARTING, message or f"driver {job or 'not submitted yet'}"
    if deployment == "Complete" and job == "SUCCEEDED":
        return Phase.SUCCEEDED, Reason.COMPLETED, message or "the driver finished"
    if deployment == "Complete":
        return Phase.FAILED, f"Driver{job.capitalize() or 'Failed'}", message or f"driver {job}"
    if deployment in ("Failed", "ValidationFailed"):
        return Phase.FAILED, reason or f"RayJob{deployment}", message or f"RayJob {deployment}"
    return Phase.STARTING, Reason.UNKNOWN, f"unknown RayJob jobDeploymentStatus {deployment!r}"


# phases the operator may pass through on its way (never Suspended, Failed or a final phase:
# those only as the target, since each means something to the user)
_VIA = frozenset({Phase.PENDING, Phase.STARTING, Phase.RUNNING})


def path(current: Phase, target: Phase) -> list[Phase] | None:
    """The shortest list of moves from ``current`` to ``target`` the state machine allows."""
    if current is target:
        return []
    seen, queue = {current}, deque([(current, list[Phase]())])
    while queue:
        phase, moves = queue.popleft()
        for nxt in sorted(ALLOWED[phase], key=lambda p: p.value):
            if nxt in seen:
                continue
            if nxt is target:
                return [*moves, nxt]
            if nxt in _VIA:
                seen.add(nxt)
                queue.append((nxt, [*moves, nxt]))
    return None


def advance(status: JobStatus, target: Target) -> tuple[JobStatus, list[Phase]]:
    """``status`` moved to ``target`` through allowed phases (recording each as a condition), and
    the phases passed. A finished job, or one the machine cannot take there, is left as it is."""
    phase, reason, message = target
    if status.phase in TERMINAL:
        return status, []
    moves = path(status.phase, phase)
    if moves is None:
        return status, []
    for step in moves:
        status = status.moved(step, reason, message)
    if not moves and (status.reason, status.message) != (reason, message) and phase is not Phase.SUSPENDED:
        status = status.model_copy(update={"reason": reason, "message": message})
    return status, moves


def gauges_of(exposition: str) -> dict[str, float]:
    """The driver's ``/metrics`` text as a ``metrics.jsonl`` line: each ``fp8rl_*`` gauge read
    back as its JSONL key (``rljob.prometheus.PROMETHEUS``)."""
    keys = {m.name: m.key for m in PROMETHEUS if m.kind == "gauge"}
    row: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in keys:
                row.setdefault(keys[sample.name], sample.value)
    return row


def progress_of(exposition: str, total_steps: int) -> Progress | None:
    """Progress from the driver's ``/metrics`` text (None before its first step)."""
    row = gauges_of(exposition)
    return Progress.from_row(row, total_steps) if "step" in row else None


def restarts_of(exposition: str) -> dict[str, float]:
    """The driver's actor restarts after faults, by role, from its ``/metrics`` text
    (``fp8rl_actor_restarts_total{role}``; roles it does not export are absent)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == ACTOR_RESTARTS.name and sample.labels.get("role") in RESTART_ROLES:
                out.setdefault(sample.labels["role"], sample.value)
    return out


def run_complete(exposition: str) -> bool:
    """Whether the driver says it has done every step (``fp8rl_run_complete`` 1)."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == RUN_COMPLETE and sample.value == 1:
                return True
    return False


def with_faults(status: JobStatus, restarts: dict[str, float]) -> tuple[JobStatus, list[Event]]:
    """``status`` with condition ``FaultsRecovered`` once the driver replaced an actor (its
    ``fp8rl_actor_restarts_total``), and a Warning event when the count grew. The counters are the
    running driver's: a driver started again by the RayJob counts from 0, and the condition keeps
    the higher count it saw until then."""
    generator, trainer = int(restarts.get("generator", 0)), int(restarts.get("trainer", 0))
    if generator + trainer == 0:
        return status, []
    message = (
        f"the driver replaced {generator} generator and {trainer} trainer actor(s) after faults "
        "(process died, engine failed, call hung); its log has a line per fault"
    )
    old = next((c for c in status.conditions if c.type == FAULTS_RECOVERED), None)
    if old is not None and old.message == message:
        return status, []
    if old is not None and _counts(old.message) >= generator + trainer:
        return status, []  # an older count (a driver started again): keep the higher one
    reason = Reason.TRAINER_RESTARTED if trainer else Reason.GENERATOR_RESTARTED
    new = status.with_condition(FAULTS_RECOVERED, True, reason, message)
    return new, [Event("Warning", reason, message)]


def with_slo(
    status: JobStatus, gauges: dict[str, float], slo: MismatchSloSpec
) -> tuple[JobStatus, list[Event]]:
    """``status`` with condition ``MismatchSLO`` from the driver's ``fp8rl_mismatch_slo_*`` gauges,
    and a Warning event when the job moves from within the SLO to breached."""
    found = condition_of(gauges, slo)
    if found is None:
        return status, []
    met, reason, message = found
    old = next((c for c in status.conditions if c.type == MISMATCH_SLO), None)
    new = status.with_condition(MISMATCH_SLO, met, reason, message)
    breached_now = not met and (old is None or old.status)
    return new, [Event("Warning", reason, message)] if breached_now else []


def with_precision(
    status: JobStatus, gauges: dict[str, float], slo: MismatchSloSpec
) -> tuple[JobStatus, list[Event]]:
    """``status`` with condition ``PrecisionActions`` from the driver's ``fp8rl_precision_actions``
    gauge (``action: respond``), and a Warning event each time the count of actions changes."""
    found = precision_condition_of(gauges, slo)
    if found is None:
        return status, []
    on, reason, message = found
    old = next((c for c in status.conditions if c.type == PRECISION_ACTIONS), None)
    new = status.with_condition(PRECISION_ACTIONS, on, reason, message)
    changed = (old.message != message) if old is not None else on
    return new, [Event("Warning" if on else "Normal", reason, message)] if changed else []


def _counts(message: str) -> int:
    """The restarts a ``FaultsRecovered`` message of :func:`with_faults` states."""
    found = re.match(r"the driver replaced (\d+) generator and (\d+) trainer", message)
    return int(found.group(1)) + int(found.group(2)) if found else 0
