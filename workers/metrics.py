"""Step metrics: one JSON line per step, and the same facts as Prometheus ``fp8rl_*`` metrics.

``PROMETHEUS`` is the single table from JSONL keys to Prometheus names; the Grafana dashboard and
the alert rules use only names from it. Every series carries the labels ``job``, ``namespace``
and ``recipe``. Keys only some steps have (``val/*``: validation every N steps) are exported from
the first step that has them and then keep their last value, so a job without validation shows
no validation series instead of a misleading 0.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

LABELS = ("job", "namespace", "recipe")

# The keys every step line has (issue contract; README "Metrics").
REQUIRED_KEYS = (
    "step",
    "reward/mean",
    "mismatch/token_mult_prob_error",
    "mismatch/gen_kl_error",
    "mismatch/policy_kl_error",
    "mismatch/js_divergence_error",
    "mismatch/sampling_importance_ratio",
    "mismatch/is_oob_ratio",
    "mismatch/chi2_token",
    "throughput/generation_tokens_per_s",
    "throughput/train_tokens_per_s",
    "timing/generation_s",
    "timing/train_s",
    "timing/weight_sync_s",
    "weight_sync/bytes",
    "kv_cache/bytes",
    "weights/bytes",
)


@dataclass(frozen=True)
class PromMetric:
    key: str  # JSONL key
    name: str  # Prometheus name
    kind: str  # gauge | counter (a counter is incremented by the step's value)
    help: str
    every_step: bool = True  # False: only some steps have it; exported from the first that does


PROMETHEUS: tuple[PromMetric, ...] = (
    PromMetric("step", "fp8rl_step", "gauge", "Last completed RL step"),
    PromMetric("reward/mean", "fp8rl_reward_mean", "gauge", "Mean reward of the step's rollouts"),
    PromMetric("mismatch/token_mult_prob_error", "fp8rl_token_mult_prob_error", "gauge",
               "Mean exp(|logp_trainer - logp_gen|) over response tokens (1.0 = identical)"),
    PromMetric("mismatch/gen_kl_error", "fp8rl_gen_kl_error", "gauge", "k3 KL(gen || trainer)"),
    PromMetric("mismatch/policy_kl_error", "fp8rl_policy_kl_error", "gauge", "k3 KL(trainer || gen)"),
    PromMetric("mismatch/js_divergence_error", "fp8rl_js_divergence_error", "gauge", "Token JS divergence"),
    PromMetric("mismatch/sampling_importance_ratio", "fp8rl_sampling_importance_ratio", "gauge",
               "Mean exp(logp_trainer - logp_gen)"),
    PromMetric("mismatch/is_oob_ratio", "fp8rl_is_oob_ratio", "gauge",
               "Fraction of tokens whose IS weight is outside the bounds"),
    PromMetric("mismatch/chi2_token", "fp8rl_chi2_token", "gauge", "Mean (w - 1)^2 per token"),
    PromMetric("is/weight_mean", "fp8rl_is_weight_mean", "gauge", "Mean applied IS weight"),
    PromMetric("is/weight_max", "fp8rl_is_weight_max", "gauge", "Largest applied IS weight"),
    PromMetric("throughput/generation_tokens_per_s", "fp8rl_generation_tokens_per_second", "gauge",
               "Generated tokens per second in the last step"),
    PromMetric("throughput/train_tokens_per_s", "fp8rl_train_tokens_per_second", "gauge",
               "Trained tokens (prompt + response) per second in the last step"),
    PromMetric("tokens/generated", "fp8rl_generation_tokens_total", "counter", "Generated tokens"),
    PromMetric("tokens/trained", "fp8rl_train_tokens_total", "counter", "Trained tokens"),
    PromMetric("weight_sync/bytes", "fp8rl_weight_sync_bytes_total", "counter", "Bytes sent to generators"),
    PromMetric("timing/weight_sync_s", "fp8rl_weight_sync_seconds", "gauge", "Last weight sync, s"),
    PromMetric("kv_cache/bytes", "fp8rl_kv_cache_bytes", "gauge",
               "KV-cache bytes allocated at the end of the last generation, all generators"),
    PromMetric("weights/bytes", "fp8rl_weight_bytes", "gauge",
               "Bytes the generators' weights hold (FP8 layers: data + scales), all generators"),
    PromMetric("train/loss", "fp8rl_train_loss", "gauge", "Policy loss"),
    PromMetric("train/grad_norm", "fp8rl_grad_norm", "gauge", "Gradient norm before clipping"),
    PromMetric("response_length/mean", "fp8rl_response_length_mean", "gauge", "Mean response tokens"),
    PromMetric("val/accuracy", "fp8rl_val_accuracy", "gauge",
               "Fraction of held-out problems answered fully correctly (reward 1) at the last validation",
               every_step=False),
    PromMetric("val/reward_mean", "fp8rl_val_reward_mean", "gauge",
               "Mean reward on the held-out problems at the last validation", every_step=False),
)  # fmt: skip

# fp8rl_step_duration_seconds{phase}; validation only on the steps that validate (0 on the others,
# once a step has validated)
PHASES = ("generation", "reward", "train", "weight_sync", "validation")


class PromExporter:
    """Holds the run's Prometheus metrics in its own registry; optionally serves them over HTTP."""

    def __init__(self, job: str, namespace: str, recipe: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"job": job, "namespace": namespace, "recipe": recipe}
        self._families: dict[str, Any] = {}
        self._metrics: dict[str, Any] = {}  # the job's series, created when first exported
        for m in PROMETHEUS:
            cls = Counter if m.kind == "counter" else Gauge
            name = m.name.removesuffix("_total") if m.kind == "counter" else m.name
            self._families[m.key] = cls(name, m.help, LABELS, registry=self.registry)
            if m.every_step:
                self._metrics[m.key] = self._families[m.key].labels(**self.labels)
        self._phase = Gauge(
            "fp8rl_step_duration_seconds",
            "Seconds spent in each phase of the last step",
            (*LABELS, "phase"),
            registry=self.registry,
        )
        self._phases_seen: set[str] = set()
        self.port: int | None = None

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``port`` (0: any free port); returns the port."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        self.port = int(server.server_port)
        self._server = server
        return self.port

    def stop(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()

    def observe(self, row: dict[str, Any]) -> None:
        for m in PROMETHEUS:
            if m.key in row and row[m.key] is not None:
                if m.key not in self._metrics:
                    self._metrics[m.key] = self._families[m.key].labels(**self.labels)
                metric = self._metrics[m.key]
                if m.kind == "counter":
                    metric.inc(max(float(row[m.key]), 0.0))
                else:
                    metric.set(float(row[m.key]))
        for phase in PHASES:
            key = f"timing/{phase}_s"
            if key in row:
                self._phases_seen.add(phase)
            if phase in self._phases_seen:  # a phase this step skipped took 0 s of it
                self._phase.labels(**self.labels, phase=phase).set(float(row.get(key, 0.0)))


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

    def append(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
