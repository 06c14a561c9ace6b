"""The operator's decisions for one RLJob, as a pure function: what it read in, actions out.

``plan(rljob, Observed(rayjob, configmap, networkpolicy), settings, metrics, now)`` looks at the
RLJob, the objects of its names as read from the API server (None where absent) and the driver's
Prometheus text, and returns the actions (``operators.actions``) that bring the cluster to what
the RLJob asks, in the order they must run.
``operators.reconcile`` reads, plans and executes; nothing here talks to the API server, so every
branch is tested with plain dicts (``tests/operators/test_plan.py``).

The decisions, in order:

1. A deleted (finalizing) or finished (Succeeded, Cancelled) RLJob: nothing.
2. A spec that does not validate, or that no default node can host, or naming files outside the
   pods' /data, or writing where its pods cannot, or an image outside the allow-list: Failed with
   reason InvalidSpec and the fields (one Warning event).
2b. An object of one of the job's names that is not its own (``operators.ownership``): Failed with
   reason and condition ``NameConflict`` naming it (one Warning event); nothing is written to it,
   ever. One left by an earlier RLJob of the same name: wait for the garbage collector.
3. No RayJob: create it; ``RayJobRecreated`` when the job was Starting or Running (someone
   deleted it), else ``RayJobCreated``. Whenever a RayJob is (re)built, the job's other objects
   come first, so that no pod of it runs unprotected: its NetworkPolicy (created, or its spec
   replaced), its Ray token Secret (``ray_auth: secret``; one that exists is kept: a running
   cluster holds its token) and its ConfigMap.
4. A RayJob built from another spec (``spec.job``/``spec.cluster`` changed): while the job is
   Starting or Running the change is refused (condition ``SpecChangeRefused``, one Warning event);
   otherwise the RayJob is rebuilt from the new spec.
5. A job the user resumed (Pending, ``UserResumed``) whose RayJob finished: the RayJob is deleted
   and, once KubeRay's finalizer let it go, a new one made (``RayJobRestarted``); a finished RayJob
   does not run again. While a RayJob of the job is being deleted, nothing else is done.
6. ``spec.suspend`` differs from the RayJob's: patch it (with Kueue a suspended RayJob is left for
   Kueue to admit).
7. Status mirrors the RayJob (``operators.status``), through the state machine, one event per
   phase passed; progress from the driver's metrics, and condition ``FaultsRecovered`` (one
   Warning event per change) once the driver replaced actors after faults. The status is written
   only when a field changed: condition times and ``progress.updated`` move only with what they
   stamp.

A status write carries the ``resourceVersion`` that was read: if another writer came first the
executor plans again from fresh reads, so events always describe the write that landed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from operators import admission, builders
from operators.actions import (
    Action,
    CreateConfigMap,
    CreateNetworkPolicy,
    CreateRayJob,
    CreateRayTokenSecret,
    DeleteRayJob,
    Event,
    Observed,
    PatchRayJobSuspend,
    ReplaceConfigMap,
    ReplaceNetworkPolicySpec,
    WriteStatus,
)
from operators.attempts import Cause, retries_used, track
from operators.ownership import Ownership, describe, ownership
from operators.settings import OperatorSettings
from operators.status import (
    Target,
    advance,
    gauges_of,
    progress_of,
    restarts_of,
    run_complete,
    target_of,
    with_faults,
    with_precision,
    with_slo,
)
from rljob import resource as rl
from rljob.spec import describe_errors
from rljob.status import (
    TERMINAL,
    JobStatus,
    Phase,
    Progress,
    Reason,
)

REFUSED_MESSAGE = (
    "spec.job/spec.cluster changed while the job runs: refused (the RayJob keeps the spec "
    "it started with). Suspend it (spec.suspend: true), change it, then resume."
)
RUNNING = frozenset({Phase.STARTING, Phase.RUNNING})  # a spec change is refused in these
_WITH_PROGRESS = frozenset({Phase.RUNNING, Phase.SUCCEEDED})  # the driver's metrics are read in these


# -- what to read ----------------------------------------------------------------------------------


def settled(rljob: dict[str, Any]) -> bool:
    """Nothing to do for this RLJob (being deleted, or finished): its RayJob need not be read."""
    if rl.ObjectMeta.of(rljob).deletion_timestamp:
        return True
    return rl.status_of(rljob).phase in TERMINAL


def wants_progress(rljob: dict[str, Any], rayjob: dict[str, Any] | None) -> bool:
    """Whether the driver's metrics are worth reading: only while the RayJob says its cluster runs
    the job or has finished it (scraping is a pod list and an HTTP call)."""
    if rayjob is None:
        return False
    suspend = bool((rljob.get("spec") or {}).get("suspend"))
    if suspend:
        return False
    return target_of(rayjob, suspend)[0] in _WITH_PROGRESS or _deployment(rayjob) == "Running"


# -- the plan --------------------------------------------------------------------------------------


def plan(
    rljob: dict[str, Any],
    objects: Observed,
    settings: OperatorSettings,
    metrics: str | None = None,
    now: datetime | None = None,
) -> list[Action]:
    """The actions for ``rljob`` given the objects of its names as read and the driver's
    ``/metrics`` text (None: not read or unreachable). ``now`` stamps new condition times and
    progress."""
    now = now or datetime.now(UTC)
    if settled(rljob):
        return []
    status = rl.status_of(rljob)
    try:
        job = rl.RLJob.of(rljob)
    except ValidationError as err:
        return _fail_invalid(status, "; ".join(describe_errors(err)), now)
    spec = job.spec
    refused = admission.problems(spec, settings, job.metadata.namespace)
    if refused:
        return _fail_invalid(status, "; ".join(refused), now)
    found = [
        ("RayJob", objects.rayjob),
        ("ConfigMap", objects.configmap),
        ("NetworkPolicy", objects.networkpolicy),
    ]
    whose = {kind: ownership(obj, job.metadata) for kind, obj in found if obj is not None}
    foreign = [
        describe(kind, obj) for kind, obj in found if obj is not None and whose[kind] is Ownership.FOREIGN
    ]
    if foreign:
        return _fail_conflict(status, foreign, now)
    if Ownership.PREVIOUS in whose.values():
        return []  # an earlier RLJob of this name's objects, which the garbage collector removes
    rayjob, configmap = objects.rayjob, objects.configmap

    actions: list[Action] = []
    after: list[Event] = []  # events that describe the status write: posted once it landed
    new, observed = status, rayjob
    ns, name = job.metadata.namespace, job.metadata.name
    # what a RayJob's pods need before they start (see 3. above)
    before_rayjob = _guards(job, settings, objects.networkpolicy) + _configmap(
        configmap, builders.spec_configmap(job)
    )

    def create(reason: Reason) -> CreateRayJob:
        nonlocal observed
        cause = _CAUSES[reason]
        if cause == "created" and status.attempts:
            cause = "recreated"  # rebuilt from a changed spec: the job ran before
        observed = builders.rayjob(job, settings, cause)
        kind = "Normal" if reason == Reason.RAYJOB_CREATED else "Warning"
        return CreateRayJob(observed, Event(kind, reason, f"RayJob {ns}/{name}"))

    if rayjob is not None and (rayjob.get("metadata") or {}).get("deletionTimestamp"):
        # KubeRay's finalizer stops a deleted RayJob's Ray job first: its successor, under the same
        # name, is made once it is gone (a create now would be refused as a conflict)
        return []
    retry = _retry(rayjob, new, spec, settings, metrics) if rayjob is not None else None
    if rayjob is None:
        if status.phase is Phase.PENDING and status.reason == Reason.USER_RESUMED:
            why = Reason.RAYJOB_RESTARTED  # the finished RayJob went (below), this is its successor
        elif status.reason == Reason.RETRYING and status.phase is Phase.STARTING:
            why = Reason.RAYJOB_RETRIED  # the failed RayJob went (below), this is the next attempt
        elif status.phase in RUNNING:
            why = Reason.RAYJOB_RECREATED
        else:
            why = Reason.RAYJOB_CREATED
        actions += [*before_rayjob, create(why)]
    elif _annotation(rayjob, builders.SPEC_HASH) != builders.spec_hash(spec):
        if status.phase in RUNNING:
            if not any(c.type == Reason.SPEC_CHANGE_REFUSED and c.status for c in status.conditions):
                after.append(Event("Warning", Reason.SPEC_CHANGE_REFUSED, REFUSED_MESSAGE))
            new = new.with_condition(Reason.SPEC_CHANGE_REFUSED, True, Reason.JOB_RUNNING, REFUSED_MESSAGE)
        else:  # not running: rebuild it from the new spec
            new = new.with_condition(Reason.SPEC_CHANGE_REFUSED, False, Reason.APPLIED, "spec applied")
            applied = Event("Normal", Reason.SPEC_APPLIED, "RayJob rebuilt from the changed spec")
            actions += [DeleteRayJob(_uid(rayjob)), *before_rayjob, applied, create(Reason.RAYJOB_CREATED)]
    elif (
        status.phase is Phase.PENDING
        and status.reason == Reason.USER_RESUMED
        and _deployment(rayjob) in ("Complete", "Failed")
        and not spec.suspend
    ):
        # resumed after a failure: a finished RayJob does not run again, a new one does
        actions += [DeleteRayJob(_uid(rayjob)), *before_rayjob, create(Reason.RAYJOB_RESTARTED)]
    elif retry is not None:
        # failed where KubeRay cannot retry (it cannot tell): a new RayJob, once this one is gone
        actions += [DeleteRayJob(_uid(rayjob))]
    else:
        suspended = bool((rayjob.get("spec") or {}).get("suspend"))
        kueue = bool(spec.cluster.queue and spec.cluster.queue.scheduler == "kueue")
        desired = spec.suspend or (kueue and suspended)  # Kueue admits a job by unsuspending it
        if suspended != desired:
            how = "Suspending" if desired else "Resuming"
            actions += [PatchRayJobSuspend(desired), Event("Normal", how, f"RayJob spec.suspend={desired}")]

    assert observed is not None  # created or read above
    target = _outcome_from_driver(target_of(observed, spec.suspend), new, metrics)
    if metrics is not None and run_complete(metrics):
        new = new.with_condition(
            Reason.DRIVER_COMPLETED, True, Reason.DRIVER_COMPLETED, DRIVER_COMPLETED_MESSAGE
        )
    # a failure ends the attempt (with what the job would have said), also the one retried now
    attempts = track(new.attempts, rayjob, metrics, target[0], target[1], target[2], now)
    if retry is not None:
        target = (Phase.STARTING, Reason.RETRYING, retry.message)
    new = new.model_copy(update={"attempts": attempts}) if attempts != new.attempts else new
    new, passed = advance(new, target)
    if metrics and target[0] in _WITH_PROGRESS:
        new = _with_progress(new, progress_of(metrics, spec.job.steps), now)
        new, recovered = with_faults(new, restarts_of(metrics))
        after.extend(recovered)
        gauges, slo = gauges_of(metrics), spec.job.precision.mismatch_slo
        new, slo_events = with_slo(new, gauges, slo)
        after.extend(slo_events)
        new, precision_events = with_precision(new, gauges, slo)
        after.extend(precision_events)
    new = _stamped(status, new, now)
    if new != status:
        actions.append(WriteStatus(new))
    actions.extend(after)
    actions.extend(_phase_event(phase, target) for phase in passed)
    return actions


# KubeRay's reason when its submitter ended and it never learnt the Ray job's status: with
# ray_auth: secret a KubeRay older than 1.5.1 cannot (the dashboard wants the token it lacks)
OUTCOME_UNREAD = "JobDeploymentStatusTransitionGracePeriodExceeded"
DRIVER_COMPLETED_MESSAGE = "the driver reported every step done (fp8rl_run_complete)"


def _driver_done(status: JobStatus, metrics: str | None) -> bool:
    """The driver said it did every step: now (its metrics) or earlier (condition DriverCompleted)."""
    return (metrics is not None and run_complete(metrics)) or any(
        c.type == Reason.DRIVER_COMPLETED and c.status for c in status.conditions
    )


def _outcome_from_driver(target: Target, status: JobStatus, metrics: str | None) -> Target:
    """Where KubeRay does not know the Ray job's status (``rayAuth: secret`` under KubeRay older
    than 1.5.1), the driver's own metrics decide: a driver that serves them trains (Running, not
    Starting), and a job KubeRay fails for want of the outcome succeeded if the driver reported
    every step done (condition ``DriverCompleted``, recorded from ``fp8rl_run_complete`` while it
    lingered). Otherwise KubeRay's own verdict stands."""
    phase, reason, _ = target
    if phase is Phase.STARTING and reason == Reason.DRIVER_STARTING and metrics is not None:
        return (
            Phase.RUNNING,
            Reason.TRAINING,
            "the driver serves its metrics (KubeRay has not read the Ray job)",
        )
    if phase is Phase.FAILED and reason == OUTCOME_UNREAD:
        if _driver_done(status, metrics):
            return (
                Phase.SUCCEEDED,
                Reason.COMPLETED,
                DRIVER_COMPLETED_MESSAGE + "; KubeRay could not read the Ray job",
            )
        return (
            Phase.FAILED,
            reason,
            "KubeRay could not read the Ray job's outcome (KubeRay < 1.5.1 with rayAuth: secret) and the "
            "driver did not report every step done: its log is on the head pod (kubectl logs)",
        )
    return target


