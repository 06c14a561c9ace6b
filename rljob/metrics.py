"""The metrics contract: one JSON line per RL step (``metrics.jsonl``) and the same facts as
Prometheus ``fp8rl_*`` metrics. Every tier that reads or writes a step reads it from here: the
driver writes rows, the trainers' statistics cross Ray in them, the operator reads the Prometheus
gauges back into RLJob status, the control plane serves the log, and the report plots it.

- The key names are constants (``REWARD_MEAN = "reward/mean"``) and a step row is a typed
  ``StepMetrics`` (a ``TypedDict``: still a plain dict in JSON and across Ray; mypy checks every
  key spelled against it). ``REQUIRED_KEYS`` are the keys every row has.
- Their Prometheus names are in :mod:`rljob.prometheus`.
- ``MetricsLog`` reads and appends ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, NotRequired, TypedDict

# -- keys ------------------------------------------------------------------------------------------
STEP: Final = "step"
TIME: Final = "time"  # wall clock (Unix seconds) when the step ended
REWARD_MEAN: Final = "reward/mean"
REWARD_STD: Final = "reward/std"
RESPONSE_LENGTH_MEAN: Final = "response_length/mean"
# fractions of the step's responses that hit rollout.max_new_tokens without a stop id (scored as
# cut) and from which no answer could be read in task.answer_format (scored 0; workers.tasks.answers): a
# high one means the reward measures the length limit or the format rather than the task
RESPONSE_TRUNCATED_FRACTION: Final = "response/truncated_fraction"
RESPONSE_UNREADABLE_FRACTION: Final = "response/unreadable_fraction"
# train/generation mismatch (NeMo RL's definitions: workers.algo.mismatch)
TOKEN_MULT_PROB_ERROR: Final = "mismatch/token_mult_prob_error"
GEN_KL_ERROR: Final = "mismatch/gen_kl_error"
POLICY_KL_ERROR: Final = "mismatch/policy_kl_error"
JS_DIVERGENCE_ERROR: Final = "mismatch/js_divergence_error"
SAMPLING_IMPORTANCE_RATIO: Final = "mismatch/sampling_importance_ratio"
IS_OOB_RATIO: Final = "mismatch/is_oob_ratio"
CHI2_TOKEN: Final = "mismatch/chi2_token"
MISMATCH_TOKENS: Final = "mismatch/num_tokens"
# the trainers' statistics (workers.engines.step_stats.train_stats)
TRAIN_LOSS: Final = "train/loss"
TRAIN_GRAD_NORM: Final = "train/grad_norm"
TRAIN_CLIP_FRACTION: Final = "train/clip_fraction"
TRAIN_KL: Final = "train/kl"
TRAIN_ADVANTAGE_ABS_MEAN: Final = "train/advantage_abs_mean"
TRAIN_TOKENS: Final = "train/tokens"
IS_WEIGHT_MEAN: Final = "is/weight_mean"
IS_WEIGHT_MAX: Final = "is/weight_max"
# volume, speed and memory
TOKENS_GENERATED: Final = "tokens/generated"
TOKENS_TRAINED: Final = "tokens/trained"
GENERATION_TOKENS_PER_S: Final = "throughput/generation_tokens_per_s"
TRAIN_TOKENS_PER_S: Final = "throughput/train_tokens_per_s"
TIMING_GENERATION_S: Final = "timing/generation_s"
TIMING_REWARD_S: Final = "timing/reward_s"
TIMING_TRAIN_S: Final = "timing/train_s"
TIMING_WEIGHT_SYNC_S: Final = "timing/weight_sync_s"
TIMING_VALIDATION_S: Final = "timing/validation_s"
TIMING_STEP_S: Final = "timing/step_s"
WEIGHT_SYNC_BYTES: Final = "weight_sync/bytes"
# the precision contract of each weight sync (workers.weight_sync.contract): weights checked over all
# generators, and those that differed (a difference fails the step, so a recorded row holds 0)
SYNC_LAYERS_CHECKED: Final = "sync/layers_checked"
SYNC_LAYERS_MISMATCHED: Final = "sync/layers_mismatched"
KV_CACHE_BYTES: Final = "kv_cache/bytes"
WEIGHTS_BYTES: Final = "weights/bytes"
# asynchronous RL (rollout.max_staleness >= 1; workers.async_rl): the lag of the trained sequences
# (policy versions between the weights that generated them and those trained from), batches the
# trainer refused as older than the bound, seconds generation and training both ran, and the
# mismatch metrics over the lag-0 sequences only (FP8 alone; mismatch/* mixes FP8 and lag)
STALENESS_MEAN: Final = "staleness/mean"
STALENESS_MAX: Final = "staleness/max"
STALENESS_DROPPED: Final = "staleness/dropped_batches"
TIMING_OVERLAP_S: Final = "timing/overlap_s"
# data-plane faults recovered from during the step (workers.rl.faults): actors replaced because a
# generator or a trainer was lost, and completed steps computed again because a trainer fault took
# the job back to its last checkpoint; each row holds the step's own count (0 on most)
FAULTS_GENERATOR_RESTARTS: Final = "faults/generator_restarts"
FAULTS_TRAINER_RESTARTS: Final = "faults/trainer_restarts"
FAULTS_STEPS_RECOMPUTED: Final = "faults/steps_recomputed"
FAULT_KEYS: Final = (FAULTS_GENERATOR_RESTARTS, FAULTS_TRAINER_RESTARTS, FAULTS_STEPS_RECOMPUTED)
# the mismatch SLO (precision.mismatch_slo, rljob.mismatch_slo) over the window ending at the step:
# its metric's median and bound, the steps above the tail bound, the tail bound, and 1 when breached
SLO_MEDIAN: Final = "mismatch_slo/median"
SLO_MEDIAN_BOUND: Final = "mismatch_slo/median_bound"
SLO_TAIL_STEPS: Final = "mismatch_slo/tail_steps"
SLO_TAIL_BOUND: Final = "mismatch_slo/tail_bound"
SLO_BREACHED: Final = "mismatch_slo/breached"
# precision.mismatch_slo.action respond (rljob.precision_actions): the actions in effect after the step
PRECISION_ACTIONS: Final = "precision/actions"
# validation (every ``validation.interval`` steps)
VAL_ACCURACY: Final = "val/accuracy"
VAL_REWARD_MEAN: Final = "val/reward_mean"
VAL_TRUNCATED_FRACTION: Final = "val/truncated_fraction"
VAL_UNREADABLE_FRACTION: Final = "val/unreadable_fraction"
# pass@1: the share of held-out problems whose one response (greedy at validation.temperature 0) is
# fully correct (= val/accuracy); pass@k with validation.pass_k = k: the share with at least one
# fully correct response among k sampled ones (HumanEval's estimator with n = k), and k itself
VAL_PASS_AT_1: Final = "val/pass@1"
VAL_PASS_AT_K: Final = "val/pass@k"
VAL_PASS_K: Final = "val/pass_k"


def lag0_key(key: str) -> str:
    """The key of mismatch metric ``key`` over the lag-0 sequences: ``mismatch_lag0/<name>``."""
    return "mismatch_lag0/" + key.removeprefix("mismatch/")


# -- typed rows ------------------------------------------------------------------------------------
# The TypedDicts spell each key once more, as a literal (Python's TypedDict takes no constants);
# tests/rljob/test_metrics.py checks that the constants and the TypedDicts name the same keys.
MismatchMetrics = TypedDict(
    "MismatchMetrics",
    {
        "mismatch/token_mult_prob_error": float,
        "mismatch/gen_kl_error": float,
        "mismatch/policy_kl_error": float,
        "mismatch/js_divergence_error": float,
        "mismatch/sampling_importance_ratio": float,
        "mismatch/is_oob_ratio": float,
        "mismatch/chi2_token": float,
        "mismatch/num_tokens": float,
    },
)
TrainMetrics = TypedDict(
    "TrainMetrics",
    {
        "train/loss": float,
        "train/grad_norm": float,
        "train/clip_fraction": float,
        "train/kl": float,
        "train/advantage_abs_mean": float,
        "train/tokens": NotRequired[float],  # the driver drops it from the row (tokens/trained says it)
        "is/weight_mean": float,
        "is/weight_max": float,
    },
)
SyncMetrics = TypedDict(
    "SyncMetrics",
    {"weight_sync/bytes": float, "sync/layers_checked": float, "sync/layers_mismatched": float},
)
AsyncMetrics = TypedDict(
    "AsyncMetrics",
    {
        "staleness/mean": float,
        "staleness/max": float,
        "staleness/dropped_batches": float,
        "timing/overlap_s": float,
        # the MismatchMetrics keys with the prefix mismatch_lag0/, on steps with lag-0 sequences
        "mismatch_lag0/token_mult_prob_error": float,
        "mismatch_lag0/gen_kl_error": float,
        "mismatch_lag0/policy_kl_error": float,
        "mismatch_lag0/js_divergence_error": float,
        "mismatch_lag0/sampling_importance_ratio": float,
        "mismatch_lag0/is_oob_ratio": float,
        "mismatch_lag0/chi2_token": float,
        "mismatch_lag0/num_tokens": float,
    },
    total=False,  # only the asynchronous loop's rows
)
FaultMetrics = TypedDict(
    "FaultMetrics",
    {"faults/generator_restarts": float, "faults/trainer_restarts": float, "faults/steps_recomputed": float},
    total=False,  # the driver's rows have them; a step computed alone (workers.rl.step) has not
)
SloMetrics = TypedDict(
    "SloMetrics",
    {
        "mismatch_slo/median": float,
        "mismatch_slo/median_bound": float,
        "mismatch_slo/tail_steps": float,
        "mismatch_slo/tail_bound": float,
        "mismatch_slo/breached": float,
        "precision/actions": float,
    },
    total=False,  # the driver's rows have them; a step computed alone (workers.rl.step) has not
)
ValidationMetrics = TypedDict(
    "ValidationMetrics",
    {
        "val/accuracy": float,
        "val/reward_mean": float,
        "val/truncated_fraction": float,
        "val/unreadable_fraction": float,
        "val/pass@1": float,
        "val/pass@k": float,  # with validation.pass_k
        "val/pass_k": float,
        "timing/validation_s": float,
    },
    total=False,  # only on the steps that validate
)
# The policy RL starts from (after the warm-up), validated before step 1: a line of its own
InitialValidation = TypedDict(
    "InitialValidation",
    {
        "step": int,
        "val/accuracy": float,
        "val/reward_mean": float,
        "val/truncated_fraction": float,
        "val/unreadable_fraction": float,
        "val/pass@1": float,
        "val/pass@k": NotRequired[float],  # with validation.pass_k
        "val/pass_k": NotRequired[float],
        "timing/validation_s": float,
    },
)
_StepCore = TypedDict(
    "_StepCore",
    {
        "step": int,
        "time": float,
        "reward/mean": float,
        "reward/std": float,
        "response_length/mean": float,
        "response/truncated_fraction": float,
        "response/unreadable_fraction": float,
        "tokens/generated": float,
        "tokens/trained": float,
        "throughput/generation_tokens_per_s": float,
        "throughput/train_tokens_per_s": float,
        "timing/generation_s": float,
        "timing/reward_s": float,
        "timing/train_s": float,
        "timing/weight_sync_s": float,
        "timing/step_s": float,
        "kv_cache/bytes": float,
        "weights/bytes": float,
    },
)


class StepMetrics(_StepCore, MismatchMetrics, TrainMetrics, SyncMetrics):
    """One line of ``metrics.jsonl``: everything measured in one RL step."""


class AsyncStepMetrics(StepMetrics, AsyncMetrics, FaultMetrics, SloMetrics, total=False):
    """The line of a step of the asynchronous loop (and the fault counts the driver adds)."""


class ValidatedStepMetrics(AsyncStepMetrics, ValidationMetrics, total=False):
    """The line of a step that also validated."""


# The keys every step line has (docs/running.md "Metrics"), in the order of the schema; the
# step-0 validation line (InitialValidation) has the validation keys only.
REQUIRED_KEYS: tuple[str, ...] = tuple(
    k for k in StepMetrics.__annotations__ if k in StepMetrics.__required_keys__
)

# -- per-grader and per-layer keys ------------------------------------------------------------------
# Per grader (task.graders; a multi grader's children as "<multi>.<child>"), on every step line:
# reward/<grader>/mean (its mean score), grader/<grader>/errors and grader/<grader>/timeouts (the
# step's responses it failed on, scored 0), grader/<grader>/seconds (its time in the step; a multi
# grader's formula alone). Prometheus: one family each with a grader label
# (rljob.prometheus.GRADER_PROMETHEUS).
GRADER_STATS = ("errors", "timeouts", "seconds")


def grader_reward_key(grader: str) -> str:
    """``reward/<grader>/mean``."""
    return f"reward/{grader}/mean"


def grader_stat_key(grader: str, stat: str) -> str:
    """``grader/<grader>/<stat>`` (``stat`` in GRADER_STATS)."""
    return f"grader/{grader}/{stat}"


def grader_of_key(key: str) -> tuple[str, str] | None:
    """(grader, what) of a per-grader key (what: mean, errors, timeouts, seconds); None otherwise."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "reward" and parts[2] == "mean":
        return parts[1], "mean"
    if len(parts) == 3 and parts[0] == "grader" and parts[2] in GRADER_STATS:
        return parts[1], parts[2]
    return None


