"""PromExporter: validation gauges appear from the first step that validated and hold their value;
the validation phase of the step time is 0 on the steps between validations."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rljob.metrics import PROMETHEUS
from workers.metrics import PromExporter

LABELS = {"job": "j", "namespace": "team-a", "recipe": "fp8-e2e"}


def samples(exporter: PromExporter) -> dict[tuple[str, str], float]:
    """(sample name, phase label or "") -> value, for this job's labels."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(exporter.registry).decode()):
        for s in family.samples:
            if {k: s.labels.get(k) for k in LABELS} == LABELS:
                out[(s.name, s.labels.get("phase", ""))] = s.value
    return out


def test_validation_gauges_follow_the_rows_that_have_them() -> None:
    assert {m.key: (m.name, m.kind) for m in PROMETHEUS if m.key.startswith("val/")} == {
        "val/accuracy": ("fp8rl_val_accuracy", "gauge"),
        "val/reward_mean": ("fp8rl_val_reward_mean", "gauge"),
    }
    exp = PromExporter(**LABELS)
    exp.observe({"step": 1, "reward/mean": 0.25, "timing/generation_s": 2.0})
    first = samples(exp)
    assert first[("fp8rl_step", "")] == 1 and first[("fp8rl_reward_mean", "")] == 0.25
    # no validation yet: no series at all (a 0 would read as "0% accurate")
    assert not {name for name, _ in first} & {"fp8rl_val_accuracy", "fp8rl_val_reward_mean"}
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
