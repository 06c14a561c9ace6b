"""The operator's decisions (``operators.plan``): a hand-written table of situations (the RLJob,
the objects of its names as read, the driver's metrics) and the exact actions each calls for, in
order. Expected statuses, events and messages are written out from the rules in
docs/operator.md and KubeRay's documented states, not produced by the code under test; object
bodies come from the builders (tested in ``test_builders.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest

from operators import builders
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
from operators.plan import REFUSED_MESSAGE, plan, settled, wants_progress
from operators.settings import OperatorSettings
from rljob import resource as rl
from rljob.status import Condition, JobStatus, Progress

# every namespace may use the queue and the volume claim these cases name (operators.admission)
SETTINGS = OperatorSettings(default_job_policy={"queues": ["kueue/q"], "volumeClaims": ["fp8rl-runs"]})
NOW = datetime(2025, 6, 2, 12, 0, 0, tzinfo=UTC)  # the time the plan is made
THEN = datetime(2025, 6, 1, 9, 30, 0, tzinfo=UTC)  # when earlier transitions happened
SUSPEND_MESSAGE = "resume continues from the checkpoint"


def cond(kind: str, reason: str, message: str, at: datetime = THEN, on: bool = True) -> Condition:
    return Condition(type=kind, status=on, reason=reason, message=message, last_transition=at)


def status(phase: str, reason: str, message: str, *conditions: Condition, **progress: Any) -> JobStatus:
    return JobStatus(
        phase=phase,
        reason=reason,
        message=message,
        conditions=list(conditions),
        progress=Progress(**progress),
    )


def rljob(
    st: JobStatus | None = None,
    steps: int = 10,
    suspend: bool = False,
    cluster: dict[str, Any] | None = None,
    **job: Any,
) -> dict[str, Any]:
    """An RLJob as the API server returns it (status as JSON)."""
    obj: dict[str, Any] = {
        "apiVersion": "fp8rl.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "j", "namespace": "team-a", "uid": "uid-1", "resourceVersion": "41"},
        "spec": {"job": {"steps": steps, **job}, "suspend": suspend, "cluster": cluster or {}},
    }
    if st is not None:
        obj["status"] = st.model_dump(mode="json")
    return obj


def built(obj: dict[str, Any], cause: str = "created") -> dict[str, Any]:
    """The RayJob the builders make for ``obj`` (``cause``: why the operator makes it)."""
    return builders.rayjob(rl.RLJob.of(obj), SETTINGS, cause)


def rayjob(
    obj: dict[str, Any], deployment: str = "", job: str = "", suspend: bool | None = None, **extra: Any
) -> dict[str, Any]:
    """``obj``'s RayJob as read back, with KubeRay's status."""
    body = built(obj)
    body["metadata"]["uid"] = RAYJOB_UID
    if suspend is not None:
        body["spec"]["suspend"] = suspend
    body["status"] = {"jobDeploymentStatus": deployment, "jobStatus": job, **extra}
    return body


RAYJOB_UID = "rayjob-uid-7"


def without_attempts(actions: list[Action], obj: dict[str, Any]) -> list[Action]:
    """``actions`` with the status writes' ``attempts`` left out (and a write that changed nothing
    else): the table is about phases, events and the API calls; what attempts a status records is
    tests/operators/test_attempts.py's."""
    before = rl.status_of(obj).model_copy(update={"attempts": []})
    out: list[Action] = []
    for a in actions:
        if isinstance(a, WriteStatus):
            a = WriteStatus(a.status.model_copy(update={"attempts": []}))
            if a.status == before:
                continue
        out.append(a)
    return out


