"""A real Prometheus scraping real fp8rl processes, for the dashboard and alert tests.

:func:`monitored` starts, under one directory:

- ``fp8rl run`` of a tiny ``fp8-e2e`` job (so the importance-sampling and mismatch metrics carry
  values) that validates every step (so the validation gauges exist), with ``--metrics-port``. Its
  metrics carry ``job="dash"`` (the output directory's name) and ``namespace="default"``;
- ``fp8rl serve`` (SQLite store) with two tenants: ``default`` holds one job that fails at once
  (its tenant's memory limit is far below what a driver needs: no second training process, and the
  job-failure alert has something to see), ``team-idle`` holds none;
- ``prometheus`` scraping both every second with the settings of the chart's PodMonitor and
  ServiceMonitor (``honorLabels``, path) and evaluating the chart's PrometheusRule.

It waits until Prometheus holds several steps of the run and the failed job, takes that moment as
the evaluation time of every query (so all checks see one consistent state), and stops the run.
Leaving the block stops every process it started, also after a failure.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import yaml

from tests.helm.tools import by_kind, render, tool
from tests.helpers import ONE_DIGIT_SUMS, TINY_MODEL, wait_for
from tests.service.servers import free_port, serve

__all__ = ["Prometheus", "QueryError", "Sample", "metric_names", "monitored", "pod_monitor", "scraping"]

SCRAPE_S = 1  # scrape and rule-evaluation interval, s
DRIVER_JOB, DRIVER_NAMESPACE, RECIPE = "dash", "default", "fp8-e2e"
IDLE_TENANT = "team-idle"
API_JOB = "fp8rl-api"  # the scrape job of the control plane (the Service's name in a cluster)
MAX_NEW_TOKENS = 3
TOKENS = {"monitoring-token-0123456789": DRIVER_NAMESPACE, "monitoring-idle-0123456789": IDLE_TENANT}
RUN_SPEC: dict[str, Any] = {
    "model": {"tiny": TINY_MODEL},
    "task": {"params": ONE_DIGIT_SUMS, "size": 50},
    "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": MAX_NEW_TOKENS},
    "warmup": {"sft_steps": 1, "batch_size": 4},
    "validation": {"interval": 1, "size": 4, "pass_k": 2},
    # the per-layer attribution every step, so that its series is there for the dashboard
    "precision": {"recipe": RECIPE, "fp8_kv_cache": True, "mismatch_slo": {"attribution_interval": 1}},
    "steps": 100_000,  # never reached: the run is stopped once Prometheus has what it needs
    "checkpoint_interval": 100_000,
}
STARTUP_S = 150  # Ray's start takes most of it (half a minute on 2 busy CPUs)
_METRIC = re.compile(r"\bfp8rl_[a-z0-9_]+")


def metric_names(expr: str) -> set[str]:
    """The fp8rl metric names written in ``expr`` (every fp8rl metric starts with ``fp8rl_``)."""
    return set(_METRIC.findall(expr))


class Sample(NamedTuple):
    labels: dict[str, str]
    value: float


class QueryError(Exception):
    """Prometheus refused a request; the message is Prometheus' own."""


@dataclass(frozen=True)
class Prometheus:
    """The HTTP API of the running Prometheus; every query is evaluated at ``at`` (unix s)."""

    url: str
    at: float
    driver_instance: str  # the ``instance`` label of the run's series
    api_instance: str  # and of the control plane's
    http: httpx.Client = field(repr=False, compare=False)

    def api(self, path: str, params: dict[str, Any]) -> Any:
        """The ``data`` of ``GET /api/v1/<path>``; raises :class:`QueryError` on an error answer."""
        r = self.http.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise QueryError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[Sample]:
        """The instant vector of ``expr`` at ``at``; a scalar is one sample without labels."""
        data = self.api("query", {"query": expr, "time": self.at})
        if data["resultType"] == "scalar":
            return [Sample({}, float(data["result"][1]))]
        if data["resultType"] != "vector":
            raise QueryError(f"{expr!r} gives a {data['resultType']}, not an instant vector")
        return [Sample(s["metric"], float(s["value"][1])) for s in data["result"]]

    def label_values(self, label: str, match: str | None = None, window_s: float = 6 * 3600) -> list[str]:
        """Values of ``label`` over the ``window_s`` before ``at``, on the series ``match`` selects
        (what Grafana asks for ``label_values(match, label)``)."""
        params: dict[str, Any] = {"start": self.at - window_s, "end": self.at}
        if match is not None:
            params["match[]"] = match
        return sorted(self.api(f"label/{label}/values", params))

    def series(self, match: str) -> list[dict[str, str]]:
        """The label sets of the series ``match`` selects, in the minute before ``at``."""
        found: list[dict[str, str]] = self.api(
            "series", {"match[]": match, "start": self.at - 60, "end": self.at}
        )
        return found

    def rules(self) -> list[dict[str, Any]]:
        """The rules Prometheus loaded, with their health and last error."""
        groups = self.api("rules", {})["groups"]
        return [rule for g in groups for rule in g["rules"]]


