"""The attempts a status records (``operators.attempts``) and the operator's own retries where
KubeRay cannot tell success from failure (``rayAuth: secret``), worked out by hand from the rules
in docs/operator.md: what begins an attempt, what ends one, what a retry costs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from operators import builders
from operators.actions import CreateRayJob, DeleteRayJob, Event, Observed, WriteStatus
from operators.attempts import CAUSE, track
from operators.plan import plan
from operators.settings import OperatorSettings
from rljob import resource as rl
from rljob.status import MAX_ATTEMPTS, Attempt, Condition, JobStatus, Phase

T0 = datetime(2026, 11, 28, 10, 0, tzinfo=UTC)
T1, T2, T3 = (T0 + timedelta(minutes=m) for m in (5, 10, 15))
RUNNING = Phase.RUNNING


def rayjob(
    uid: str, deployment: str = "Running", failed: int = 0, cause: str = "created", **status: Any
) -> dict[str, Any]:
    return {
        "metadata": {"name": "j", "uid": uid, "annotations": {CAUSE: cause}},
        "status": {"jobDeploymentStatus": deployment, "failed": failed, **status},
    }


def attempt_metrics(number: int, previous_exit: str = "") -> str:
    labels = f'job="j",namespace="team-a",recipe="fp8-e2e",previous_exit="{previous_exit}"'
    return f"# TYPE fp8rl_driver_attempt gauge\nfp8rl_driver_attempt{{{labels}}} {number}.0\n"


def first(uid: str = "u1", started: datetime = T0, cause: str = "created") -> Attempt:
    return Attempt(number=1, cluster="new", cause=cause, started=started, ray_job_uid=uid)


def test_the_first_read_of_a_rayjob_begins_attempt_1_and_a_quiet_read_changes_nothing() -> None:
    got = track([], rayjob("u1"), None, RUNNING, "Training", "", T0)
    assert got == [first()]
    assert track(got, rayjob("u1"), attempt_metrics(1), RUNNING, "Training", "", T1) == got
    # a RayJob not read back yet (just built: no uid): nothing begins
    assert track([], {"metadata": {"name": "j"}}, None, Phase.STARTING, "", "", T0) == []


def test_kuberay_retrying_on_a_new_cluster_ends_the_attempt_and_begins_the_next() -> None:
    retrying = rayjob("u1", "Retrying", failed=1, reason="AppFailed")
    got = track([first()], retrying, None, Phase.STARTING, "Retrying", "", T1)
    assert got == [
        first().model_copy(
            update={"outcome": "Failed", "reason": "AppFailed", "finished": T1,
                    "message": "KubeRay runs the job again on a new Ray cluster"}
        ),
        Attempt(number=2, cluster="new", cause="retried", started=T1, ray_job_uid="u1", kuberay_failed=1),
    ]  # fmt: skip
    # KubeRay counts the failure that ends the RayJob too: no attempt 3, attempt 2 ends Failed
    final = rayjob("u1", "Failed", failed=2, reason="AppFailed")
    ended = track(got, final, None, Phase.FAILED, "AppFailed", "the driver failed", T2)
    assert len(ended) == 2 and ended[1].outcome == "Failed" and ended[1].finished == T2
    assert (ended[1].reason, ended[1].message, ended[1].kuberay_failed) == (
        "AppFailed",
        "the driver failed",
        2,
    )


def test_an_in_place_retry_is_an_attempt_on_the_same_cluster() -> None:
    got = track([first()], rayjob("u1"), attempt_metrics(2, "1"), RUNNING, "Training", "", T1)
    assert got[0].outcome == "Failed" and got[0].reason == "DriverExited"
    assert got[0].message == "the driver exited with 1; started again on the same Ray cluster"
    assert got[1] == Attempt(
        number=2, cluster="reused", cause="in-place", started=T1, ray_job_uid="u1", driver_attempt=2
    )


def test_suspend_stops_the_attempt_and_the_resume_begins_one_on_a_new_cluster() -> None:
    stopped = track([first()], rayjob("u1", "Suspended"), None, Phase.SUSPENDED, "Suspended", "m", T1)
    assert stopped[0].outcome == "Stopped" and stopped[0].finished == T1
    resumed = track(stopped, rayjob("u1", "Initializing"), None, Phase.STARTING, "RayClusterStarting", "", T2)
    assert resumed[1] == Attempt(number=2, cluster="new", cause="resumed", started=T2, ray_job_uid="u1")


def test_a_new_rayjob_replaces_the_attempt_with_the_cause_it_was_made_for() -> None:
    got = track([first()], rayjob("u2", cause="recreated"), None, Phase.STARTING, "", "", T1)
    assert (got[0].outcome, got[0].reason) == ("Failed", "RayJobReplaced")
    assert got[1] == Attempt(number=2, cluster="new", cause="recreated", started=T1, ray_job_uid="u2")


def test_the_job_ending_ends_the_attempt_and_only_the_newest_are_kept() -> None:
    done = track([first()], rayjob("u1", "Complete"), None, Phase.SUCCEEDED, "Completed", "done", T3)
    assert (done[0].outcome, done[0].reason, done[0].finished) == ("Succeeded", "Completed", T3)
    many: list[Attempt] = []
    for n in range(1, 26):  # 25 RayJobs, one after another
        many = track(many, rayjob(f"u{n}"), None, RUNNING, "Training", "", T0 + timedelta(minutes=n))
    assert len(many) == MAX_ATTEMPTS and [a.number for a in many] == list(range(6, 26))
    assert all(a.outcome == "Failed" for a in many[:-1]) and many[-1].outcome == "Running"


# -- the operator's retries where KubeRay cannot tell (rayAuth secret) -------------------------------

SECRET = OperatorSettings(ray_auth="secret")
GRACE = "JobDeploymentStatusTransitionGracePeriodExceeded"


def rljob(st: JobStatus, backoff: int) -> dict[str, Any]:
    return {
        "apiVersion": "fp8rl.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "j", "namespace": "team-a", "uid": "uid-1", "resourceVersion": "7"},
        "spec": {"job": {"steps": 10}, "suspend": False, "cluster": {"backoffLimit": backoff}},
        "status": st.model_dump(mode="json"),
    }


def running(*attempts: Attempt, conditions: tuple[Condition, ...] = ()) -> JobStatus:
    return JobStatus(
        phase=Phase.RUNNING,
        reason="Training",
        message="m",
        conditions=list(conditions),
        attempts=list(attempts),
    )


def failed_rayjob(obj: dict[str, Any]) -> dict[str, Any]:
    body = builders.rayjob(rl.RLJob.of(obj), SECRET)
    body["metadata"]["uid"] = "u1"
    body["status"] = {"jobDeploymentStatus": "Failed", "failed": 1, "reason": GRACE, "message": "no outcome"}
    return body


def test_kuberay_is_not_asked_to_retry_what_it_cannot_judge() -> None:
    obj = rljob(running(first()), backoff=2)
    assert builders.rayjob(rl.RLJob.of(obj), SECRET)["spec"]["backoffLimit"] == 0
    assert builders.rayjob(rl.RLJob.of(obj), OperatorSettings())["spec"]["backoffLimit"] == 2


def test_a_failed_attempt_is_retried_on_a_new_cluster_while_retries_are_left() -> None:
    obj = rljob(running(first()), backoff=1)
    actions = plan(obj, Observed(failed_rayjob(obj)), SECRET, None, now=T1)
    message = f"attempt 1 failed ({GRACE}); a new Ray cluster for the next (retry 1 of 1)"
    assert actions[0] == DeleteRayJob("u1")
    [write] = [a for a in actions if isinstance(a, WriteStatus)]
    assert (write.status.phase, write.status.reason, write.status.message) == (
        "Starting",
        "Retrying",
        message,
    )
    [one] = write.status.attempts  # ended with what the job would have said, had it not been retried
    assert (one.outcome, one.reason, one.finished) == ("Failed", GRACE, T1)
    assert one.message == (
        "KubeRay could not read the Ray job's outcome (KubeRay < 1.5.1 with rayAuth: secret) and the "
        "driver did not report every step done: its log is on the head pod (kubectl logs)"
    )
    assert Event("Normal", "Starting", f"Retrying: {message}") in actions
    # once the failed RayJob is gone: the next, made for a retry, says so
    retrying = rljob(write.status, backoff=1)
    actions = plan(retrying, Observed(), SECRET, None, now=T2)
    [create] = [a for a in actions if isinstance(a, CreateRayJob)]
    assert create.event == Event("Warning", "RayJobRetried", "RayJob team-a/j")
    assert create.body["metadata"]["annotations"][CAUSE] == "retried"


def test_no_retry_when_spent_when_the_driver_finished_or_past_the_deadline() -> None:
    spent = Attempt(number=2, cluster="new", cause="retried", started=T1, ray_job_uid="u1")
    for obj in (
        rljob(running(first(), spent), backoff=1),  # the one retry was made
        rljob(running(first()), backoff=0),  # none allowed
        rljob(
            running(
                first(),
                conditions=(Condition(type="DriverCompleted", status=True, reason="DriverCompleted"),),
            ),
            backoff=2,
        ),
    ):
        actions = plan(obj, Observed(failed_rayjob(obj)), SECRET, None, now=T2)
        assert not any(isinstance(a, DeleteRayJob) for a in actions), obj["status"]
    past = rljob(running(first()), backoff=2)
    body = failed_rayjob(past)
    body["status"]["reason"] = "DeadlineExceeded"
    [write, *_] = plan(past, Observed(body), SECRET, None, now=T2)
    assert isinstance(write, WriteStatus) and write.status.phase == "Failed"
