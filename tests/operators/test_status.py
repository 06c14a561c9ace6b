"""The operator's pure status logic: RayJob status -> RLJob phase (a hand-written table from
KubeRay's documented states), paths through the state machine, and progress from a real
Prometheus exposition of the driver's exporter."""

from __future__ import annotations

from typing import Any

import pytest

from operators.status import advance, gauges_of, path, progress_of, target_of, with_precision
from rljob.mismatch_slo import MismatchSloSpec
from rljob.status import JobStatus, Phase
from workers.job.prom_exporter import PromExporter


def rayjob(deployment: str, job: str = "", **extra: Any) -> dict[str, Any]:
    return {"status": {"jobDeploymentStatus": deployment, "jobStatus": job, **extra}}


@pytest.mark.parametrize(
    ("deployment", "job", "suspend", "phase", "reason"),
    [
        ("", "", False, Phase.STARTING, "RayClusterStarting"),
        ("Initializing", "", False, Phase.STARTING, "RayClusterStarting"),
        ("Waiting", "", False, Phase.STARTING, "RayClusterStarting"),
        ("Running", "PENDING", False, Phase.STARTING, "DriverStarting"),
        ("Running", "RUNNING", False, Phase.RUNNING, "Training"),
        ("Retrying", "", False, Phase.STARTING, "Retrying"),
        ("Complete", "SUCCEEDED", False, Phase.SUCCEEDED, "Completed"),
        ("Complete", "FAILED", False, Phase.FAILED, "DriverFailed"),
        ("Complete", "STOPPED", False, Phase.FAILED, "DriverStopped"),
        ("Failed", "", False, Phase.FAILED, "RayJobFailed"),
        ("ValidationFailed", "", False, Phase.FAILED, "RayJobValidationFailed"),
        ("Suspended", "", False, Phase.PENDING, "RayJobSuspended"),  # resuming, or Kueue holding it
        ("Running", "RUNNING", True, Phase.SUSPENDED, "Suspended"),  # the user asked; KubeRay follows
        ("Suspended", "", True, Phase.SUSPENDED, "Suspended"),
    ],
)
def test_target_of(deployment: str, job: str, suspend: bool, phase: Phase, reason: str) -> None:
    got = target_of(rayjob(deployment, job), suspend)
    assert (got[0], got[1]) == (phase, reason)


def test_failure_keeps_kuberays_reason_and_message() -> None:
    got = target_of(rayjob("Failed", reason="DeadlineExceeded", message="ran past 3600 s"), False)
    assert got == (Phase.FAILED, "DeadlineExceeded", "ran past 3600 s")


def test_paths_through_the_state_machine() -> None:
    assert path(Phase.PENDING, Phase.RUNNING) == [Phase.STARTING, Phase.RUNNING]
    assert path(Phase.SUSPENDED, Phase.RUNNING) == [Phase.PENDING, Phase.STARTING, Phase.RUNNING]
    assert path(Phase.FAILED, Phase.STARTING) == [Phase.PENDING, Phase.STARTING]
    assert path(Phase.RUNNING, Phase.RUNNING) == []
    assert path(Phase.RUNNING, Phase.STARTING) == [Phase.STARTING]  # the Ray job restarted
    assert path(Phase.SUCCEEDED, Phase.RUNNING) is None


def test_advance_records_each_phase_and_leaves_finished_jobs() -> None:
    status, passed = advance(JobStatus(), (Phase.RUNNING, "Training", "step 1"))
    assert passed == [Phase.STARTING, Phase.RUNNING] and status.phase is Phase.RUNNING
    assert [c.type for c in status.conditions] == ["Starting", "Running"]
    done, _ = advance(status, (Phase.SUCCEEDED, "Completed", ""))
    again, passed = advance(done, (Phase.RUNNING, "Training", ""))
    assert again is done and passed == []


def test_progress_from_the_drivers_exposition() -> None:
    from prometheus_client import generate_latest

    exporter = PromExporter(job="j1", namespace="team-a", recipe="fp8-e2e")
    exporter.observe(
        {
            "step": 7,
            "reward/mean": 0.25,
            "throughput/generation_tokens_per_s": 1234.5,
            "mismatch/token_mult_prob_error": 1.0021,
        }
    )
    progress = progress_of(generate_latest(exporter.registry).decode(), total_steps=20)
    assert progress is not None
    assert (progress.step, progress.total_steps, progress.reward) == (7, 20, 0.25)
    assert progress.generation_tokens_per_s == 1234.5 and progress.token_mult_prob_error == 1.0021
    assert progress_of("", 20) is None


def test_the_precision_actions_condition_follows_the_driver_s_gauge() -> None:
    """``fp8rl_precision_actions`` from a real exposition: 2 actions in effect make condition
    PrecisionActions True with a Warning event; the same count again says nothing; all undone
    (relax) makes it False with a Normal event; a job with ``action: alert-only`` gets none."""
    from prometheus_client import generate_latest

    respond = MismatchSloSpec(action="respond")
    exporter = PromExporter(job="j1", namespace="team-a", recipe="fp8-gen")

    def gauges(count: float) -> dict[str, float]:
        exporter.observe({"step": 3, "precision/actions": count})
        return gauges_of(generate_latest(exporter.registry).decode())

    status = JobStatus()
    status, events = with_precision(status, gauges(2), respond)
    (cond,) = [c for c in status.conditions if c.type == "PrecisionActions"]
    assert (cond.status, cond.reason) == (True, "PrecisionRaised")
    assert "2 precision action(s) in effect" in cond.message
    assert [(e.type, e.reason) for e in events] == [("Warning", "PrecisionRaised")]
    assert with_precision(status, gauges(2), respond)[1] == []
    status, events = with_precision(status, gauges(0), respond)
    (cond,) = [c for c in status.conditions if c.type == "PrecisionActions"]
    assert (cond.status, cond.reason) == (False, "PrecisionAsSpecified")
    assert [(e.type, e.reason) for e in events] == [("Normal", "PrecisionAsSpecified")]
    assert with_precision(JobStatus(), gauges(2), MismatchSloSpec()) == (JobStatus(), [])
    assert with_precision(JobStatus(), {}, respond) == (JobStatus(), [])