def _ready(prom: Prometheus) -> list[str]:
    """What Prometheus does not hold yet at ``prom.at`` (empty: ready)."""
    job = f'job="{DRIVER_JOB}"'
    wanted = {
        "three steps of the run in the last 20s": f"changes(fp8rl_step{{{job}}}[20s]) >= 3",
        "the run's validation": f"fp8rl_val_accuracy{{{job}}}",
        "the failed job": f'fp8rl_jobs{{namespace="{DRIVER_NAMESPACE}", phase="Failed"}} == 1',
        "the idle tenant": f'fp8rl_jobs{{namespace="{IDLE_TENANT}"}}',
    }
    return [what for what, expr in wanted.items() if not prom.query(expr)]


def _scrape_config(name: str, endpoint: dict[str, Any], target: str) -> dict[str, Any]:
    """A scrape config of ``target`` (host:port) with a monitor endpoint's settings."""
    return {
        "job_name": name,
        "honor_labels": endpoint["honorLabels"],
        "metrics_path": endpoint["path"],
        "static_configs": [{"targets": [target]}],
    }


def prometheus_config(driver: str, api: str, rule_file: Path) -> dict[str, Any]:
    """Scrape configs with the chart's monitor settings for the run (``driver``) and the control
    plane (``api``), and the chart's rules."""
    objects = by_kind(render("--api-versions", "monitoring.coreos.com/v1"))
    [pod_monitor], [service_monitor] = objects["PodMonitor"], objects["ServiceMonitor"]
    [rule] = objects["PrometheusRule"]
    rule_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))

    scrape = _scrape_config
    interval = f"{SCRAPE_S}s"
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "rule_files": [str(rule_file)],
        "scrape_configs": [
            scrape("fp8rl-jobs", pod_monitor["spec"]["podMetricsEndpoints"][0], driver),
            scrape(API_JOB, service_monitor["spec"]["endpoints"][0], api),
        ],
    }