@dataclass(frozen=True)
class Retry:
    """A failed RayJob the operator replaces by a new one (a new Ray cluster)."""

    message: str


def _retry(
    rayjob: dict[str, Any],
    status: JobStatus,
    spec: rl.RLJobSpec,
    settings: OperatorSettings,
    metrics: str | None,
) -> Retry | None:
    """With ``ray_auth: secret`` a KubeRay older than 1.5.1 sees every ending as a failure (it cannot
    read the outcome), so the RayJob gets ``backoffLimit: 0`` and the operator retries in its
    place: a RayJob that failed while the driver did not report every step done, not past its
    deadline (as KubeRay would not either), not suspended, while retries are left
    (``spec.cluster.backoffLimit``, else the operator's ``backoff_limit``)."""
    if settings.ray_auth != "secret" or spec.suspend or _deployment(rayjob) != "Failed":
        return None
    st = rayjob.get("status") or {}
    reason = str(st.get("reason") or "RayJobFailed")
    done = _driver_done(status, metrics)
    limit = spec.cluster.backoff_limit if spec.cluster.backoff_limit is not None else settings.backoff_limit
    used = retries_used(status.attempts)
    if done or reason == "DeadlineExceeded" or used >= limit or status.phase not in RUNNING:
        return None
    message = (
        f"attempt {status.attempts[-1].number if status.attempts else 1} failed ({reason}); a new Ray "
        f"cluster for the next (retry {used + 1} of {limit})"
    )
    return Retry(message)


