"""Data-plane faults on real local Ray (workers.rl.faults, the driver's recovery): a generator's
process killed, its engine failing, a call that hangs, a trainer's process killed, in the
synchronous and the asynchronous loop. Each run must finish with every step exactly once, the
fault counted, and no step trained twice: the trainer's Adam step count in the last checkpoint
is the job's optimizer steps, and a synchronous run recovered in place logs the same numbers as
the same run without the fault (same seeds, same weights: nothing lost, nothing repeated)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from rljob import JobSpec, parse_spec
from rljob.metrics import FAULT_KEYS, MetricsLog
from tests import helpers
from tests.helpers import ONE_DIGIT_SUMS
from workers.job.driver import RunOptions, run
from workers.models import checkpoint
from workers.rl.faults import FaultDrill, RestartLimitError

STEPS = 5


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    yield
    ray.shutdown()


def spec(
    staleness: int = 0,
    checkpoint_interval: int = 10,
    precision: dict[str, Any] | None = None,
    **resources: Any,
) -> JobSpec:
    """The tiny job, 5 steps; by default BF16, and no checkpoint before the last step."""
    return parse_spec(
        helpers.tiny_spec(
            task={"params": ONE_DIGIT_SUMS, "size": 50},
            rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3, "max_staleness": staleness},
            warmup={"sft_steps": 1, "batch_size": 4},
            precision=precision or {"recipe": "bf16"},
            steps=STEPS,
            checkpoint_interval=checkpoint_interval,
            resources={"hang_timeout_s": 10.0, "startup_timeout_s": 120.0, **resources},
        )
    )


def drilled(job: JobSpec, out: Path, *drills: str) -> list[dict[str, Any]]:
    lines: list[str] = []
    result = run(job, out, RunOptions(log=lines.append, drills=[FaultDrill.parse(d) for d in drills]))
    assert result.last_step == STEPS and not result.stopped
    rows = MetricsLog(out / "metrics.jsonl").rows()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step exactly once
    return rows


def totals(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {k: sum(float(r.get(k, 0.0)) for r in rows) for k in FAULT_KEYS}


def adam_steps(out: Path) -> float:
    """The optimizer steps the trainer took, read from the last checkpoint (one per RL step here:
    ``algorithm.minibatches`` is 1); a step trained twice would show as one more."""
    last = checkpoint.latest(out)
    assert last is not None and last[0] == STEPS
    state = torch.load(last[1] / "trainer.pt", weights_only=True)["optimizer"]["state"]
    return float(next(iter(state.values()))["step"])


def faults(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The synchronous job without a fault."""
    out = tmp_path_factory.mktemp("reference")
    rows = drilled(spec(), out)
    assert totals(rows) == dict.fromkeys(FAULT_KEYS, 0.0)
    assert adam_steps(out) == STEPS
    return rows


