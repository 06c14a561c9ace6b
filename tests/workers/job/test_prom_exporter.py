"""PromExporter: validation gauges appear from the first step that validated and hold their value;
the validation phase of the step time is 0 on the steps between validations."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rljob.prometheus import PROMETHEUS
from workers.job.prom_exporter import PromExporter

LABELS = {"job": "j", "namespace": "team-a", "recipe": "fp8-e2e"}


def samples(exporter: PromExporter) -> dict[tuple[str, str], float]:
    """(sample name, phase or grader label or "") -> value, for this job's labels."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(exporter.registry).decode()):
        for s in family.samples:
            if {k: s.labels.get(k) for k in LABELS} == LABELS:
                out[(s.name, s.labels.get("phase", s.labels.get("grader", "")))] = s.value
    return out


def test_validation_gauges_follow_the_rows_that_have_them() -> None:
    assert {m.key: (m.name, m.kind) for m in PROMETHEUS if m.key.startswith("val/")} == {
        "val/accuracy": ("fp8rl_val_accuracy", "gauge"),
        "val/reward_mean": ("fp8rl_val_reward_mean", "gauge"),
        "val/truncated_fraction": ("fp8rl_val_truncated_fraction", "gauge"),
        "val/unreadable_fraction": ("fp8rl_val_unreadable_fraction", "gauge"),
        "val/pass@1": ("fp8rl_val_pass_at_1", "gauge"),
        "val/pass@k": ("fp8rl_val_pass_at_k", "gauge"),
        "val/pass_k": ("fp8rl_val_pass_k", "gauge"),
    }
    exp = PromExporter(**LABELS)
    exp.observe({"step": 1, "reward/mean": 0.25, "timing/generation_s": 2.0})
    first = samples(exp)
    assert first[("fp8rl_step", "")] == 1 and first[("fp8rl_reward_mean", "")] == 0.25
    # no validation yet: no series at all (a 0 would read as "0% accurate")
    assert not {name for name, _ in first} & {m.name for m in PROMETHEUS if m.key.startswith("val/")}
    assert ("fp8rl_step_duration_seconds", "validation") not in first

    exp.observe({"step": 2, "val/accuracy": 0.75, "val/reward_mean": 0.8, "timing/validation_s": 3.5})
    second = samples(exp)
    assert second[("fp8rl_val_accuracy", "")] == 0.75 and second[("fp8rl_val_reward_mean", "")] == 0.8
    assert second[("fp8rl_step_duration_seconds", "validation")] == 3.5

    exp.observe({"step": 3, "timing/generation_s": 2.5})
    third = samples(exp)
    # the last validation's accuracy holds; this step spent no time validating
    assert third[("fp8rl_val_accuracy", "")] == 0.75 and third[("fp8rl_val_reward_mean", "")] == 0.8
    assert third[("fp8rl_step_duration_seconds", "validation")] == 0.0
    assert third[("fp8rl_step_duration_seconds", "generation")] == 2.5


def test_staleness_series_are_0_for_a_synchronous_job_and_follow_an_asynchronous_one() -> None:
    sync = PromExporter(**LABELS)
    sync.observe({"step": 1, "reward/mean": 0.5})  # a row of rollout.max_staleness 0: no async keys
    series = {k: v for k, v in samples(sync).items() if not k[0].endswith("_created")}  # a counter's
    assert {k: v for k, v in series.items() if "stale" in k[0] or "overlap" in k[0]} == {
        ("fp8rl_policy_staleness", ""): 0.0,
        ("fp8rl_stale_batches_dropped_total", ""): 0.0,
        ("fp8rl_generation_train_overlap_seconds", ""): 0.0,
    }
    exp = PromExporter(**LABELS)
    exp.observe({"step": 1, "staleness/max": 0.0, "staleness/dropped_batches": 0.0, "timing/overlap_s": 0.5})
    exp.observe({"step": 2, "staleness/max": 1.0, "staleness/dropped_batches": 2.0, "timing/overlap_s": 0.25})
    exp.observe({"step": 3, "staleness/max": 1.0, "staleness/dropped_batches": 1.0, "timing/overlap_s": 0.75})
    now = samples(exp)
    assert now[("fp8rl_policy_staleness", "")] == 1.0
    assert now[("fp8rl_stale_batches_dropped_total", "")] == 3.0  # 0 + 2 + 1: a counter
    assert now[("fp8rl_generation_train_overlap_seconds", "")] == 0.75  # the last step's
    assert ("fp8rl_step_duration_seconds", "overlap") not in now  # not a phase of the step


def test_each_graders_series_carries_its_name() -> None:
    exp = PromExporter(**LABELS)
    row = {
        "step": 1,
        "reward/m.valid/mean": 0.5,
        "grader/m.valid/errors": 2.0,
        "grader/m.valid/timeouts": 1.0,
    }
    exp.observe({**row, "grader/m.valid/seconds": 0.25, "reward/m/mean": 0.4})
    exp.observe({**row, "reward/m.valid/mean": 0.75, "grader/m.valid/seconds": 0.5, "reward/m/mean": 0.6})
    got = samples(exp)
    # gauges hold the last step's value; counters add each step's count
    assert (
        got[("fp8rl_grader_reward_mean", "m.valid")] == 0.75 and got[("fp8rl_grader_reward_mean", "m")] == 0.6
    )
    assert got[("fp8rl_grader_errors_total", "m.valid")] == 4.0
    assert got[("fp8rl_grader_timeouts_total", "m.valid")] == 2.0
    assert got[("fp8rl_grader_seconds", "m.valid")] == 0.5


def test_each_layers_share_of_the_mismatch_carries_its_layer() -> None:
    """``mismatch/layer/<i>`` keys become fp8rl_mismatch_layer{layer="<i>"}; a step without them
    leaves the last attribution's values (they are measured every attribution_interval steps)."""
    exp = PromExporter(**LABELS)
    exp.observe({"step": 10, "mismatch/layer/0": 0.125, "mismatch/layer/1": -0.5, "mismatch/layerx": 9.0})
    exp.observe({"step": 11})
    found = {
        s.labels["layer"]: s.value
        for family in text_string_to_metric_families(generate_latest(exp.registry).decode())
        for s in family.samples
        if s.name == "fp8rl_mismatch_layer" and {k: s.labels.get(k) for k in LABELS} == LABELS
    }
    assert found == {"0": 0.125, "1": -0.5}
