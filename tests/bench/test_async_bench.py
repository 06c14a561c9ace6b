"""``fp8rl bench async``: the two variants it runs and how it counts steps/s (the timing itself is
a benchmark, not a test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.async_rl import bench_variant, changed, overlap_ceiling, steps_per_s
from rljob.spec import load_spec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arithmetic-cpu.yaml"


def test_the_variants_differ_in_max_staleness_only_among_what_the_job_computes() -> None:
    base = load_spec(EXAMPLE)
    sync, async_ = bench_variant(base, 0, 7, warmup=False), bench_variant(base, 1, 7, warmup=False)
    assert (sync.rollout.max_staleness, async_.rollout.max_staleness) == (0, 1)
    for spec in (sync, async_):
        res = spec.resources
        assert (res.trainers, res.generators, res.threads_per_actor, res.cpus_per_actor) == (1, 1, 1, 1.0)
        assert (spec.steps, spec.checkpoint_interval, spec.warmup.sft_steps, spec.validation.interval) == (
            7,
            7,
            0,
            0,
        )
        # the same job otherwise: model, task, seeds, recipe
        assert spec.model == base.model and spec.task == base.task and spec.precision == base.precision
        assert spec.rollout.seed == base.rollout.seed and spec.algorithm == base.algorithm


def test_steps_per_s_runs_from_the_end_of_the_skipped_steps() -> None:
    rows = [{"step": s, "time": t} for s, t in [(1, 100.0), (2, 103.0), (3, 104.0), (4, 105.0)]]
    assert steps_per_s(rows, 2) == pytest.approx(2 / 2.0)  # steps 3 and 4, from t=103 to t=105
    assert steps_per_s(rows, 1) == pytest.approx(3 / 5.0)
    with pytest.raises(ValueError, match="--steps must exceed --skip"):
        steps_per_s(rows, 4)


def test_the_ceiling_is_the_synchronous_step_over_the_longer_phase() -> None:
    # generation a quarter of training: 0.25 + 1.0 + 0.05 = 1.30 s against 1.0 + 0.05 = 1.05 s
    assert overlap_ceiling(0.25, 1.0, 0.05) == pytest.approx(1.30 / 1.05)
    assert overlap_ceiling(1.0, 1.0, 0.0) == pytest.approx(2.0)  # equal phases, free sync: 2x
    assert overlap_ceiling(2.0, 0.5, 0.1) == pytest.approx(2.6 / 2.1)  # generation-bound


def test_by_default_the_warm_up_runs_as_shipped_and_every_change_is_named() -> None:
    """The spec as shipped keeps its warm-up (a warmed-up policy answers in fewer tokens, which
    changes the balance the ratio depends on); what the bench does change is listed, by key."""
    base = load_spec(EXAMPLE)
    assert base.warmup.sft_steps > 0 and base.steps != 7
    kept = bench_variant(base, 1, 7)
    assert kept.warmup == base.warmup
    said = changed(base, kept)
    assert f"steps {base.steps!r} -> 7" in said
    assert f"validation.interval {base.validation.interval!r} -> 0" in said
    assert not any(line.startswith(("warmup.", "rollout.max_staleness")) for line in said)
    assert f"warmup.sft_steps {base.warmup.sft_steps!r} -> 0" in changed(
        base, bench_variant(base, 1, 7, False)
    )