def same_as(rows: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    for key in ("reward/mean", "train/loss", "mismatch/token_mult_prob_error"):
        assert [r.get(key) for r in rows] == [r.get(key) for r in reference], key


@pytest.mark.slow  # real Ray actors killed and restarted: tens of seconds
def test_a_killed_generator_is_replaced_and_its_step_generated_again(
    tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    """SIGKILL inside generate of step 3, no checkpoint before step 5: no step is lost or
    recomputed; the job goes on with fresh actors and the trainer's weights of step 2."""
    rows = drilled(spec(), tmp_path, "generator:kill@3")
    assert totals(rows) == {
        "faults/generator_restarts": 1.0,
        "faults/trainer_restarts": 0.0,
        "faults/steps_recomputed": 0.0,
    }
    assert rows[2]["faults/generator_restarts"] == 1.0  # counted in the step it hit
    assert adam_steps(tmp_path) == STEPS
    same_as(rows, reference)
    (entry,) = faults(tmp_path)
    assert (entry["role"], entry["index"], entry["step"], entry["call"]) == ("generator", 0, 3, "generate")
    assert "died" in entry["what"] and entry["steps_recomputed"] == 0


@pytest.mark.slow
def test_a_replaced_generator_gets_the_kv_cache_scales_the_trainers_kept(tmp_path: Path) -> None:
    """fp8-gen with the FP8 KV cache, rounded in training too: the K/V scales the trainers
    calibrated after step 2 are part of their state, so the actors started again in step 3
    generate and train with them, and the run logs the same numbers as without the fault. (Before,
    the fresh trainers held none: the generator calibrated its own on the prefill and the trainers'
    forward did not round, so step 3 and on differed.)"""
    kv = {"recipe": "fp8-gen", "fp8_kv_cache": True, "fp8_kv_cache_in_training": True}
    reference = drilled(spec(precision=kv), tmp_path / "reference")
    assert all(r["mismatch/token_mult_prob_error"] != 1.0 for r in reference)  # FP8: a mismatch to see
    rows = drilled(spec(precision=kv), tmp_path / "drilled", "generator:kill@3")
    assert totals(rows)["faults/generator_restarts"] == 1.0
    same_as(rows, reference)


@pytest.mark.slow
def test_a_killed_trainer_resumes_in_place_from_the_last_checkpoint(
    tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    """Checkpoints at steps 2 and 4; the trainer killed inside train_step of step 4: back to step
    2's checkpoint, step 3 computed again (its line replaced), the rest as without the fault."""
    rows = drilled(spec(checkpoint_interval=2), tmp_path, "trainer:kill@4")
    assert totals(rows) == {
        "faults/generator_restarts": 0.0,
        "faults/trainer_restarts": 1.0,
        "faults/steps_recomputed": 1.0,
    }
    assert adam_steps(tmp_path) == STEPS
    same_as(rows, reference)
    (entry,) = faults(tmp_path)
    assert (entry["role"], entry["step"], entry["call"], entry["steps_recomputed"]) == (
        "trainer",
        4,
        "train_step",
        1,
    )


@pytest.mark.slow
def test_an_engine_failure_and_a_hung_generate_are_generator_faults(
    tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    """generate raises an engine failure in step 2 and never returns in step 4 (its bound:
    max(10 s, 10 x the recent generate calls)); both recovered with nothing lost."""
    rows = drilled(spec(), tmp_path, "generator:raise@2", "generator:hang@4")
    assert totals(rows)["faults/generator_restarts"] == 2.0
    assert [r["faults/generator_restarts"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 0.0]
    same_as(rows, reference)
    raised, hung = faults(tmp_path)
    assert "InjectedFault" in raised["what"] and raised["step"] == 2
    assert "no answer" in hung["what"] and hung["call"] == "generate" and hung["step"] == 4


@pytest.mark.slow
def test_a_hung_trainer_call_goes_back_to_the_checkpoint(tmp_path: Path) -> None:
    rows = drilled(spec(checkpoint_interval=2), tmp_path, "trainer:hang@3")
    assert totals(rows)["faults/trainer_restarts"] == 1.0
    assert totals(rows)["faults/generator_restarts"] == 0.0  # the idle generator is not blamed
    assert adam_steps(tmp_path) == STEPS
    (entry,) = faults(tmp_path)
    assert (entry["role"], entry["call"], entry["step"]) == ("trainer", "train_step", 3)
    assert "no answer" in entry["what"] and entry["steps_recomputed"] == 0  # checkpoint of step 2


@pytest.mark.slow  # real Ray actors killed and restarted: tens of seconds
def test_asynchronous_a_batch_in_flight_when_its_generator_dies_is_generated_again(tmp_path: Path) -> None:
    """max_staleness 1: batches 3 and 4 are in flight when the generator dies; each step is
    trained once (the Adam count), from batches generated again by the fresh generator."""
    rows = drilled(spec(staleness=1), tmp_path, "generator:kill@3")
    assert totals(rows)["faults/generator_restarts"] == 1.0
    assert totals(rows)["faults/trainer_restarts"] == 0.0
    assert adam_steps(tmp_path) == STEPS


@pytest.mark.slow
def test_asynchronous_a_killed_trainer_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    rows = drilled(spec(staleness=1, checkpoint_interval=2), tmp_path, "trainer:kill@4")
    assert totals(rows)["faults/trainer_restarts"] == 1.0
    assert totals(rows)["faults/steps_recomputed"] == 1.0
    assert adam_steps(tmp_path) == STEPS


@pytest.mark.slow
def test_asynchronous_an_engine_failure_and_a_hang_are_recovered(tmp_path: Path) -> None:
    rows = drilled(spec(staleness=1), tmp_path, "generator:raise@2", "generator:hang@4")
    assert totals(rows)["faults/generator_restarts"] == 2.0
    assert adam_steps(tmp_path) == STEPS


@pytest.mark.slow  # real Ray actors killed and restarted: tens of seconds
def test_more_faults_than_the_bound_fail_the_job_naming_the_field(tmp_path: Path) -> None:
    job = spec(max_generator_restarts=0)
    with pytest.raises(RestartLimitError, match=r"resources\.max_generator_restarts \(0\)"):
        run(job, tmp_path, RunOptions(log=lambda line: None, drills=[FaultDrill.parse("generator:kill@2")]))
    # what was done before the fault is kept: a resume goes on from it
    assert [r["step"] for r in MetricsLog(tmp_path / "metrics.jsonl").rows()] == [1]