def prometheus_cmd(workdir: Path, config: dict[str, Any], port: int) -> list[str]:
    """A real Prometheus on 127.0.0.1:``port`` with ``config`` (written to ``workdir``) and its
    data under ``workdir``."""
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return [
        tool("prometheus"),
        f"--config.file={path}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]


def _tail(path: Path, chars: int = 4000) -> str:
    return f"--- {path.name} ---\n{path.read_text(errors='replace')[-chars:] if path.exists() else '(none)'}"


def _stop(proc: subprocess.Popen[bytes], sig: int, grace_s: float, group: bool = False) -> None:
    """Send ``sig``; after ``grace_s`` SIGKILL (its whole process group when ``group``)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if group:  # what is left of its session: the run's local Ray processes
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def run_process(
    cmd: list[str], log: Path, sig: int, grace_s: float, group: bool
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=group)
    try:
        yield proc
    finally:
        _stop(proc, sig, grace_s, group)


def _fail_job_at_once(url: str) -> None:
    token = next(t for t, tenant in TOKENS.items() if tenant == DRIVER_NAMESPACE)
    r = httpx.post(f"{url}/v1/jobs", json={"name": "oom"}, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201, r.text


@contextlib.contextmanager
def monitored(workdir: Path) -> Iterator[Prometheus]:
    """The stack described in the module docstring; yields the Prometheus to query."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "api").mkdir(exist_ok=True)
    spec_file = workdir / "spec.json"
    spec_file.write_text(json.dumps(RUN_SPEC))
    run_port, prom_port = free_port(), free_port()
    prom_url = f"http://127.0.0.1:{prom_port}"
    run_cmd = [sys.executable, "-m", "fp8rl", "run", str(spec_file), "--output", str(workdir / DRIVER_JOB)]
    run_cmd += ["--metrics-port", str(run_port), "--no-progress"]
    # 64 MiB of address space: the driver cannot even import torch, and the job fails at once
    limits = {"FP8RL_TENANT_LIMITS": json.dumps({DRIVER_NAMESPACE: {"max_memory_mb": 64}})}
    logs = [workdir / "run.log", workdir / "api" / "serve.log", workdir / "prometheus.log"]
    with contextlib.ExitStack() as stack:
        try:
            api_url = stack.enter_context(serve(workdir / "api", TOKENS, "--store", "sql", env=limits))
            _fail_job_at_once(api_url)
            run = stack.enter_context(run_process(run_cmd, logs[0], signal.SIGINT, 60, group=True))
            # the control plane's series are on its metrics port (as the chart's ServiceMonitor scrapes)
            driver, api = f"127.0.0.1:{run_port}", api_url.metrics.removeprefix("http://")
            prom_cmd = prometheus_cmd(
                workdir, prometheus_config(driver, api, workdir / "rules.yaml"), prom_port
            )
            prom_proc = stack.enter_context(run_process(prom_cmd, logs[2], signal.SIGTERM, 30, group=False))
            deadline = time.monotonic() + STARTUP_S
            missing = ["Prometheus to answer"]
            http = stack.enter_context(httpx.Client())
            while missing:
                assert run.poll() is None, f"fp8rl run exited with {run.returncode}"
                assert prom_proc.poll() is None, f"prometheus exited with {prom_proc.returncode}"
                assert time.monotonic() < deadline, f"after {STARTUP_S}s, still waiting for {missing}"
                time.sleep(0.5)
                prom = Prometheus(prom_url, math.floor(time.time() * 1000) / 1000, driver, api, http)
                with contextlib.suppress(httpx.HTTPError):
                    missing = _ready(prom)
        except Exception as err:
            lines = [f"the monitored stack did not start: {err}", *map(_tail, logs)]
            raise AssertionError("\n".join(lines)) from err
        # Ctrl-C: the run stops after this step (a checkpoint, Ray shut down); the queries read `at`
        _stop(run, signal.SIGINT, 60, group=True)
        yield prom


def pod_monitor() -> dict[str, Any]:
    """The chart's PodMonitor of the jobs' head pods (the chart rendered with its monitoring on)."""
    [monitor] = by_kind(render("--api-versions", "monitoring.coreos.com/v1"))["PodMonitor"]
    return monitor


@contextlib.contextmanager
def scraping(workdir: Path, driver: str) -> Iterator[str]:
    """A real ``prometheus`` scraping one driver's ``/metrics`` at ``driver`` (host:port) every
    ``SCRAPE_S`` with the settings of the chart's PodMonitor (``honorLabels``, path), and nothing
    else; yields its URL once it is ready. Leaving the block stops it, also after a failure."""
    workdir.mkdir(parents=True, exist_ok=True)
    endpoint = pod_monitor()["spec"]["podMetricsEndpoints"][0]
    interval, port = f"{SCRAPE_S}s", free_port()
    scrape = _scrape_config("fp8rl-jobs", endpoint, driver)
    config = {"global": {"scrape_interval": interval, "scrape_timeout": interval}, "scrape_configs": [scrape]}
    cmd = prometheus_cmd(workdir, config, port)
    url, log = f"http://127.0.0.1:{port}", workdir / "prometheus.log"
    with run_process(cmd, log, signal.SIGTERM, 30, group=False) as proc:

        def ready() -> int | str:
            assert proc.poll() is None, f"prometheus exited with {proc.returncode}\n{_tail(log)}"
            try:
                return httpx.get(f"{url}/-/ready").status_code
            except httpx.HTTPError as err:
                return repr(err)

        wait_for(ready, "prometheus to be ready", lambda got: got == 200, timeout=60)
        yield url
