"""The driver's log warns when a step's responses are mostly truncated or unreadable: above half,
once per run and fraction, with the step, the fraction and what to do."""

from __future__ import annotations

from rljob import parse_spec
from workers.job.response_watch import RESPONSE_WARNING_FRACTION, response_warnings

SPEC = parse_spec({"rollout": {"max_new_tokens": 24}, "task": {"answer_format": "last-number"}})


def test_the_threshold_is_half() -> None:
    assert RESPONSE_WARNING_FRACTION == 0.5


def test_a_fraction_above_half_is_said_once_with_what_to_do() -> None:
    warned: set[str] = set()
    row = {"step": 3, "response/truncated_fraction": 0.75, "response/unreadable_fraction": 0.5}
    [truncated] = response_warnings(SPEC, row, warned)  # 0.5 is not above half: no warning
    assert truncated.startswith(
        "warning: step 3: 75% of the training responses hit rollout.max_new_tokens (24)"
    )
    assert "response/truncated_fraction 0.75" in truncated
    assert "Raise rollout.max_new_tokens" in truncated and "task.chat_template" in truncated
    assert warned == {"response/truncated_fraction"}
    # the next steps: the truncated fraction is not said again; the unreadable one, once above half
    later = {"step": 4, "response/truncated_fraction": 1.0, "response/unreadable_fraction": 0.7}
    [unreadable] = response_warnings(SPEC, later, warned)
    assert unreadable.startswith("warning: step 4: 70% of the training responses gave no answer readable")
    assert (
        "task.answer_format last-number" in unreadable and "response/unreadable_fraction 0.70" in unreadable
    )
    assert response_warnings(SPEC, later, warned) == []


def test_validation_lines_are_watched_too() -> None:
    warned: set[str] = set()
    row0 = {"step": 0, "val/accuracy": 0.0, "val/truncated_fraction": 0.0, "val/unreadable_fraction": 1.0}
    [line] = response_warnings(SPEC, row0, warned)
    assert line.startswith("warning: step 0: 100% of the held-out responses gave no answer readable")
    assert response_warnings(SPEC, {"step": 1, "reward/mean": 0.0}, warned) == []  # keys absent: quiet
