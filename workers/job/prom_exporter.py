"""The run's Prometheus exporter: the step rows of ``metrics.jsonl`` as ``fp8rl_*`` metrics, named
and labelled by the contract in ``rljob.metrics`` (``PROMETHEUS``, ``LABELS``, ``PHASES``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from rljob.metrics import grader_of_key, layer_of_key
from rljob.prometheus import (
    ACTOR_RESTARTS,
    DRIVER_ATTEMPT,
    GRADER_PROMETHEUS,
    LABELS,
    MISMATCH_LAYER_PROMETHEUS,
    PHASES,
    PROMETHEUS,
    RESTART_ROLES,
    RUN_COMPLETE,
)


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
        restarts = Counter(
            ACTOR_RESTARTS.name.removesuffix("_total"),
            ACTOR_RESTARTS.help,
            (*LABELS, "role"),
            registry=self.registry,
        )
        self._restarts = {role: restarts.labels(**self.labels, role=role) for role in RESTART_ROLES}
        self._complete = Gauge(
            RUN_COMPLETE, "1 once the driver has done every step of the job", LABELS, registry=self.registry
        ).labels(**self.labels)
        self._attempt = Gauge(
            DRIVER_ATTEMPT,
            "Run of the driver on this Ray cluster (in-place retries); how the one before ended",
            (*LABELS, "previous_exit"),
            registry=self.registry,
        )
        self._graders = {
            what: (Counter if kind == "counter" else Gauge)(
                name.removesuffix("_total") if kind == "counter" else name, text, (*LABELS, "grader"),
                registry=self.registry,
            )
            for what, (name, kind, text) in GRADER_PROMETHEUS.items()
        }  # fmt: skip
        name, text = MISMATCH_LAYER_PROMETHEUS
        self._layers = Gauge(name, text, (*LABELS, "layer"), registry=self.registry)
        self.port: int | None = None

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``port`` (0: any free port); returns the port."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        self.port = int(server.server_port)
        self._server = server
        return self.port

    def attempt(self, number: int, previous_exit: str = "") -> None:
        """This driver is run ``number`` on its Ray cluster; the one before exited with
        ``previous_exit`` (``""`` for the first)."""
        self._attempt.labels(**self.labels, previous_exit=previous_exit).set(number)

    def complete(self) -> None:
        """Every step of the job is done (``fp8rl_run_complete`` 1)."""
        self._complete.set(1)

    def stop(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()

    def observe(self, row: Mapping[str, Any]) -> None:
        for m in PROMETHEUS:
            if m.key in row and row[m.key] is not None:
                if m.key not in self._metrics:
                    self._metrics[m.key] = self._families[m.key].labels(**self.labels)
                metric = self._metrics[m.key]
                if m.kind == "counter":
                    metric.inc(max(float(row[m.key]), 0.0))
                else:
                    metric.set(float(row[m.key]))
        for key, value in row.items():
            layer = layer_of_key(key)
            if layer is not None and value is not None:
                self._layers.labels(**self.labels, layer=str(layer)).set(float(value))
            found = grader_of_key(key)
            if found is None or value is None:
                continue
            grader, what = found
            family = self._graders[what]
            if isinstance(family, Counter):
                family.labels(**self.labels, grader=grader).inc(max(float(value), 0.0))
            else:
                family.labels(**self.labels, grader=grader).set(float(value))
        for role, key in RESTART_ROLES.items():
            self._restarts[role].inc(max(float(row.get(key, 0.0)), 0.0))
        for phase in PHASES:
            key = f"timing/{phase}_s"
            if key in row:
                self._phases_seen.add(phase)
            if phase in self._phases_seen:  # a phase this step skipped took 0 s of it
                self._phase.labels(**self.labels, phase=phase).set(float(row.get(key, 0.0)))
