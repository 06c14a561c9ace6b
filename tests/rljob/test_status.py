"""Job phases: every allowed move works, every other move is refused with a message that says why."""

from __future__ import annotations

import itertools

import pytest

from rljob.status import ACTIONS, ALLOWED, IllegalTransition, JobStatus, Phase, Progress, check_transition

# The machine, written out by hand from the issue (independently of ALLOWED): a job runs
# Pending -> Starting -> Running -> Succeeded; it can fail, be suspended or cancelled while active;
# a suspended or failed job resumes to Pending; a running job whose Ray job restarts (KubeRay
# retrying, or its RayJob recreated) goes back to Starting; Succeeded and Cancelled are final.
LEGAL = {
    ("Pending", "Starting"), ("Pending", "Suspended"), ("Pending", "Failed"), ("Pending", "Cancelled"),
    ("Starting", "Running"), ("Starting", "Suspended"), ("Starting", "Failed"), ("Starting", "Cancelled"),
    ("Starting", "Succeeded"),
    ("Running", "Succeeded"), ("Running", "Suspended"), ("Running", "Failed"), ("Running", "Cancelled"),
    ("Running", "Starting"),
    ("Suspended", "Pending"), ("Suspended", "Cancelled"),
    ("Failed", "Pending"), ("Failed", "Cancelled"),
}  # fmt: skip


@pytest.mark.parametrize(("a", "b"), list(itertools.product(Phase, Phase)))
def test_every_pair_of_phases(a: Phase, b: Phase) -> None:
    if (a.value, b.value) in LEGAL:
        check_transition(a, b)
    else:
        with pytest.raises(IllegalTransition):
            check_transition(a, b)


def test_terminal_phases_have_no_way_out() -> None:
    assert ALLOWED[Phase.SUCCEEDED] == ALLOWED[Phase.CANCELLED] == frozenset()


def test_refusal_names_the_action_and_what_is_allowed() -> None:
    with pytest.raises(IllegalTransition) as info:
        check_transition(Phase.SUCCEEDED, ACTIONS["resume"], "resume")
    assert (
        str(info.value)
        == "cannot resume a job in phase Succeeded; allowed next phases: none (the job is finished)"
    )
    with pytest.raises(IllegalTransition, match="allowed next phases: Cancelled, Pending"):
        check_transition(Phase.SUSPENDED, Phase.RUNNING)


def test_moved_records_reason_and_keeps_one_condition_per_type() -> None:
    s = JobStatus()
    s = s.moved(Phase.STARTING, "RayStarted").moved(Phase.RUNNING, "FirstStep")
    s = s.moved(Phase.SUSPENDED, "UserSuspended", action="suspend").moved(Phase.PENDING, "UserResumed")
    s = s.moved(Phase.STARTING, "RayStarted", "second start")
    assert s.phase is Phase.STARTING and s.reason == "RayStarted" and s.message == "second start"
    assert [c.type for c in s.conditions] == ["Running", "Suspended", "Pending", "Starting"]
    with pytest.raises(IllegalTransition):
        s.moved(Phase.PENDING, "nope")


def test_progress_from_a_metrics_line() -> None:
    row = {"step": 3.0, "reward/mean": 0.5, "throughput/generation_tokens_per_s": 120.0,
           "mismatch/token_mult_prob_error": 1.01}  # fmt: skip
    p = Progress.from_row(row, total_steps=10)
    assert (p.step, p.total_steps, p.reward, p.generation_tokens_per_s, p.token_mult_prob_error) == (
        3,
        10,
        0.5,
        120.0,
        1.01,
    )
