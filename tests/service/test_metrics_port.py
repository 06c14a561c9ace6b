"""No tenant data on the API port without a token; the control plane's Prometheus series
(``fp8rl_jobs{namespace, phase}``) on the metrics port (``service.metrics_port``)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rljob.status import Phase
from service.main import create_app
from service.metrics_port import MetricsServer, registry
from service.settings import Settings
from service.store import SqlJobStore
from tests.service.servers import serve

# names that must never reach a caller without a token: the tenants and their jobs
TOKENS = {"zeta-token-0123456789abc": "tenant-zeta", "kappa-token-0123456789ab": "tenant-kappa"}
HIDDEN = ("tenant-zeta", "tenant-kappa", "job-omicron", "job-sigma")
ZETA = {"Authorization": "Bearer zeta-token-0123456789abc"}
KAPPA = {"Authorization": "Bearer kappa-token-0123456789ab"}


def jobs_series(text: str) -> dict[tuple[str, str], float]:
    """``{(namespace, phase): value}`` of the ``fp8rl_jobs`` samples in Prometheus text."""
    return {
        (s.labels["namespace"], s.labels["phase"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "fp8rl_jobs"
        for s in family.samples
    }


def _with_jobs(tmp_path: Path) -> TestClient:
    api = TestClient(create_app(Settings(data_dir=tmp_path), tokens=TOKENS))
    assert api.post("/v1/jobs", json={"name": "job-omicron"}, headers=ZETA).status_code == 201
    assert api.post("/v1/jobs", json={"name": "job-sigma"}, headers=KAPPA).status_code == 201
    return api


def test_the_api_port_shows_no_tenant_or_job_names_without_a_token(tmp_path: Path) -> None:
    api = _with_jobs(tmp_path)
    paths = {"/healthz", "/readyz", "/docs", "/redoc", "/openapi.json", "/metrics", "/"}
    for path in api.get("/openapi.json").json()["paths"]:  # every operation, on a real job's name
        paths.add(path.replace("{name}", "job-omicron"))
    answers = []
    for path in sorted(paths):
        for method in ("GET", "POST", "DELETE"):
            for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}):
                r = api.request(
                    method, path, headers=headers, json={"name": "x"} if method == "POST" else None
                )
                answers.append((method, path, r.status_code))
                seen = r.text + " ".join(f"{k}: {v}" for k, v in r.headers.items())
                seen = seen.replace(path, "")  # a 404 or 405 names the path asked for: the caller's own
                leaked = [name for name in HIDDEN if name in seen]
                assert leaked == [], f"{method} {path} {headers} -> {r.status_code} shows {leaked}"
    assert ("GET", "/metrics", 404) in answers
    assert all(code == 401 for m, p, code in answers if p.startswith("/v1/") and code not in (404, 405))


def test_metrics_on_the_api_port_is_404_and_says_where_they_went(tmp_path: Path) -> None:
    api = _with_jobs(tmp_path)
    for headers in ({}, ZETA):  # not even with a token: the series are the cluster's, not a tenant's
        r = api.get("/metrics", headers=headers)
        assert r.status_code == 404 and "--metrics-port" in r.json()["detail"]
        assert "fp8rl_jobs" not in r.text
    assert "/metrics" not in api.get("/openapi.json").json()["paths"]


def test_the_series_count_every_tenants_jobs_by_phase_from_zero(tmp_path: Path) -> None:
    """Each tenant and phase from the start (a dashboard shows 0, not "no data"), then the jobs."""
    api = TestClient(create_app(Settings(data_dir=tmp_path), tokens=TOKENS))
    series = jobs_series(generate_latest(api.app.state.metrics).decode())  # type: ignore[attr-defined]
    assert series == {(t, p.value): 0.0 for t in TOKENS.values() for p in Phase}
    api.post("/v1/jobs", json={"name": "job-omicron"}, headers=ZETA)
    api.post("/v1/jobs", json={"name": "job-sigma"}, headers=ZETA)
    series = jobs_series(generate_latest(api.app.state.metrics).decode())  # type: ignore[attr-defined]
    assert series[("tenant-zeta", "Pending")] == 2.0 and series[("tenant-kappa", "Pending")] == 0.0
    assert sum(series.values()) == 2.0


def test_a_metrics_port_in_use_stops_the_start_naming_the_option(tmp_path: Path) -> None:
    reg = registry(SqlJobStore(tmp_path / "jobs.sqlite"), lambda: ["team-a"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = MetricsServer(reg, "127.0.0.1", taken.getsockname()[1])
        with pytest.raises(OSError, match="--metrics-port"):
            server.start()
    free = MetricsServer(reg, "127.0.0.1", 0)
    free.start()
    try:
        r = httpx.get(f"http://127.0.0.1:{free.port}/metrics")
        assert jobs_series(r.text)[("team-a", "Pending")] == 0.0
    finally:
        free.stop()


def test_fp8rl_serve_puts_the_series_on_the_metrics_port_only(tmp_path: Path) -> None:
    limits = '{"tenant-zeta": {"max_memory_mb": 64}}'  # the posted job's driver fails at once
    env = {"FP8RL_TENANT_LIMITS": limits, "FP8RL_DRIVER_RETRIES": "0"}
    with serve(tmp_path, TOKENS, env=env) as url:
        assert url.metrics != url
        r = httpx.post(f"{url}/v1/jobs", json={"name": "job-omicron"}, headers=ZETA)
        assert r.status_code == 201
        api = httpx.get(f"{url}/metrics")
        assert api.status_code == 404 and not any(name in api.text for name in HIDDEN)
        text = httpx.get(f"{url.metrics}/metrics").text
        series = jobs_series(text)
        assert {t for t, _ in series} == {"tenant-zeta", "tenant-kappa"}
        assert sum(v for (t, _), v in series.items() if t == "tenant-zeta") == 1.0
        assert sum(v for (t, _), v in series.items() if t == "tenant-kappa") == 0.0
        assert re.search(r'^fp8rl_jobs\{namespace="tenant-kappa",phase="Pending"\} 0\.0$', text, re.M)
