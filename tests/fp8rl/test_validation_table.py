"""``fp8rl report``'s validation table (the FP8 papers' table): worked by hand."""

from __future__ import annotations

import math

import pytest

from fp8rl.report import format_validation_table, validation_table


def row(variant: str, seed: int, first: float, last: float, tmpe: float = 1.0) -> dict[str, object]:
    return {
        "variant": variant,
        "seed": seed,
        "val_first": first,
        "val_accuracy": last,
        "token_mult_prob_error": tmpe,
    }


def test_means_standard_errors_and_paired_intervals_by_hand() -> None:
    runs = [row("bf16", s, f, v) for s, f, v in ((0, 0.1, 0.5), (1, 0.1, 0.6), (2, 0.5, 0.7))]
    runs += [row("fp8-e2e", s, f, v, 1.01) for s, f, v in ((0, 0.3, 0.4), (1, 0.1, 0.6), (2, 0.1, 0.5))]
    runs += [row("fp8-gen-no-is", 0, 0.2, 0.3, 1.02)]  # one seed: no interval
    table = {r["variant"]: r for r in validation_table(runs)}
    bf16, e2e, gen = table["bf16"], table["fp8-e2e"], table["fp8-gen-no-is"]
    # bf16: 0.5, 0.6, 0.7 -> mean 0.6, sd 0.1, se 0.1/sqrt(3); every seed rose >= 0.15 to >= 0.3
    assert bf16["val_accuracy"] == pytest.approx((0.6, 0.1 / math.sqrt(3)))
    assert bf16["diff"] is None and bf16["learned"] == 3
    # fp8-e2e - bf16 per seed: -0.1, 0.0, -0.2 -> mean -0.1, sd 0.1; t(0.975, 2 df) = 4.303
    half = 4.303 * 0.1 / math.sqrt(3)
    d_mean, low, high, n = e2e["diff"]
    assert (d_mean, low, high, n) == pytest.approx((-0.1, -0.1 - half, -0.1 + half, 3))
    assert e2e["token_mult_prob_error"] == pytest.approx(1.01) and e2e["learned"] == 2  # seed 0 rose 0.1 only
    assert gen["runs"] == 1 and math.isnan(gen["diff"][1]) and gen["learned"] == 0  # rose 0.1 only
    text = format_validation_table(list(table.values()))
    assert "fp8-e2e" in text and "-0.100 [-0.348, +0.148] (n=3)" in text and "3/3" in text
