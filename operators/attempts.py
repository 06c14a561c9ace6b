"""The job's attempts, as the operator sees them begin and end (``status.attempts``, kuberay#5211).

An attempt is one run of the driver. What tells one from the next, in the operator's reads:

- the RayJob's uid: each RayJob the operator makes is a new Ray cluster (the job's first, one made
  again after someone deleted it, one rebuilt from a changed spec, one after a resume or a retry);
- KubeRay's count of the RayJob's failed runs (``status.failed``): KubeRay retrying on a new cluster
  (``backoffLimit``) raises it while the RayJob goes on;
- the driver's own attempt on its cluster (``fp8rl_driver_attempt``): an in-place retry
  (``workers.job.supervisor``) on the same cluster.

When one of them moves, the attempt that ran ends (Failed, with what is known of why) and the next
begins. When the job ends (Succeeded, Failed) or stops (Suspended), the running attempt ends with
it. Only the newest ``MAX_ATTEMPTS`` are kept; numbers go on counting. Pure: the plan calls it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families

from rljob.prometheus import DRIVER_ATTEMPT
from rljob.status import MAX_ATTEMPTS, Attempt, Phase

Cause = Literal["created", "retried", "in-place", "recreated", "resumed"]
CAUSES: tuple[Cause, ...] = ("created", "retried", "in-place", "recreated", "resumed")
CAUSE = "fp8rl.io/attempt-cause"  # the RayJob's annotation: why the operator made it
_ENDS = {Phase.SUCCEEDED: "Succeeded", Phase.FAILED: "Failed", Phase.SUSPENDED: "Stopped"}


def driver_attempt(exposition: str) -> tuple[int, str] | None:
    """(the driver's attempt on its cluster, how the one before exited) from its metrics."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == DRIVER_ATTEMPT:
                return int(sample.value), str(sample.labels.get("previous_exit", ""))
    return None


def _ended(attempt: Attempt, outcome: str, reason: str, message: str, now: datetime) -> Attempt:
    if attempt.outcome != "Running":
        return attempt
    update = {"outcome": outcome, "reason": reason, "message": message[:500], "finished": now}
    return attempt.model_copy(update=update)


def track(
    attempts: list[Attempt],
    rayjob: dict[str, Any] | None,
    metrics: str | None,
    phase: Phase,
    reason: str,
    message: str,
    now: datetime,
) -> list[Attempt]:
    """``attempts`` after this read: ``rayjob`` as read (None, or one not yet read back: nothing
    begins), the driver's ``metrics``, and the phase the job is going to (with its reason and
    message). Why a RayJob was made is its ``CAUSE`` annotation."""
    out = list(attempts)
    uid = str(((rayjob or {}).get("metadata") or {}).get("uid") or "")
    status = (rayjob or {}).get("status") or {}
    failed = int(status.get("failed") or 0)
    finished = status.get("jobDeploymentStatus") in ("Complete", "Failed")
    driver = driver_attempt(metrics) if metrics else None

    def begin(cluster: Literal["new", "reused"], why: Cause, kuberay_failed: int, on_driver: int) -> None:
        out.append(
            Attempt(
                number=(out[-1].number + 1) if out else 1,
                cluster=cluster,
                cause=why,
                started=now,
                ray_job_uid=uid,
                kuberay_failed=kuberay_failed,
                driver_attempt=on_driver,
            )
        )

    last = out[-1] if out else None
    if uid and (last is None or last.ray_job_uid != uid):
        if last is not None:
            out[-1] = _ended(last, "Failed", "RayJobReplaced", "its RayJob was replaced", now)
        annotations = ((rayjob or {}).get("metadata") or {}).get("annotations") or {}
        cause = annotations.get(CAUSE, "created")
        begin("new", cause if cause in CAUSES else "created", failed, driver[0] if driver else 1)
    elif uid and last is not None and failed > last.kuberay_failed:
        if finished:  # KubeRay counts the failure that ends the RayJob too: nothing begins after it
            out[-1] = last.model_copy(update={"kuberay_failed": failed})
        else:
            why = str(status.get("reason") or "KubeRayRetried")
            out[-1] = _ended(last, "Failed", why, "KubeRay runs the job again on a new Ray cluster", now)
            begin("new", "retried", failed, 1)
    elif uid and last is not None and last.outcome == "Stopped" and phase not in _ENDS:
        begin("new", "resumed", failed, 1)  # a suspended RayJob resumes on a new Ray cluster
    elif uid and last is not None and driver is not None and driver[0] > last.driver_attempt:
        exit_message = f"the driver exited with {driver[1]}" if driver[1] else "the driver exited"
        out[-1] = _ended(
            last, "Failed", "DriverExited", f"{exit_message}; started again on the same Ray cluster", now
        )
        begin("reused", "in-place", last.kuberay_failed, driver[0])
    if out and phase in _ENDS:
        out[-1] = _ended(out[-1], _ENDS[phase], reason, message, now)
    return out[-MAX_ATTEMPTS:]


def retries_used(attempts: list[Attempt]) -> int:
    """Attempts on a new cluster after a failure (what ``backoffLimit`` bounds)."""
    return sum(1 for a in attempts if a.cause == "retried")
