"""The Prometheus metrics the project really exports, read from the expositions of real runs.

:func:`exported` runs the job driver for one step on a tiny model (recipe ``fp8-e2e``, so the
importance-sampling and mismatch metrics carry values; validation on, so its gauges exist) and
scrapes its ``/metrics`` over HTTP while the run is live, and asks a real control plane (SQLite
store, one Pending job) for its ``/metrics``.
:func:`unknown_metrics` checks PromQL expressions (dashboard panels, variable queries, alert rules)
against that: every metric they select must be exported, with the labels they match on.
"""

from __future__ import annotations

import functools
import re
import tempfile
import urllib.request
from collections.abc import Iterable, Mapping, Set
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.helm.promql import PromQLError, selectors

__all__ = ["control_plane_exposition", "driver_exposition", "exported", "parse_exposition", "unknown_metrics"]

_PORT_IN_LOG = re.compile(r"Prometheus metrics on http://[^\s/]+:(\d+)/metrics")
_TOKEN, _TENANT = "dashboard-token-0123456789", "team-dash"


def parse_exposition(text: str) -> dict[str, set[str]]:
    """Sample name (``x_total``, ``x_created``, a gauge's name...) -> the label names it carries."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def driver_exposition() -> str:
    """``/metrics`` of the job driver, scraped over HTTP after step 1 of a real ``fp8-e2e`` run
    that validates on 4 held-out problems.

    ``workers.driver.run`` starts a local Ray and shuts it down at the end (when it started it)."""
    # imported here, not at module level: the test module is then collected (and its asserts
    # rewritten) by pytest before this helper imports it
    from tests.workers.test_driver import tiny_spec
    from workers.driver import RunOptions, run

    ports: list[int] = []
    scraped: list[str] = []

    def log(message: str) -> None:
        m = _PORT_IN_LOG.search(message)
        if m:
            ports.append(int(m.group(1)))

    def scrape(row: Mapping[str, Any]) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/metrics", timeout=10) as r:
            scraped.append(r.read().decode())

    with tempfile.TemporaryDirectory() as tmp:
        opts = RunOptions(metrics_port=0, job="dash", on_step=scrape, log=log)
        spec = tiny_spec("fp8-e2e", steps=1, validation={"interval": 1, "size": 4})
        result = run(spec, Path(tmp) / "run", opts)
    if result.last_step != 1 or len(scraped) != 1:
        raise RuntimeError(f"the driver ran to step {result.last_step} and was scraped {len(scraped)} times")
    return scraped[0]


def control_plane_exposition() -> str:
    """``/metrics`` of a real control plane (SQLite store) holding one Pending job."""
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        api = TestClient(create_app(Settings(data_dir=Path(tmp), store="sql"), tokens={_TOKEN: _TENANT}))
        r = api.post("/v1/jobs", json={"name": "dash"}, headers={"Authorization": f"Bearer {_TOKEN}"})
        if r.status_code != 201:
            raise RuntimeError(f"posting a job answered {r.status_code}: {r.text}")
        metrics = api.get("/metrics")
        if metrics.status_code != 200:
            raise RuntimeError(f"/metrics answered {metrics.status_code}: {metrics.text}")
        return metrics.text


@functools.cache
def exported() -> dict[str, set[str]]:
    """Every sample name the driver and the control plane expose -> its label names.

    Cached for the session (one driver run); treat the answer as read-only."""
    out = parse_exposition(driver_exposition())
    for name, labels in parse_exposition(control_plane_exposition()).items():
        out.setdefault(name, set()).update(labels)
    return out


def unknown_metrics(exprs: Iterable[str], known: Mapping[str, Set[str]] | None = None) -> list[str]:
    """Problems of ``exprs`` against ``known`` (default: :func:`exported`), one line each.

    An expression is a problem when it does not parse, selects no metric, selects a metric that is
    not exported, or matches on a label the metric does not carry (``__name__`` is always allowed).
    A selector without a metric name (``label_values(job)``) may use labels of any metric.
    """
    known = exported() if known is None else known
    any_label = set().union(*known.values()) | {"__name__"}
    problems: list[str] = []
    for expr in exprs:
        try:
            found = selectors(expr)
        except PromQLError as e:
            problems.append(f"{expr!r} does not parse: {e}")
            continue
        if not found:
            problems.append(f"{expr!r} selects no metric")
        for name, matchers in found:
            if name and name not in known:
                problems.append(f"{expr!r} selects {name}, which is not exported")
                continue
            has = set(known[name]) | {"__name__"} if name else any_label
            missing = sorted(set(matchers) - has)
            if missing:
                problems.append(
                    f"{expr!r} matches {name or 'a metric'} on {missing}, labels it does not have"
                    f" (it has {sorted(has - {'__name__'})})"
                )
    return problems