_CAUSES: dict[Reason, Cause] = {
    Reason.RAYJOB_CREATED: "created",
    Reason.RAYJOB_RECREATED: "recreated",
    Reason.RAYJOB_RESTARTED: "resumed",
    Reason.RAYJOB_RETRIED: "retried",
}


def _phase_event(phase: Phase, target: Target) -> Event:
    return Event("Warning" if phase is Phase.FAILED else "Normal", phase.value, f"{target[1]}: {target[2]}")


def _with_progress(status: JobStatus, progress: Progress | None, now: datetime) -> JobStatus:
    """``status`` with the driver's latest ``progress`` (never an older step), stamped ``now``
    only when a value changed: an unchanged scrape leaves the status equal."""
    if progress is None or progress.step < status.progress.step:
        return status
    if progress.model_copy(update={"updated": status.progress.updated}) == status.progress:
        return status
    return status.model_copy(update={"progress": progress.model_copy(update={"updated": now})})


def _fail_invalid(status: JobStatus, problems: str, now: datetime) -> list[Action]:
    """Failed with reason InvalidSpec (once: an unchanged refusal writes nothing)."""
    moved, _ = advance(status, (Phase.FAILED, Reason.INVALID_SPEC, problems))
    moved = _stamped(status, moved, now)
    if moved == status:
        return []
    actions: list[Action] = [WriteStatus(moved)]
    if (moved.phase, moved.message) != (status.phase, status.message):
        message = f"spec refused: {problems}; fix it with kubectl edit"
        actions.append(Event("Warning", Reason.INVALID_SPEC, message))
    return actions


