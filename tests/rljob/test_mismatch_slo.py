"""The mismatch SLO's arithmetic (rljob/mismatch_slo.py) on hand-made series: each expected median
and count is worked out by hand in the comment beside it."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from rljob.mismatch_slo import MismatchSloSpec, default_bounds, evaluate
from rljob.spec import parse_spec

DEFAULT = MismatchSloSpec()


def test_the_recipes_defaults() -> None:
    assert default_bounds(DEFAULT, "bf16") == (1.1, 1.1)
    assert default_bounds(DEFAULT, "fp8-e2e") == (1.1, 1.1)
    assert default_bounds(DEFAULT, "fp8-gen") == (1.25, 1.5)
    own = MismatchSloSpec(median=1.05, tail_bound=2.0)
    assert default_bounds(own, "fp8-gen") == (1.05, 2.0)
    assert parse_spec({}).precision.mismatch_slo == DEFAULT  # every job has one


def test_one_spike_in_a_window_is_allowed_and_two_are_a_breach() -> None:
    # sorted 1.1 1.2 1.2 1.3 1.6: median 1.2 <= 1.25; one step (1.6) above 1.5, floor(0.1 x 10) = 1 allowed
    state = evaluate([1.2, 1.1, 1.3, 1.6, 1.2], DEFAULT, "fp8-gen")
    assert state is not None and state.met
    assert (state.steps, state.median, state.tail_steps, state.tail_allowed) == (5, 1.2, 1, 1)
    # sorted 1.1 1.2 1.2 1.3 1.6 1.7: median (1.2 + 1.3) / 2 = 1.25, not above; two steps above 1.5
    state = evaluate([1.2, 1.1, 1.3, 1.6, 1.2, 1.7], DEFAULT, "fp8-gen")
    assert state is not None and not state.met
    assert state.median == pytest.approx(1.25) and state.tail_steps == 2
    assert state.message("token_mult_prob_error") == "2 step(s) above 1.5 (at most 1 of 10)"


def test_the_window_slides_past_old_spikes() -> None:
    values = [1.6, 1.7] + [1.2] * 10  # the spikes are 11 and 12 steps back
    state = evaluate(values, DEFAULT, "fp8-gen")
    assert state is not None and state.met and state.tail_steps == 0 and state.steps == 10
    state = evaluate(values[:-1], DEFAULT, "fp8-gen")  # 1.7 is the 10th step back: inside
    assert state is not None and state.tail_steps == 1 and state.met


def test_a_median_above_its_bound_breaches_alone() -> None:
    # bf16: sorted 1.05 1.12 1.13, median 1.12 > 1.1; steps above 1.1: 1.12 and 1.13 = 2 > 1
    state = evaluate([1.05, 1.12, 1.13], DEFAULT, "bf16")
    assert state is not None and not state.met
    assert state.message("token_mult_prob_error") == (
        "median token_mult_prob_error 1.1200 over the last 3 step(s) is above 1.1; "
        "2 step(s) above 1.1 (at most 1 of 10)"
    )
    # a lower tail than median: fp8-gen's [1.3, 1.3, 1.4] has median 1.3 > 1.25 and no step above 1.5
    state = evaluate([1.3, 1.3, 1.4], DEFAULT, "fp8-gen")
    assert state is not None and not state.met and state.tail_steps == 0


def test_steps_without_the_metric_are_left_out_and_nothing_is_no_state() -> None:
    assert evaluate([], DEFAULT, "bf16") is None
    assert evaluate([math.nan], DEFAULT, "bf16") is None
    state = evaluate([1.0, math.nan, 1.02], DEFAULT, "bf16")  # median of 1.0 and 1.02 = 1.01
    assert state is not None and state.steps == 2 and state.median == pytest.approx(1.01)
    assert state.message("token_mult_prob_error") == (
        "median token_mult_prob_error 1.0100 over the last 2 step(s) (bound 1.1); "
        "0 step(s) above 1.1 (at most 1 of 10): within the SLO"
    )


def test_tail_fraction_and_window_set_the_steps_allowed() -> None:
    slo = MismatchSloSpec(window=20, tail_fraction=0.25)  # floor(0.25 x 20) = 5
    state = evaluate([1.6] * 5 + [1.0] * 15, slo, "fp8-gen")
    assert state is not None and state.tail_allowed == 5 and state.met
    none_allowed = MismatchSloSpec(tail_fraction=0.0)
    state = evaluate([1.0, 1.51], none_allowed, "fp8-gen")
    assert state is not None and state.tail_allowed == 0 and not state.met


def test_gen_kl_needs_its_bounds_and_bad_values_are_refused() -> None:
    with pytest.raises(ValidationError, match="gen_kl_error has no measured default"):
        MismatchSloSpec(metric="gen_kl_error")
    kl = MismatchSloSpec(metric="gen_kl_error", median=0.01, tail_bound=0.05)
    state = evaluate([0.001, 0.2, 0.004], kl, "fp8-gen")  # median 0.004; one above 0.05
    assert state is not None and state.met and state.tail_steps == 1
    bads = (
        {"window": 0},
        {"tail_fraction": 1.5},
        {"median": -1},
        {"action": "panic"},
        {"attribution_interval": -1},
        {"attribution_interval": 10_001},
        {"attribution_sequences": 0},
        {"attribution_sequences": 17},
    )
    for bad in bads:
        with pytest.raises(ValidationError):
            MismatchSloSpec.model_validate(bad)


def test_a_line_becomes_a_condition_and_its_time_moves_only_when_it_flips() -> None:
    from datetime import UTC, datetime

    from rljob.mismatch_slo import condition_of
    from rljob.status import MISMATCH_SLO, Condition, JobStatus

    assert condition_of({"step": 1}, DEFAULT) is None  # a line without the SLO's keys
    row = {
        "mismatch_slo/median": 1.31,
        "mismatch_slo/median_bound": 1.25,
        "mismatch_slo/tail_steps": 2.0,
        "mismatch_slo/tail_bound": 1.5,
        "mismatch_slo/breached": 1.0,
    }
    met, reason, message = condition_of(row, DEFAULT)  # type: ignore[misc]
    assert not met and reason == "MismatchSLOBreached"
    assert message == (
        "median token_mult_prob_error 1.3100 (bound 1.25); 2 of the last 10 steps above 1.5 "
        "(at most 1): breached"
    )
    then = datetime(2026, 1, 1, tzinfo=UTC)
    s = JobStatus(
        conditions=[
            Condition(type=MISMATCH_SLO, status=False, reason="r", message="old", last_transition=then)
        ]
    )
    same_state = s.with_condition(MISMATCH_SLO, False, "r", "new numbers")
    assert (
        same_state.conditions[0].message == "new numbers" and same_state.conditions[0].last_transition == then
    )
    assert s.with_condition(MISMATCH_SLO, False, "r", "old") is s  # nothing to change
    flipped = s.with_condition(MISMATCH_SLO, True, "r2", "ok")
    assert flipped.conditions[0].status and flipped.conditions[0].last_transition > then
