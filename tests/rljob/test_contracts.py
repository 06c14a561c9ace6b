"""The contracts in ``rljob`` that several tiers read: metric keys, algorithm names, reasons."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rljob import metrics, prometheus
from rljob.algorithms import AGGREGATIONS, IS_MODES, RECIPES
from rljob.status import ACTIONS, Reason

CRD = Path(__file__).resolve().parents[2] / "helm" / "fp8rl" / "crds" / "rljobs.fp8rl.io.yaml"


def key_constants() -> dict[str, str]:
    """The JSONL keys among the module's constants (not the exporter's own Prometheus names,
    ``fp8rl_run_complete`` and ``fp8rl_driver_attempt``, which no row carries)."""
    return {
        name: value
        for name, value in vars(metrics).items()
        if name.isupper()
        and isinstance(value, str)
        and name not in ("LABELS",)
        and not value.startswith("fp8rl_")
    }


def test_every_key_constant_is_a_field_of_the_typed_row_and_back() -> None:
    # the lag-0 mismatch keys are named by lag0_key, not by constants of their own
    typed = {k for k in metrics.ValidatedStepMetrics.__annotations__ if not k.startswith("mismatch_lag0/")}
    constants = set(key_constants().values())
    assert constants == typed, (constants - typed, typed - constants)
    assert len(key_constants()) == len(constants)  # no two constants share a key


def test_every_prometheus_series_reads_a_key_of_the_row() -> None:
    typed = set(metrics.ValidatedStepMetrics.__annotations__)
    assert {m.key for m in prometheus.PROMETHEUS} <= typed
    optional = set(metrics.ValidationMetrics.__annotations__)
    for m in prometheus.PROMETHEUS:  # a series only some steps have is exported from its first step
        assert m.every_step == (m.key not in optional), m.key
    # the phases of fp8rl_step_duration_seconds are timing/<phase>_s keys of the row
    assert {f"timing/{p}_s" for p in prometheus.PHASES} <= typed


def test_required_keys_are_the_keys_of_every_step() -> None:
    assert set(metrics.REQUIRED_KEYS) == set(metrics.StepMetrics.__required_keys__)
    assert not set(metrics.REQUIRED_KEYS) & set(metrics.ValidationMetrics.__annotations__)
    assert not set(metrics.REQUIRED_KEYS) & set(metrics.AsyncMetrics.__annotations__)
    # the lag-0 split names every mismatch metric once more, and nothing else
    lag0 = {k for k in metrics.AsyncMetrics.__annotations__ if k.startswith("mismatch_lag0/")}
    assert lag0 == {metrics.lag0_key(k) for k in metrics.MismatchMetrics.__annotations__}
    assert {"step", "reward/mean", "mismatch/token_mult_prob_error", "weight_sync/bytes"} <= set(
        metrics.REQUIRED_KEYS
    )


def _enum_of(schema: dict[str, Any], *path: str) -> list[str]:
    node = schema
    for part in path:
        node = node["properties"][part]
    return list(node["enum"])


def test_algorithm_names_are_the_ones_the_crd_accepts() -> None:
    """An independent source: the generated CRD's enums (what the API server would accept)."""
    crd = yaml.safe_load(CRD.read_text())
    job = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["job"]
    assert list(RECIPES) == _enum_of(job, "precision", "recipe") == ["bf16", "fp8-gen", "fp8-e2e"]
    assert list(IS_MODES) == _enum_of(job, "algorithm", "importance_sampling", "mode")
    assert "icepop" in IS_MODES and "none" in IS_MODES
    assert list(AGGREGATIONS) == _enum_of(job, "algorithm", "loss_aggregation")


def test_every_user_action_has_its_reason() -> None:
    """The control plane records these; the operator acts on ``UserResumed`` (one constant now,
    where a hand-kept copy had to equal ``f"User{action.capitalize()}d"``)."""
    assert {a: str(Reason.of_action(a)) for a in ACTIONS} == {
        "suspend": "UserSuspended",
        "resume": "UserResumed",
        "cancel": "UserCancelled",
    }
