"""The control plane's Prometheus series, served on a port of their own (``--metrics-port``).

``fp8rl_jobs{namespace, phase}``: jobs per tenant and phase, every tenant and phase present from
the start (a dashboard shows 0, not "no data"). A scrape counts without listing the jobs
(``JobStore.count_by_phase``: a GROUP BY in SQL; with ``--store kubernetes``, the counts a watch
on RLJobs keeps, one cluster-wide LIST when it starts). The series name every tenant, so they are
not on the API port, which answers callers without a token
(``/healthz``, ``/readyz``, ``/docs``): the metrics port is a second listener that only the
chart's ServiceMonitor scrapes. The chart gives it a Service of its own, which the Ingress does not
route to, and a NetworkPolicy rule that admits only Prometheus (docs/deploy.md, "Security model").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rljob.jobs import JobStore
from rljob.status import Phase


class JobsCollector(Collector):
    """``fp8rl_jobs{namespace, phase}``, read from the store at each scrape."""

    def __init__(self, store: JobStore, tenants: Callable[[], list[str]]) -> None:
        self.store, self.tenants = store, tenants

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("fp8rl_jobs", "Jobs by tenant and phase", labels=("namespace", "phase"))
        counts = {(t, p.value): 0 for t in self.tenants() for p in Phase}
        counts |= self.store.count_by_phase()
        for (tenant, phase), n in sorted(counts.items()):
            family.add_metric((tenant, phase), n)
        yield family


def registry(store: JobStore, tenants: Callable[[], list[str]]) -> CollectorRegistry:
    """A registry holding only the control plane's series (no process or Python collectors)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(JobsCollector(store, tenants))
    return reg


class MetricsServer:
    """The metrics listener: Prometheus text on ``http://host:port/metrics``, in a thread of its
    own (a scrape never waits for the API's event loop, nor the API for a scrape)."""

    def __init__(self, reg: CollectorRegistry, host: str, port: int) -> None:
        self.registry, self.host, self.requested = reg, host, port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port it listens on (the requested one, or the free one that 0 picked)."""
        if self._server is None:
            raise RuntimeError("the metrics server is not started")
        return int(self._server.server_port)

    def start(self) -> None:
        try:
            self._server, self._thread = start_http_server(self.requested, self.host, self.registry)
        except OSError as err:
            raise OSError(
                err.errno,
                f"cannot serve the control plane's metrics on {self.host}:{self.requested} "
                f"({err.strerror}); pick another with --metrics-port (FP8RL_METRICS_PORT; 0: any free port)",
            ) from None

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
