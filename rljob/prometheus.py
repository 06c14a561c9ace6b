"""The Prometheus side of the metrics contract (:mod:`rljob.metrics` holds the JSONL keys): which
key of a step row becomes which ``fp8rl_*`` series, of which kind, with which labels. The driver's
exporter (workers.job.prom_exporter) serves them, the operator reads the gauges back into RLJob
status, and the Grafana dashboard and the alert rules use only names from here.

- ``PROMETHEUS`` is the single table from JSONL keys to Prometheus names. Every series carries the
  labels ``job``, ``namespace`` and ``recipe``. Keys only some steps have (``val/*``: validation
  every N steps) are exported from the first step that has them and then keep their last value, so
  a job without validation shows no validation series instead of a misleading 0. The asynchronous
  loop's series (``staleness/*``, ``timing/overlap_s``) are exported from the start: 0, their true
  value for a synchronous job, whose rows do not have the keys.
- The series with a label of their own: restarts by role, step time by phase, the driver's
  attempt, per-grader families and the per-layer mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from rljob.metrics import (
    CHI2_TOKEN,
    FAULTS_GENERATOR_RESTARTS,
    FAULTS_STEPS_RECOMPUTED,
    FAULTS_TRAINER_RESTARTS,
    GEN_KL_ERROR,
    GENERATION_TOKENS_PER_S,
    IS_OOB_RATIO,
    IS_WEIGHT_MAX,
    IS_WEIGHT_MEAN,
    JS_DIVERGENCE_ERROR,
    KV_CACHE_BYTES,
    POLICY_KL_ERROR,
    PRECISION_ACTIONS,
    RESPONSE_LENGTH_MEAN,
    RESPONSE_TRUNCATED_FRACTION,
    RESPONSE_UNREADABLE_FRACTION,
    REWARD_MEAN,
    SAMPLING_IMPORTANCE_RATIO,
    SLO_BREACHED,
    SLO_MEDIAN,
    SLO_MEDIAN_BOUND,
    SLO_TAIL_BOUND,
    SLO_TAIL_STEPS,
    STALENESS_DROPPED,
    STALENESS_MAX,
    STEP,
    SYNC_LAYERS_CHECKED,
    SYNC_LAYERS_MISMATCHED,
    TIMING_OVERLAP_S,
    TIMING_WEIGHT_SYNC_S,
    TOKEN_MULT_PROB_ERROR,
    TOKENS_GENERATED,
    TOKENS_TRAINED,
    TRAIN_GRAD_NORM,
    TRAIN_LOSS,
    TRAIN_TOKENS_PER_S,
    VAL_ACCURACY,
    VAL_PASS_AT_1,
    VAL_PASS_AT_K,
    VAL_PASS_K,
    VAL_REWARD_MEAN,
    VAL_TRUNCATED_FRACTION,
    VAL_UNREADABLE_FRACTION,
    WEIGHT_SYNC_BYTES,
    WEIGHTS_BYTES,
)

# -- Prometheus --------------------------------------------------------------------------------------
LABELS = ("job", "namespace", "recipe")


@dataclass(frozen=True)
class PromMetric:
    key: str  # JSONL key
    name: str  # Prometheus name
    kind: str  # gauge | counter (a counter is incremented by the step's value)
    help: str
    every_step: bool = True  # False: only some steps have it; exported from the first that does


PROMETHEUS: tuple[PromMetric, ...] = (
    PromMetric(STEP, "fp8rl_step", "gauge", "Last completed RL step"),
    PromMetric(REWARD_MEAN, "fp8rl_reward_mean", "gauge", "Mean reward of the step's rollouts"),
    PromMetric(TOKEN_MULT_PROB_ERROR, "fp8rl_token_mult_prob_error", "gauge",
               "Mean exp(|logp_trainer - logp_gen|) over response tokens (1.0 = identical)"),
    PromMetric(GEN_KL_ERROR, "fp8rl_gen_kl_error", "gauge", "k3 KL(gen || trainer)"),
    PromMetric(POLICY_KL_ERROR, "fp8rl_policy_kl_error", "gauge", "k3 KL(trainer || gen)"),
    PromMetric(JS_DIVERGENCE_ERROR, "fp8rl_js_divergence_error", "gauge", "Token JS divergence"),
    PromMetric(SAMPLING_IMPORTANCE_RATIO, "fp8rl_sampling_importance_ratio", "gauge",
               "Mean exp(logp_trainer - logp_gen)"),
    PromMetric(IS_OOB_RATIO, "fp8rl_is_oob_ratio", "gauge",
               "Fraction of tokens whose IS weight is outside the bounds"),
    PromMetric(CHI2_TOKEN, "fp8rl_chi2_token", "gauge", "Mean (w - 1)^2 per token"),
    PromMetric(IS_WEIGHT_MEAN, "fp8rl_is_weight_mean", "gauge", "Mean applied IS weight"),
    PromMetric(SLO_MEDIAN, "fp8rl_mismatch_slo_median", "gauge",
               "Median of the mismatch SLO's metric over its window (precision.mismatch_slo)"),
    PromMetric(SLO_MEDIAN_BOUND, "fp8rl_mismatch_slo_median_bound", "gauge",
               "The SLO's bound on that median"),
    PromMetric(SLO_TAIL_STEPS, "fp8rl_mismatch_slo_tail_steps", "gauge",
               "Steps of the SLO's window above its tail bound"),
    PromMetric(SLO_TAIL_BOUND, "fp8rl_mismatch_slo_tail_bound", "gauge", "The SLO's tail bound"),
    PromMetric(SLO_BREACHED, "fp8rl_mismatch_slo_breached", "gauge",
               "1 while the job's mismatch breaks its SLO (median or tail), else 0"),
    PromMetric(PRECISION_ACTIONS, "fp8rl_precision_actions", "gauge",
               "Precision actions the mismatch SLO has in effect (precision.mismatch_slo.action respond)"),
    PromMetric(IS_WEIGHT_MAX, "fp8rl_is_weight_max", "gauge", "Largest applied IS weight"),
    PromMetric(GENERATION_TOKENS_PER_S, "fp8rl_generation_tokens_per_second", "gauge",
               "Generated tokens per second in the last step"),
    PromMetric(TRAIN_TOKENS_PER_S, "fp8rl_train_tokens_per_second", "gauge",
               "Trained tokens (prompt + response) per second in the last step"),
    PromMetric(TOKENS_GENERATED, "fp8rl_generation_tokens_total", "counter", "Generated tokens"),
    PromMetric(TOKENS_TRAINED, "fp8rl_train_tokens_total", "counter", "Trained tokens"),
    PromMetric(WEIGHT_SYNC_BYTES, "fp8rl_weight_sync_bytes_total", "counter", "Bytes sent to generators"),
    PromMetric(TIMING_WEIGHT_SYNC_S, "fp8rl_weight_sync_seconds", "gauge", "Last weight sync, s"),
    PromMetric(SYNC_LAYERS_CHECKED, "fp8rl_sync_layers_checked", "gauge",
               "Weights whose precision and bytes the last sync checked on every generator"),
    PromMetric(SYNC_LAYERS_MISMATCHED, "fp8rl_sync_layers_mismatched", "gauge",
               "Weights a generator held otherwise than the trainer sent at the last sync"),
    # asynchronous RL: a synchronous job exports them as 0 from its first step, their true value
    PromMetric(STALENESS_MAX, "fp8rl_policy_staleness", "gauge",
               "Policy versions the last step's sequences lag the weights they were trained from"),
    PromMetric(STALENESS_DROPPED, "fp8rl_stale_batches_dropped_total", "counter",
               "Batches the trainer refused as older than rollout.max_staleness (and regenerated)"),
    PromMetric(TIMING_OVERLAP_S, "fp8rl_generation_train_overlap_seconds", "gauge",
               "Seconds of the last step the generators worked while the trainers trained"),
    # faults: fp8rl_actor_restarts_total{role} is the exporter's own (a role label: RESTART_ROLES)
    PromMetric(FAULTS_STEPS_RECOMPUTED, "fp8rl_steps_recomputed_total", "counter",
               "Completed steps computed again after a trainer fault took the job back to its checkpoint"),
    PromMetric(KV_CACHE_BYTES, "fp8rl_kv_cache_bytes", "gauge",
               "KV-cache bytes allocated at the end of the last generation, all generators"),
    PromMetric(WEIGHTS_BYTES, "fp8rl_weight_bytes", "gauge",
               "Bytes the generators' weights hold (FP8 layers: data + scales), all generators"),
    PromMetric(TRAIN_LOSS, "fp8rl_train_loss", "gauge", "Policy loss"),
    PromMetric(TRAIN_GRAD_NORM, "fp8rl_grad_norm", "gauge", "Gradient norm before clipping"),
    PromMetric(RESPONSE_LENGTH_MEAN, "fp8rl_response_length_mean", "gauge", "Mean response tokens"),
    PromMetric(RESPONSE_TRUNCATED_FRACTION, "fp8rl_response_truncated_fraction", "gauge",
               "Fraction of the last step's responses cut at rollout.max_new_tokens without a stop id"),
    PromMetric(RESPONSE_UNREADABLE_FRACTION, "fp8rl_response_unreadable_fraction", "gauge",
               "Fraction of the last step's responses with no answer readable in task.answer_format"),
    PromMetric(VAL_ACCURACY, "fp8rl_val_accuracy", "gauge",
               "Fraction of held-out problems answered fully correctly (reward 1) at the last validation",
               every_step=False),
    PromMetric(VAL_REWARD_MEAN, "fp8rl_val_reward_mean", "gauge",
               "Mean reward on the held-out problems at the last validation", every_step=False),
    PromMetric(VAL_PASS_AT_1, "fp8rl_val_pass_at_1", "gauge",
               "Share of held-out problems whose one response is fully correct, at the last validation",
               every_step=False),
    PromMetric(VAL_PASS_AT_K, "fp8rl_val_pass_at_k", "gauge",
               "Share of held-out problems with a fully correct response among validation.pass_k "
               "sampled ones (fp8rl_val_pass_k), at the last validation", every_step=False),
    PromMetric(VAL_PASS_K, "fp8rl_val_pass_k", "gauge", "The k of fp8rl_val_pass_at_k", every_step=False),
    PromMetric(VAL_TRUNCATED_FRACTION, "fp8rl_val_truncated_fraction", "gauge",
               "Fraction of the held-out responses cut at rollout.max_new_tokens without a stop id, "
               "at the last validation", every_step=False),
    PromMetric(VAL_UNREADABLE_FRACTION, "fp8rl_val_unreadable_fraction", "gauge",
               "Fraction of the held-out responses with no answer readable in task.answer_format, "
               "at the last validation", every_step=False),
)  # fmt: skip

# fp8rl_actor_restarts_total{role}: the faults/<role>_restarts keys of RESTART_ROLES, one counter
# with a role label (not in PROMETHEUS, whose series have the three labels only), 0 from the start
ACTOR_RESTARTS = PromMetric(
    FAULTS_GENERATOR_RESTARTS,
    "fp8rl_actor_restarts_total",
    "counter",
    "Actors replaced after a data-plane fault (died, engine failed, hung), by role",
)
RESTART_ROLES: dict[str, str] = {"generator": FAULTS_GENERATOR_RESTARTS, "trainer": FAULTS_TRAINER_RESTARTS}

# fp8rl_run_complete: 1 once the driver has done every step of the job (0 while it runs); the
# operator reads it where KubeRay cannot read the Ray job's outcome (rayAuth: secret), and the
# driver keeps serving it for --metrics-linger seconds after its last step for that read
RUN_COMPLETE = "fp8rl_run_complete"
# fp8rl_driver_attempt{previous_exit}: which run of the driver on this Ray cluster serves the metrics
# (1, then 2, 3, ... after in-place retries, workers.job.supervisor), and the exit code of the run
# before it ("" for the first); the operator records each as an attempt on a reused cluster
DRIVER_ATTEMPT = "fp8rl_driver_attempt"

# what -> (Prometheus name, kind, help); series labelled job, namespace, recipe and grader
GRADER_PROMETHEUS: dict[str, tuple[str, str, str]] = {
    "mean": ("fp8rl_grader_reward_mean", "gauge", "Mean score of the last step's responses, by grader"),
    "errors": ("fp8rl_grader_errors_total", "counter", "Responses a grader failed on (scored 0), by grader"),
    "timeouts": ("fp8rl_grader_timeouts_total", "counter", "Responses a grader timed out on (scored 0)"),
    "seconds": ("fp8rl_grader_seconds", "gauge", "Seconds a grader took in the last step"),
}

# Per-layer attribution of the mismatch (rljob.metrics.mismatch_layer_key): one gauge with a
# ``layer`` label.
MISMATCH_LAYER_PROMETHEUS = (
    "fp8rl_mismatch_layer",
    "A decoder layer's contribution to the train/generation mismatch at the last attribution: "
    "how much it grows the relative divergence of the two engines' hidden states",
)

# fp8rl_step_duration_seconds{phase}; validation only on the steps that validate (0 on the others,
# once a step has validated)
PHASES = ("generation", "reward", "train", "weight_sync", "validation")