def deleting_rayjob(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` being deleted: KubeRay's finalizer holds it while it stops the Ray job."""
    body["metadata"]["deletionTimestamp"] = "2025-06-02T11:59:58Z"
    body["metadata"]["finalizers"] = ["ray.io/rayjob-finalizer"]
    return body


def from_other_spec(body: dict[str, Any]) -> dict[str, Any]:
    body["metadata"]["annotations"][builders.SPEC_HASH] = "0123456789abcdef"
    return body


def configmap(obj: dict[str, Any]) -> dict[str, Any]:
    return builders.spec_configmap(rl.RLJob.of(obj))


def policy(obj: dict[str, Any], settings: OperatorSettings = SETTINGS) -> dict[str, Any]:
    """``obj``'s NetworkPolicy as read back."""
    body = builders.network_policy(rl.RLJob.of(obj), settings)
    body["metadata"]["uid"] = "policy-uid-3"
    return body


def guards(obj: dict[str, Any]) -> list[Action]:
    """What goes before any RayJob of ``obj`` with the default settings: its NetworkPolicy."""
    return [CreateNetworkPolicy(builders.network_policy(rl.RLJob.of(obj), SETTINGS))]


def exposition(step: int, reward: float) -> str:
    """The driver's /metrics as Prometheus text (names from the metrics table in docs/running.md)."""
    return (
        "# TYPE fp8rl_step gauge\n"
        f'fp8rl_step{{job="j",namespace="team-a",recipe="fp8-e2e"}} {step}\n'
        "# TYPE fp8rl_reward_mean gauge\n"
        f'fp8rl_reward_mean{{job="j",namespace="team-a",recipe="fp8-e2e"}} {reward}\n'
    )


def with_restarts(text: str, generator: int, trainer: int) -> str:
    """``text`` and the driver's actor restarts (fp8rl_actor_restarts_total, a role label)."""
    labels = 'job="j",namespace="team-a",recipe="fp8-e2e"'
    return (
        text
        + "# TYPE fp8rl_actor_restarts counter\n"
        + f'fp8rl_actor_restarts_total{{{labels},role="generator"}} {generator}.0\n'
        + f'fp8rl_actor_restarts_total{{{labels},role="trainer"}} {trainer}.0\n'
    )


def with_slo(text: str, median: float, tail_steps: int, breached: int) -> str:
    """``text`` and the driver's mismatch SLO gauges, with fp8-e2e's default bounds (1.1, 1.1)."""
    labels = 'job="j",namespace="team-a",recipe="fp8-e2e"'
    gauges = {
        "median": median,
        "median_bound": 1.1,
        "tail_steps": float(tail_steps),
        "tail_bound": 1.1,
        "breached": float(breached),
    }
    return text + "".join(
        f"# TYPE fp8rl_mismatch_slo_{k} gauge\nfp8rl_mismatch_slo_{k}{{{labels}}} {v}\n"
        for k, v in gauges.items()
    )


# the message worked by hand from with_slo's numbers and the default window (10 steps, 10%: 1 allowed)
SLO_BREACHED = (
    "median token_mult_prob_error 1.3100 (bound 1.1); 3 of the last 10 steps above 1.1 (at most 1): breached"
)
SLO_MET = (
    "median token_mult_prob_error 1.0040 (bound 1.1); 0 of the last 10 steps above 1.1 "
    "(at most 1): within the SLO"
)


RECOVERED_1 = (
    "the driver replaced 1 generator and 0 trainer actor(s) after faults (process died, engine "
    "failed, call hung); its log has a line per fault"
)


RECOVERED = cond("FaultsRecovered", "GeneratorRestarted", RECOVERED_1)
RECOVERED_3 = cond(
    "FaultsRecovered",
    "TrainerRestarted",
    RECOVERED_1.replace("1 generator and 0 trainer", "2 generator and 1 trainer"),
)


@dataclass
class Case:
    rljob: dict[str, Any]
    rayjob: dict[str, Any] | None
    configmap: dict[str, Any] | None
    want: list[Action]
    metrics: str | None = None
    settings: OperatorSettings = field(default_factory=lambda: SETTINGS)
    networkpolicy: dict[str, Any] | None = None


STARTING = "waiting for the Ray cluster"
STARTED = cond("Starting", "RayClusterStarting", STARTING)
RUNNING = cond("Running", "Training", "the driver is running")
RUN_STATUS = status("Running", "Training", "the driver is running", STARTED, RUNNING)
RESUMED = status(
    "Pending",
    "UserResumed",
    "resume requested",
    cond("Failed", "DeadlineExceeded", "ran too long"),
    cond("Pending", "UserResumed", "resume requested"),
)


def cases() -> dict[str, Case]:
    new = rljob()
    new_suspended = rljob(suspend=True)
    bad = rljob(rollout={"group_size": 0})
    bad_message = "job.rollout.group_size: Input should be greater than or equal to 1 (got 0)"
    share = rljob(resources={"share_gpu": True, "gpus_per_generator": 1, "gpus_per_trainer": 1})
    share_message = (
        "spec.job.resources.share_gpu: true puts every actor on one GPU of one machine (fp8rl run); "
        "on a cluster each pod gets whole GPUs: set it to false"
    )
    suspended = status(
        "Suspended", "Suspended", f"RayJob Suspended; {SUSPEND_MESSAGE}", STARTED, cond("Suspended", "x", "y")
    )
    gone = rljob(RUN_STATUS)
    changed = rljob(RUN_STATUS, steps=99)
    refused = cond("SpecChangeRefused", "JobRunning", REFUSED_MESSAGE)
    changed_again = rljob(RUN_STATUS.model_copy(update={"conditions": [STARTED, RUNNING, refused]}), steps=99)
    rebuilt = rljob(suspended, steps=99, suspend=True)
    failed = status("Failed", "RayJobFailed", "RayJob Failed", STARTED, cond("Failed", "RayJobFailed", "x"))
    failed_changed = rljob(failed, steps=99)
    resumed = rljob(RESUMED)
    resumed_held = rljob(RESUMED, suspend=True)
    to_suspend = rljob(RUN_STATUS, suspend=True)
    to_resume = rljob(suspended)
    kueue = rljob(status("Pending", "Created", ""), cluster={"queue": {"scheduler": "kueue", "name": "q"}})
    starting = rljob(status("Starting", "RayClusterStarting", STARTING, STARTED))
    at_step = RUN_STATUS.model_copy(
        update={"progress": Progress(step=4, total_steps=10, reward=0.5, updated=THEN)}
    )
    steady = rljob(at_step)
    done = rljob(status("Succeeded", "Completed", "the driver finished", STARTED))
    deleting = rljob(RUN_STATUS)
    deleting["metadata"]["deletionTimestamp"] = "2025-06-02T11:00:00Z"
    small_pool = OperatorSettings(generation_max_gpus_per_pod=4)
    tp8 = {"generator_engine": "vllm", "gpus_per_generator": 8, "generator_tensor_parallel_size": 8}
    big = rljob(resources=tp8)
    big_message = (
        "spec.job.resources.gpus_per_generator: 8 GPUs in one pod, but nodes of the generation pool have "
        "4; ask for at most 4, or name a larger pool in spec.cluster.generation.nodeSelector"
    )
    held = "the RayJob is still suspended (resuming, or queued)"
    return {
        "a new RLJob: its ConfigMap and RayJob, then Starting": Case(
            new,
            None,
            None,
            [
                *guards(new),
                CreateConfigMap(configmap(new)),
                CreateRayJob(built(new), Event("Normal", "RayJobCreated", "RayJob team-a/j")),
                WriteStatus(
                    status(
                        "Starting",
                        "RayClusterStarting",
                        STARTING,
                        cond("Starting", "RayClusterStarting", STARTING, NOW),
                    )
                ),
                Event("Normal", "Starting", f"RayClusterStarting: {STARTING}"),
            ],
        ),
        "a new RLJob created suspended goes straight to Suspended": Case(
            new_suspended,
            None,
            None,
            [
                *guards(new_suspended),
                CreateConfigMap(configmap(new_suspended)),
                CreateRayJob(built(new_suspended), Event("Normal", "RayJobCreated", "RayJob team-a/j")),
                WriteStatus(
                    status(
                        "Suspended",
                        "Suspended",
                        f"RayJob suspending; {SUSPEND_MESSAGE}",
                        cond("Suspended", "Suspended", f"RayJob suspending; {SUSPEND_MESSAGE}", NOW),
                    )
                ),
                Event("Normal", "Suspended", f"Suspended: RayJob suspending; {SUSPEND_MESSAGE}"),
            ],
        ),
        "an invalid spec fails with the field, nothing is created": Case(
            bad,
            None,
            None,
            [
                WriteStatus(
                    status(
                        "Failed", "InvalidSpec", bad_message, cond("Failed", "InvalidSpec", bad_message, NOW)
                    )
                ),
                Event("Warning", "InvalidSpec", f"spec refused: {bad_message}; fix it with kubectl edit"),
            ],
        ),
        "an invalid spec already reported: nothing to write": Case(
            rljob(
                status("Failed", "InvalidSpec", bad_message, cond("Failed", "InvalidSpec", bad_message)),
                rollout={"group_size": 0},
            ),
            None,
            None,
            [],
        ),
        "a suspended job turned invalid passes Pending on its way to Failed": Case(
            rljob(suspended, rollout={"group_size": 0}),
            None,
            None,
            [
                WriteStatus(
                    status(
                        "Failed",
                        "InvalidSpec",
                        bad_message,
                        STARTED,
                        cond("Suspended", "x", "y"),
                        cond("Pending", "InvalidSpec", bad_message, NOW),
                        cond("Failed", "InvalidSpec", bad_message, NOW),
                    )
                ),
                Event("Warning", "InvalidSpec", f"spec refused: {bad_message}; fix it with kubectl edit"),
            ],
        ),
        "share_gpu cannot run on a cluster: refused": Case(
            share,
            None,
            None,
            [
                WriteStatus(
                    status(
                        "Failed",
                        "InvalidSpec",
                        share_message,
                        cond("Failed", "InvalidSpec", share_message, NOW),
                    )
                ),
                Event("Warning", "InvalidSpec", f"spec refused: {share_message}; fix it with kubectl edit"),
            ],
        ),
        "more GPUs per pod than the default pool's nodes have: refused": Case(
            big,
            None,
            None,
            [
                WriteStatus(
                    status(
                        "Failed",
                        "InvalidSpec",
                        big_message,
                        cond("Failed", "InvalidSpec", big_message, NOW),
                    )
                ),
                Event("Warning", "InvalidSpec", f"spec refused: {big_message}; fix it with kubectl edit"),
            ],
            settings=small_pool,
        ),
        "the RayJob deleted while running is recreated; back to Starting": Case(
            gone,
            None,
            configmap(gone),
            [
                *guards(gone),
                CreateRayJob(
                    built(gone, "recreated"), Event("Warning", "RayJobRecreated", "RayJob team-a/j")
                ),
                WriteStatus(
                    status(
                        "Starting",
                        "RayClusterStarting",
                        STARTING,
                        RUNNING,
                        cond("Starting", "RayClusterStarting", STARTING, NOW),
                    )
                ),
                Event("Normal", "Starting", f"RayClusterStarting: {STARTING}"),
            ],
        ),
        "a RayJob missing and a stale ConfigMap: the ConfigMap is rewritten first": Case(
            starting,
            None,
            configmap(rljob(steps=3)),
            [
                *guards(starting),
                ReplaceConfigMap(configmap(starting)),
                CreateRayJob(
                    built(starting, "recreated"), Event("Warning", "RayJobRecreated", "RayJob team-a/j")
                ),
            ],
        ),
        "a spec change while running is refused, once": Case(
            changed,
            from_other_spec(rayjob(rljob(), "Running", "RUNNING")),
            configmap(rljob()),
            [
                WriteStatus(
                    RUN_STATUS.model_copy(
                        update={
                            "conditions": [
                                STARTED,
                                RUNNING,
                                cond("SpecChangeRefused", "JobRunning", REFUSED_MESSAGE, NOW),
                            ]
                        }
                    )
                ),
                Event("Warning", "SpecChangeRefused", REFUSED_MESSAGE),
            ],
        ),
        "a spec change already refused: no second event, nothing to write": Case(
            changed_again,
            from_other_spec(rayjob(rljob(), "Running", "RUNNING")),
            configmap(rljob()),
            [],
        ),
        "a spec change while suspended rebuilds the RayJob": Case(
            rebuilt,
            from_other_spec(rayjob(rljob(suspend=True), "Suspended", suspend=True)),
            configmap(rljob()),
            [
                DeleteRayJob(RAYJOB_UID),
                *guards(rebuilt),
                ReplaceConfigMap(configmap(rebuilt)),
                Event("Normal", "SpecApplied", "RayJob rebuilt from the changed spec"),
                CreateRayJob(built(rebuilt), Event("Normal", "RayJobCreated", "RayJob team-a/j")),
                WriteStatus(
                    suspended.model_copy(
                        update={
                            "conditions": [
                                *suspended.conditions,
                                cond("SpecChangeRefused", "Applied", "spec applied", NOW, on=False),
                            ]
                        }
                    )
                ),
            ],
        ),
        "a spec change of a failed job rebuilds it, and it starts again": Case(
            failed_changed,
            from_other_spec(rayjob(rljob(), "Failed")),
            configmap(rljob()),
            [
                DeleteRayJob(RAYJOB_UID),
                *guards(failed_changed),
                ReplaceConfigMap(configmap(failed_changed)),
                Event("Normal", "SpecApplied", "RayJob rebuilt from the changed spec"),
                CreateRayJob(built(failed_changed), Event("Normal", "RayJobCreated", "RayJob team-a/j")),
                WriteStatus(
                    status(
                        "Starting",
                        "RayClusterStarting",
                        STARTING,
                        cond("Failed", "RayJobFailed", "x"),
                        cond("SpecChangeRefused", "Applied", "spec applied", NOW, on=False),
                        cond("Pending", "RayClusterStarting", STARTING, NOW),
                        cond("Starting", "RayClusterStarting", STARTING, NOW),
                    )
                ),
                Event("Normal", "Pending", f"RayClusterStarting: {STARTING}"),
                Event("Normal", "Starting", f"RayClusterStarting: {STARTING}"),
            ],
        ),
        "resumed after a failure: the finished RayJob is replaced": Case(
            resumed,
            rayjob(resumed, "Failed", reason="DeadlineExceeded", message="ran too long"),
            configmap(resumed),
            [
                DeleteRayJob(RAYJOB_UID),
                *guards(resumed),
                CreateRayJob(
                    built(resumed, "resumed"), Event("Warning", "RayJobRestarted", "RayJob team-a/j")
                ),
                WriteStatus(
                    status(
                        "Starting",
                        "RayClusterStarting",
                        STARTING,
                        *RESUMED.conditions,
                        cond("Starting", "RayClusterStarting", STARTING, NOW),
                    )
                ),
                Event("Normal", "Starting", f"RayClusterStarting: {STARTING}"),
            ],
        ),
        "resumed, the finished RayJob still held by KubeRay's finalizer: wait for it": Case(
            resumed,
            deleting_rayjob(rayjob(resumed, "Failed", reason="DeadlineExceeded", message="ran too long")),
            configmap(resumed),
            [],
        ),
        "resumed, the finished RayJob gone: its successor is a restart": Case(
            resumed,
            None,
            configmap(resumed),
            [
                *guards(resumed),
                CreateRayJob(
                    built(resumed, "resumed"), Event("Warning", "RayJobRestarted", "RayJob team-a/j")
                ),
                WriteStatus(
                    status(
                        "Starting",
                        "RayClusterStarting",
                        STARTING,
                        *RESUMED.conditions,
                        cond("Starting", "RayClusterStarting", STARTING, NOW),
                    )
                ),
                Event("Normal", "Starting", f"RayClusterStarting: {STARTING}"),
            ],
        ),
        "resumed but spec.suspend is set: no restart, the RayJob is suspended": Case(
            resumed_held,
            rayjob(resumed_held, "Failed", suspend=False),
            configmap(resumed_held),
            [
                PatchRayJobSuspend(True),
                Event("Normal", "Suspending", "RayJob spec.suspend=True"),
                WriteStatus(
                    status(
                        "Suspended",
                        "Suspended",
                        f"RayJob Failed; {SUSPEND_MESSAGE}",
                        *RESUMED.conditions,
                        cond("Suspended", "Suspended", f"RayJob Failed; {SUSPEND_MESSAGE}", NOW),
                    )
                ),
                Event("Normal", "Suspended", f"Suspended: RayJob Failed; {SUSPEND_MESSAGE}"),
            ],
        ),
        "spec.suspend set while running: the RayJob is suspended": Case(
            to_suspend,
            rayjob(to_suspend, "Running", "RUNNING", suspend=False),
            configmap(to_suspend),
            [
                PatchRayJobSuspend(True),
                Event("Normal", "Suspending", "RayJob spec.suspend=True"),
                WriteStatus(
                    status(
                        "Suspended",
                        "Suspended",
                        f"RayJob Running; {SUSPEND_MESSAGE}",
                        STARTED,
                        RUNNING,
                        cond("Suspended", "Suspended", f"RayJob Running; {SUSPEND_MESSAGE}", NOW),
                    )
                ),
                Event("Normal", "Suspended", f"Suspended: RayJob Running; {SUSPEND_MESSAGE}"),
            ],
        ),
        "spec.suspend cleared: the RayJob is resumed, the job Pending until KubeRay starts it": Case(
            to_resume,
            rayjob(to_resume, "Suspended", "STOPPED", suspend=True),
            configmap(to_resume),
            [
                PatchRayJobSuspend(False),
                Event("Normal", "Resuming", "RayJob spec.suspend=False"),
                WriteStatus(
                    status(
                        "Pending",
                        "RayJobSuspended",
                        held,
                        *suspended.conditions,
                        cond("Pending", "RayJobSuspended", held, NOW),
                    )
                ),
                Event("Normal", "Pending", f"RayJobSuspended: {held}"),
            ],
        ),
        "a Kueue job's RayJob is made suspended: Pending (queued), never Starting": Case(
            kueue,
            None,
            None,
            [
                *guards(kueue),
                CreateConfigMap(configmap(kueue)),
                CreateRayJob(built(kueue), Event("Normal", "RayJobCreated", "RayJob team-a/j")),
                WriteStatus(status("Pending", "RayJobSuspended", held)),
            ],
        ),
        "Kueue holds the RayJob suspended: left for Kueue, Pending says so": Case(
            kueue,
            rayjob(kueue, "Suspended", suspend=True),
            configmap(kueue),
            [WriteStatus(status("Pending", "RayJobSuspended", held))],
        ),
        "the driver runs: Running, with its progress": Case(
            starting,
            rayjob(starting, "Running", "RUNNING", rayClusterName="j-raycluster"),
            configmap(starting),
            [
                WriteStatus(
                    status(
                        "Running",
                        "Training",
                        "the driver is running",
                        STARTED,
                        cond("Running", "Training", "the driver is running", NOW),
                        step=4,
                        total_steps=10,
                        reward=0.5,
                        updated=NOW,
                    )
                ),
                Event("Normal", "Running", "Training: the driver is running"),
            ],
            metrics=exposition(4, 0.5),
        ),
        "a tick that sees nothing new writes nothing": Case(
            steady,
            rayjob(steady, "Running", "RUNNING", rayClusterName="j-raycluster"),
            configmap(steady),
            [],
            metrics=exposition(4, 0.5),
        ),
        "the driver's next step: progress written, stamped now": Case(
            steady,
            rayjob(steady, "Running", "RUNNING", rayClusterName="j-raycluster"),
            configmap(steady),
            [
                WriteStatus(
                    at_step.model_copy(
                        update={"progress": Progress(step=5, total_steps=10, reward=0.75, updated=NOW)}
                    )
                )
            ],
            metrics=exposition(5, 0.75),
        ),
        "a driver that replaced a generator: condition FaultsRecovered and a Warning event": Case(
            steady,
            rayjob(steady, "Running", "RUNNING", rayClusterName="j-raycluster"),
            configmap(steady),
            [
                WriteStatus(
                    at_step.model_copy(
                        update={
                            "conditions": [
                                STARTED,
                                RUNNING,
                                cond("FaultsRecovered", "GeneratorRestarted", RECOVERED_1, NOW),
                            ]
                        }
                    )
                ),
                Event("Warning", "GeneratorRestarted", RECOVERED_1),
            ],
            metrics=with_restarts(exposition(4, 0.5), 1, 0),
        ),
        "a driver whose mismatch breaks its SLO: condition MismatchSLO False and a Warning event": Case(
            steady,
            rayjob(steady, "Running", "RUNNING", rayClusterName="j-raycluster"),
            configmap(steady),
            [
                WriteStatus(
                    at_step.model_copy(
                        update={
                            "conditions": [
                                STARTED,
                                RUNNING,
                                cond("MismatchSLO", "MismatchSLOBreached", SLO_BREACHED, NOW, on=False),
                            ]
                        }
                    )
                ),
                Event("Warning", "MismatchSLOBreached", SLO_BREACHED),
            ],
            metrics=with_slo(exposition(4, 0.5), 1.31, 3, 1),
        ),
        "a driver within its SLO: condition MismatchSLO True, no event": Case(
            steady,
            rayjob(steady, "Running", "RUNNING", rayClusterName="j-raycluster"),
            configmap(steady),
            [
                WriteStatus(
                    at_step.model_copy(
                        update={
                            "conditions": [
                                STARTED,
                                RUNNING,
                                cond("MismatchSLO", "MismatchWithinSLO", SLO_MET, NOW),
                            ]
                        }
                    )
                )
            ],
            metrics=with_slo(exposition(4, 0.5), 1.004, 0, 0),
        ),
        "the same breach again writes nothing and says nothing": Case(
            rljob(
                at_step.model_copy(
                    update={
                        "conditions": [
                            STARTED,
                            RUNNING,
                            cond("MismatchSLO", "MismatchSLOBreached", SLO_BREACHED, on=False),
                        ]
                    }
                )
            ),
            rayjob(steady, "Running", "RUNNING", rayClusterName="j-raycluster"),
            configmap(steady),
            [],
            metrics=with_slo(exposition(4, 0.5), 1.31, 3, 1),
        ),
        "no restart exported as 0: no condition": Case(
            steady,
            rayjob(steady, "Running", "RUNNING", rayClusterName="j-raycluster"),
            configmap(steady),
            [],
            metrics=with_restarts(exposition(4, 0.5), 0, 0),
        ),
        "the same count again writes nothing": Case(
            rljob(at_step.model_copy(update={"conditions": [STARTED, RUNNING, RECOVERED]})),
            rayjob(steady, "Running", "RUNNING", rayClusterName="j-raycluster"),
            configmap(steady),
            [],
            metrics=with_restarts(exposition(4, 0.5), 1, 0),
        ),
        "a lower count (the RayJob started the driver again) keeps the higher one": Case(
            rljob(at_step.model_copy(update={"conditions": [STARTED, RUNNING, RECOVERED_3]})),
            rayjob(steady, "Running", "RUNNING", rayClusterName="j-raycluster"),
            configmap(steady),
            [],
            metrics=with_restarts(exposition(4, 0.5), 1, 0),
        ),
        "an older step (a restarted driver before its checkpoint) does not go back": Case(
            steady,
            rayjob(steady, "Running", "RUNNING", rayClusterName="j-raycluster"),
            configmap(steady),
            [],
            metrics=exposition(3, 0.1),
        ),
        "the RayJob completes: Succeeded": Case(
            steady,
            rayjob(steady, "Complete", "SUCCEEDED"),
            configmap(steady),
            [
                WriteStatus(
                    at_step.model_copy(
                        update={
                            "phase": "Succeeded",
                            "reason": "Completed",
                            "message": "the driver finished",
                            "conditions": [
                                STARTED,
                                RUNNING,
                                cond("Succeeded", "Completed", "the driver finished", NOW),
                            ],
                        }
                    )
                ),
                Event("Normal", "Succeeded", "Completed: the driver finished"),
            ],
        ),
        "the RayJob fails: Failed with KubeRay's reason, a Warning": Case(
            starting,
            rayjob(starting, "Failed", reason="DeadlineExceeded", message="ran too long"),
            configmap(starting),
            [
                WriteStatus(
                    status(
                        "Failed",
                        "DeadlineExceeded",
                        "ran too long",
                        STARTED,
                        cond("Failed", "DeadlineExceeded", "ran too long", NOW),
                    )
                ),
                Event("Warning", "Failed", "DeadlineExceeded: ran too long"),
            ],
        ),
        "a failed job not resumed: nothing to do": Case(
            rljob(failed),
            rayjob(rljob(failed), "Failed"),
            configmap(rljob()),
            [],
        ),
        "a finished job: nothing, even with its RayJob gone": Case(done, None, None, []),
        "an RLJob being deleted: nothing (the delete handler cleans up)": Case(deleting, None, None, []),
    }


CASES = cases()


@pytest.mark.parametrize("name", list(CASES))
def test_plan(name: str) -> None:
    c = CASES[name]
    got = plan(c.rljob, Observed(c.rayjob, c.configmap, c.networkpolicy), c.settings, c.metrics, now=NOW)
    assert without_attempts(got, c.rljob) == c.want


def test_what_is_read() -> None:
    running = rljob(RUN_STATUS)
    assert not settled(running)
    assert settled(rljob(status("Succeeded", "Completed", "")))
    assert settled(rljob(status("Cancelled", "UserCancelled", "")))
    assert not settled(rljob(status("Failed", "RayJobFailed", "")))  # a failed job can be resumed
    # the driver's metrics only while KubeRay says its cluster runs the job (whatever it knows of
    # the Ray job's status: with rayAuth secret it knows nothing) or it has just finished
    assert wants_progress(running, rayjob(running, "Running", "RUNNING"))
    assert wants_progress(running, rayjob(running, "Running", ""))
    assert wants_progress(running, rayjob(running, "Complete", "SUCCEEDED"))
    assert not wants_progress(running, rayjob(running, "Initializing"))
    assert not wants_progress(running, None)
    assert not wants_progress(rljob(RUN_STATUS, suspend=True), rayjob(running, "Running", "RUNNING"))


def test_an_image_outside_the_allow_list_fails_naming_the_field() -> None:
    obj = rljob(cluster={"image": "docker.io/evil/miner:1"})
    message = (
        "spec.cluster.image: 'docker.io/evil/miner:1' is not an allowed image: it must be one of "
        f"'{SETTINGS.image}', or that repository with ':<tag>' or '@<digest>' (a path under one only "
        "where it ends in '/'); the cluster's admin allows more with the chart's jobDefaults.allowedImages"
    )
    assert plan(obj, Observed(), SETTINGS, now=NOW) == [
        WriteStatus(status("Failed", "InvalidSpec", message, cond("Failed", "InvalidSpec", message, NOW))),
        Event("Warning", "InvalidSpec", f"spec refused: {message}; fix it with kubectl edit"),
    ]
    # the default image itself, and a prefix the admin added, are fine
    for image, settings in (
        (SETTINGS.image, SETTINGS),
        ("registry.example/team/w:1", OperatorSettings(allowed_images=["registry.example/"])),
    ):
        actions = plan(rljob(cluster={"image": image}), Observed(), settings, now=NOW)
        assert any(isinstance(a, CreateRayJob) for a in actions), image


def test_the_guards_come_before_the_rayjob_as_the_settings_ask() -> None:
    obj = rljob()
    job = rl.RLJob.of(obj)
    secret = OperatorSettings(ray_auth="secret")
    actions = plan(obj, Observed(), secret, now=NOW)
    assert actions[:4] == [
        CreateNetworkPolicy(builders.network_policy(job, secret)),
        CreateRayTokenSecret(job),
        CreateConfigMap(configmap(obj)),
        CreateRayJob(builders.rayjob(job, secret), Event("Normal", "RayJobCreated", "RayJob team-a/j")),
    ]
    # without per-job policies (the chart's networkPolicy.enabled: false) only the ConfigMap
    bare = OperatorSettings(network_policy=False)
    assert plan(obj, Observed(), bare, now=NOW)[0] == CreateConfigMap(configmap(obj))
    # a RayJob that exists and is current: nothing is written again
    got = plan(obj, Observed(rayjob(obj), configmap(obj), policy(obj, secret)), secret, now=NOW)
    assert without_attempts(got, obj)[:1] == [
        WriteStatus(
            status(
                "Starting",
                "RayClusterStarting",
                STARTING,
                cond("Starting", "RayClusterStarting", STARTING, NOW),
            )
        )
    ]


# -- whose objects: the operator touches only the RLJob's own (operators/ownership.py) ------------


def foreign(kind: str, name: str, **metadata: Any) -> dict[str, Any]:
    """An object someone else made under one of the job's names (an admin, another tool)."""
    return {"kind": kind, "metadata": {"name": name, "namespace": "team-a", "uid": "other-uid", **metadata}}


def conflict_message(*objects: str) -> str:
    return (
        f"{', '.join(objects)} exists and is not this RLJob's (operators.ownership: no owner reference to "
        "its uid); the operator leaves it alone. Rename the RLJob, or remove that object and the job starts"
    )


@pytest.mark.parametrize(
    ("what", "observed", "named"),
    [
        (
            "an admin's deny-all policy",
            Observed(networkpolicy=foreign("NetworkPolicy", "j")),
            "NetworkPolicy team-a/j",
        ),
        (
            "a tenant's ConfigMap",
            Observed(configmap=foreign("ConfigMap", "j-spec")),
            "ConfigMap team-a/j-spec",
        ),
        ("a RayJob made by hand", Observed(rayjob=foreign("RayJob", "j")), "RayJob team-a/j"),
        # our labels copied onto it prove nothing without the owner reference to this RLJob's uid
        (
            "a copy of the operator's labels",
            Observed(
                configmap=foreign(
                    "ConfigMap",
                    "j-spec",
                    labels={"app.kubernetes.io/managed-by": "fp8rl-operator", "fp8rl.io/rljob": "j"},
                )
            ),
            "ConfigMap team-a/j-spec",
        ),
    ],
)
def test_an_object_that_is_not_the_jobs_own_fails_it_and_is_never_touched(
    what: str, observed: Observed, named: str
) -> None:
    message = conflict_message(named)
    assert plan(rljob(), observed, SETTINGS, now=NOW) == [
        WriteStatus(
            status(
                "Failed",
                "NameConflict",
                message,
                cond("Failed", "NameConflict", message, NOW),
                cond("NameConflict", "NameConflict", message, NOW),
            )
        ),
        Event("Warning", "NameConflict", message),
    ]
    # once recorded: nothing more (no second event), and still no action on the object
    failed = rljob(
        status(
            "Failed",
            "NameConflict",
            message,
            cond("Failed", "NameConflict", message),
            cond("NameConflict", "NameConflict", message),
        )
    )
    assert plan(failed, observed, SETTINGS, now=NOW) == []


def test_objects_of_an_earlier_rljob_of_the_same_name_are_waited_for() -> None:
    earlier = {
        "apiVersion": "fp8rl.io/v1alpha1",
        "kind": "RLJob",
        "name": "j",
        "uid": "uid-0",
        "controller": True,
    }
    labels = {"app.kubernetes.io/managed-by": "fp8rl-operator", "fp8rl.io/rljob": "j"}
    left = foreign("ConfigMap", "j-spec", labels=labels, ownerReferences=[earlier])
    # no conflict, no create over it: the garbage collector removes it (its owner is gone)
    assert plan(rljob(), Observed(configmap=left), SETTINGS, now=NOW) == []


def test_the_jobs_own_policy_is_left_alone_when_current_and_replaced_when_not() -> None:
    obj = rljob()
    current = policy(obj)
    actions = plan(obj, Observed(configmap=configmap(obj), networkpolicy=current), SETTINGS, now=NOW)
    assert not any(isinstance(a, (CreateNetworkPolicy, ReplaceNetworkPolicySpec)) for a in actions)
    stale = policy(obj)
    stale["spec"]["ingress"] = stale["spec"]["ingress"][:1]  # made under other settings
    actions = plan(obj, Observed(configmap=configmap(obj), networkpolicy=stale), SETTINGS, now=NOW)
    assert actions[0] == ReplaceNetworkPolicySpec(builders.network_policy(rl.RLJob.of(obj), SETTINGS))


@pytest.mark.parametrize(
    ("output_dir", "cluster", "ok"),
    [
        ("runs/j", {}, True),  # relative: under /data, the pods' work directory
        ("/data/runs/j", {}, True),
        ("/runs/j", {"volumeClaim": "fp8rl-runs"}, True),  # the volume is mounted there
        ("/runs/j", {}, False),  # the README's old example: no volume, a root-owned directory
        ("/tmp/../etc/j", {}, False),
        ("../j", {}, False),  # climbs out of /data
    ],
)
def test_output_dir_must_be_writable_in_the_pods(output_dir: str, cluster: dict[str, Any], ok: bool) -> None:
    actions = plan(rljob(cluster=cluster, output_dir=output_dir), Observed(), SETTINGS, now=NOW)
    created = any(isinstance(a, CreateRayJob) for a in actions)
    assert created is ok
    if not ok:
        [write, event] = actions
        assert isinstance(write, WriteStatus) and write.status.reason == "InvalidSpec"
        assert write.status.message.startswith(f"spec.job.output_dir: {output_dir!r} is not writable")
        assert "relative to /data" in write.status.message
        assert isinstance(event, Event) and event.reason == "InvalidSpec"


# -- where KubeRay cannot read the Ray job (rayAuth secret, KubeRay < 1.5.1) -----------------------

SECRET = OperatorSettings(ray_auth="secret")
COMPLETE = (
    '# TYPE fp8rl_run_complete gauge\nfp8rl_run_complete{job="j",namespace="team-a",recipe="fp8-e2e"} 1.0\n'
)
UNREAD = "JobDeploymentStatusTransitionGracePeriodExceeded"


def secret_case(st: JobStatus, deployment: str, metrics: str | None, **extra: Any) -> list[Action]:
    obj = rljob(st)
    body = builders.rayjob(rl.RLJob.of(obj), SECRET)
    body["metadata"]["uid"] = RAYJOB_UID
    body["status"] = {"jobDeploymentStatus": deployment, "jobStatus": "", **extra}
    observed = Observed(body, configmap(obj), policy(obj, SECRET))
    return plan(obj, observed, SECRET, metrics, now=NOW)


def test_a_driver_serving_its_metrics_is_running_though_kuberay_cannot_tell() -> None:
    starting = status("Starting", "RayClusterStarting", STARTING, STARTED)
    # KubeRay: Running, job status unknown (its reads are refused without the token)
    assert without_attempts(secret_case(starting, "Running", None), rljob(starting))[0] == WriteStatus(
        status("Starting", "DriverStarting", "driver not submitted yet", STARTED)
    )
    message = "the driver serves its metrics (KubeRay has not read the Ray job)"
    actions = secret_case(starting, "Running", exposition(3, 0.5))
    [write] = [a for a in actions if isinstance(a, WriteStatus)]
    assert (write.status.phase, write.status.reason, write.status.message) == ("Running", "Training", message)
    assert write.status.progress.step == 3 and write.status.progress.reward == 0.5
    assert Event("Normal", "Running", f"Training: {message}") in actions


def test_the_drivers_word_decides_the_outcome_kuberay_could_not_read() -> None:
    grace = {
        "reason": UNREAD,
        "message": "The RayJob submitter finished at ... but the ray job did not reach terminal state",
    }
    running = status("Running", "Training", "m", STARTED, RUNNING, step=10, total_steps=10)
    # the driver, lingering after its last step, says it is complete: recorded on the RLJob
    actions = secret_case(running, "Running", exposition(10, 0.9) + COMPLETE)
    [write] = [a for a in actions if isinstance(a, WriteStatus)]
    [done] = [c for c in write.status.conditions if c.type == "DriverCompleted"]
    assert done.status and done.message == "the driver reported every step done (fp8rl_run_complete)"
    # ... and when KubeRay gives up for want of the outcome, the job succeeded
    completed = running.model_copy(update={"conditions": [*running.conditions, done]})
    actions = secret_case(completed, "Failed", None, **grace)
    [write] = [a for a in actions if isinstance(a, WriteStatus)]
    assert write.status.phase == "Succeeded" and write.status.reason == "Completed"
    assert write.status.message == (
        "the driver reported every step done (fp8rl_run_complete); KubeRay could not read the Ray job"
    )
    # without the driver's word it failed, and the message says where to look
    actions = secret_case(running, "Failed", None, **grace)
    [write] = [a for a in actions if isinstance(a, WriteStatus)]
    assert write.status.phase == "Failed" and write.status.reason == UNREAD
    assert "did not report every step done: its log is on the head pod" in write.status.message


@pytest.mark.parametrize(
    ("cluster", "field"),
    [
        ({"priorityClassName": "system-node-critical"}, "spec.cluster.priorityClassName"),
        (
            {"generation": {"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}}},
            "generation.nodeSelector",
        ),
        ({"training": {"tolerations": [{"operator": "Exists"}]}}, "spec.cluster.training.tolerations.0"),
        ({"queue": {"scheduler": "kueue", "name": "other-team"}}, "spec.cluster.queue"),
        ({"volumeClaim": "other-teams-data"}, "spec.cluster.volumeClaim"),
    ],
)
def test_placement_beyond_the_tenants_policy_fails_naming_the_field(
    cluster: dict[str, Any], field: str
) -> None:
    """Issue 49's attacks on scheduling: each refused (InvalidSpec, no RayJob) unless the namespace's
    policy lists it."""
    obj = rljob(cluster=cluster)
    actions = plan(obj, Observed(), SETTINGS, now=NOW)
    assert not any(isinstance(a, CreateRayJob) for a in actions)
    [write] = [a for a in actions if isinstance(a, WriteStatus)]
    assert write.status.reason == "InvalidSpec" and field in write.status.message, write.status.message
    assert "tenants[].jobPolicy" in write.status.message
    # listed for this namespace (and only there), the same ask is fine
    listed = {
        "priorityClassName": {"priorityClasses": ["system-node-critical"]},
        "generation": {"nodeSelectors": [{"node-role.kubernetes.io/control-plane": ""}]},
        "training": {"tolerations": [{"operator": "Exists"}]},
        "queue": {"queues": ["kueue/other-team"]},
        "volumeClaim": {"volumeClaims": ["other-teams-data"]},
    }[next(iter(cluster))]
    namespace = obj["metadata"]["namespace"]
    allowed = OperatorSettings(job_policies={namespace: listed})
    assert any(isinstance(a, CreateRayJob) for a in plan(obj, Observed(), allowed, now=NOW))
    elsewhere = OperatorSettings(job_policies={"another-team": listed})
    assert not any(isinstance(a, CreateRayJob) for a in plan(obj, Observed(), elsewhere, now=NOW))