# Per-layer attribution of the mismatch (precision.mismatch_slo.attribution_interval): decoder layer
# i's share, ``mismatch/layer/<i>`` in the line of a step that measured it (Prometheus: one gauge
# with a ``layer`` label, rljob.prometheus.MISMATCH_LAYER_PROMETHEUS).


def mismatch_layer_key(layer: int) -> str:
    """``mismatch/layer/<layer>``."""
    return f"mismatch/layer/{layer}"


def layer_of_key(key: str) -> int | None:
    """The decoder layer of a ``mismatch/layer/<i>`` key; None for any other key."""
    kind, _, rest = key.rpartition("/")
    return int(rest) if kind == "mismatch/layer" and rest.isdigit() else None


# -- the log -----------------------------------------------------------------------------------------
class MetricsLog:
    """``metrics.jsonl``: appended and flushed every step; truncated to a step on resume."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a crash: everything after it is lost anyway
        return out

    def read_new(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        """Complete lines after byte ``offset`` and the offset after them, for a reader that
        polls a growing log without re-reading it. A file shorter than ``offset`` (truncated by
        a resume) is read from the start."""
        if not self.path.exists():
            return [], 0
        with self.path.open("rb") as f:
            if f.seek(0, os.SEEK_END) < offset:
                offset = 0
            f.seek(offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()], offset + end

    def truncate(self, last_step: int) -> list[dict[str, Any]]:
        """Keep rows with ``step <= last_step`` (atomically); return them."""
        kept = [r for r in self.rows() if int(r.get("step", 0)) <= last_step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        return kept

    def append(self, row: Mapping[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
