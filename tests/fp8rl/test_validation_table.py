"""``fp8rl report``'s validation table (the FP8 papers' table): worked by hand."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

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


def test_seed_mean_by_hand() -> None:
    """The per-variant curve of ``fp8rl report``: mean and standard error over seeds, on the steps
    every seed reached (a run cut short at step 2 leaves step 3 out), NaN ignored."""
    from fp8rl.report import seed_mean

    a = [(1, 1.0), (2, 2.0), (3, 3.0)]
    b = [(1, 3.0), (2, 4.0)]
    c = [(1, 2.0), (2, math.nan), (3, 9.0)]
    steps, mean, err = seed_mean([a, b, c])
    assert steps == [1, 2]
    # step 1: 1, 3, 2 -> mean 2, sd 1, se 1/sqrt(3); step 2: 2, 4 (NaN left out) -> 3, sd sqrt(2), se 1
    assert mean == pytest.approx([2.0, 3.0])
    assert err == pytest.approx([1 / math.sqrt(3), 1.0])
    assert seed_mean([]) == ([], [], [])


def test_report_draws_one_curve_per_variant_over_seeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several seeds of a variant give one line per variant (its label names n); --per-run keeps
    one line per run."""
    from matplotlib.figure import Figure

    from fp8rl import report as rep

    def run(variant: str, seed: int, offset: float) -> rep.Run:
        rows = [{"step": 0, "val/accuracy": 0.1}] + [
            {"step": s, "reward/mean": offset + s / 10, "val/accuracy": 0.5 if s == 4 else None}
            for s in range(1, 5)
        ]
        return rep.Run(f"{variant}-seed{seed}", variant.removesuffix("-no-is"), rows, variant, seed)

    runs = [run(v, s, s / 10) for v in ("bf16", "fp8-gen") for s in range(3)]
    drawn: list[list[str]] = []
    save = Figure.savefig

    def spy(fig: Figure, *args: Any, **kwargs: Any) -> None:
        drawn.append([str(ln.get_label()) for ln in fig.axes[0].get_lines()])
        save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    out = rep.report(runs, tmp_path / "by-variant.png", window=1)
    rep.report(runs, tmp_path / "per-run.png", window=1, by_variant=False)
    assert out.stat().st_size > 0
    assert [x for x in drawn[0] if not x.startswith("_")] == ["bf16 (n=3)", "fp8-gen (n=3)"]
    assert len([x for x in drawn[1] if "val" not in x and not x.startswith("_")]) == 6


@pytest.mark.parametrize(
    ("precision", "is_mode", "variant"),
    [
        ({"recipe": "bf16"}, "none", "bf16"),  # bf16 has no importance sampling to turn off
        ({"recipe": "fp8-gen"}, "tis", "fp8-gen"),
        ({"recipe": "fp8-gen"}, "none", "fp8-gen-no-is"),
        ({"recipe": "fp8-e2e", "fp8_kv_cache": True}, "tis", "fp8-e2e+fp8-kv"),
        ({"recipe": "fp8-gen", "fp8_kv_cache": True}, "none", "fp8-gen-no-is+fp8-kv"),
        (
            {"recipe": "fp8-gen", "fp8_kv_cache": True, "mismatch_slo": {"action": "respond"}},
            "tis",
            "fp8-gen+fp8-kv+respond",
        ),
        (
            {
                "recipe": "fp8-gen",
                "fp8_kv_cache": True,
                "mismatch_slo": {"action": "respond", "tail_fraction": 0},
            },
            "tis",
            "fp8-gen+fp8-kv+respond-tail0",
        ),
        ({"recipe": "fp8-gen", "mismatch_slo": {"action": "alert-only"}}, "tis", "fp8-gen"),
    ],
)
def test_a_runs_variant_names_what_sets_it_apart(
    tmp_path: Path, precision: dict[str, Any], is_mode: str, variant: str
) -> None:
    import json

    from fp8rl.report import load_run

    spec = {
        "precision": precision,
        "algorithm": {"importance_sampling": {"mode": is_mode}},
        "rollout": {"seed": 3},
    }
    (tmp_path / "spec.resolved.json").write_text(json.dumps(spec))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    run = load_run(tmp_path)
    assert (run.variant, run.seed, run.recipe) == (variant, 3, precision["recipe"])


def test_first_and_final_reward_never_share_a_step() -> None:
    """A 10-step run: first reward = mean of steps 1-5, final = mean of steps 6-10 (by hand);
    a 25-step run: the first and last 10."""
    import fp8rl.report as rep

    rewards = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    rows = [
        {"step": i + 1, "reward/mean": r, "mismatch/token_mult_prob_error": 1.0}
        for i, r in enumerate(rewards)
    ]
    (short,) = rep.summary([rep.Run("r", "bf16", rows)])
    assert short["first_reward"] == pytest.approx(0.3) and short["final_reward"] == pytest.approx(0.8)
    long_rows = [
        {"step": i + 1, "reward/mean": float(i), "mismatch/token_mult_prob_error": 1.0} for i in range(25)
    ]
    (full,) = rep.summary([rep.Run("r", "bf16", long_rows)])
    assert full["first_reward"] == pytest.approx(4.5) and full["final_reward"] == pytest.approx(19.5)