def _fail_conflict(status: JobStatus, objects: list[str], now: datetime) -> list[Action]:
    """Failed with reason and condition ``NameConflict`` (once: an unchanged conflict writes
    nothing): the objects that hold the job's names and are not its own."""
    message = (
        f"{', '.join(objects)} exists and is not this RLJob's (operators.ownership: no owner reference to "
        "its uid); the operator leaves it alone. Rename the RLJob, or remove that object and the job starts"
    )
    moved, _ = advance(status, (Phase.FAILED, Reason.NAME_CONFLICT, message))
    moved = moved.with_condition(Reason.NAME_CONFLICT, True, Reason.NAME_CONFLICT, message)
    moved = _stamped(status, moved, now)
    if moved == status:
        return []
    actions: list[Action] = [WriteStatus(moved)]
    if (moved.phase, moved.message) != (status.phase, status.message):
        actions.append(Event("Warning", Reason.NAME_CONFLICT, message))
    return actions


def _uid(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")


def _deployment(rayjob: dict[str, Any]) -> str:
    return str((rayjob.get("status") or {}).get("jobDeploymentStatus") or "")


def _annotation(obj: dict[str, Any], key: str) -> str | None:
    found = ((obj.get("metadata") or {}).get("annotations") or {}).get(key)
    return None if found is None else str(found)


def _guards(job: rl.RLJob, settings: OperatorSettings, current: dict[str, Any] | None) -> list[Action]:
    """The job's NetworkPolicy (``current``: its own, as read) and Ray token Secret, as the
    settings ask for them."""
    out: list[Action] = []
    if settings.network_policy:
        wanted = builders.network_policy(job, settings)
        if current is None:
            out.append(CreateNetworkPolicy(wanted))
        elif current.get("spec") != wanted["spec"]:
            out.append(ReplaceNetworkPolicySpec(wanted))
    if settings.ray_auth == "secret":
        out.append(CreateRayTokenSecret(job))
    return out


def _configmap(current: dict[str, Any] | None, wanted: dict[str, Any]) -> list[Action]:
    """The ConfigMap as the builders say, before a RayJob that mounts it is created."""
    if current is None:
        return [CreateConfigMap(wanted)]
    if current.get("data") != wanted["data"]:
        return [ReplaceConfigMap(wanted)]
    return []


def _stamped(before: JobStatus, after: JobStatus, now: datetime) -> JobStatus:
    """``after`` with every condition that is not one of ``before``'s stamped ``now`` (the state
    machine stamps the clock; the plan stamps the time it was given)."""
    conditions = [
        c if c in before.conditions else c.model_copy(update={"last_transition": now})
        for c in after.conditions
    ]
    if conditions == after.conditions:
        return after
    return after.model_copy(update={"conditions": conditions})
