"""A real Prometheus that finds the jobs' head pods the way the Prometheus Operator makes it find
them from the chart's PodMonitor: the PodMonitor's selector and port name as relabelling rules over
pod discovery, and the scrapes through the pod network stand-in (``proxy_url``), the one route to
the pods' IPs here.

Debian's Prometheus is built without Kubernetes service discovery (``kubernetes_sd_configs`` is an
unknown field there), so discovery is the one part done here: the pods of the PodMonitor's
namespaces, listed from the API server as a ServiceAccount allowed to list pods, written for
``file_sd_configs`` with the meta labels Kubernetes discovery gives (role ``pod``: one target per
container port). The relabelling, the scrapes and the storage are Prometheus's own."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client

from rljob.kube import api_client
from tests.helm.monitoring import prometheus_cmd, run_process
from tests.helm.tools import render
from tests.helpers import wait_for
from tests.kube import install
from tests.kube.cluster import KubeCluster, free_port

SCRAPE_S = 1


def chart_pod_monitor() -> dict[str, Any]:
    """The PodMonitor the chart renders with the test cluster's values and monitoring on."""
    values = {**install.VALUES, "monitoring": {"enabled": True}}
    objects = render("--api-versions", "monitoring.coreos.com/v1", values=values)
    [monitor] = [o for o in objects if o["kind"] == "PodMonitor"]
    return monitor


def _label(name: str) -> str:
    """A Kubernetes label name as service discovery's meta label suffix."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def scrape_config(monitor: dict[str, Any], targets: Path, proxy: str) -> dict[str, Any]:
    """What the Prometheus Operator generates for ``monitor`` (its first endpoint), over the
    targets ``discover`` writes to ``targets``."""
    spec = monitor["spec"]
    [endpoint] = spec["podMetricsEndpoints"]
    selector = spec["selector"]
    relabel: list[dict[str, Any]] = [
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}
    ]
    for key, value in selector.get("matchLabels", {}).items():
        sources = [
            f"__meta_kubernetes_pod_label_{_label(key)}",
            f"__meta_kubernetes_pod_labelpresent_{_label(key)}",
        ]
        relabel.append({"action": "keep", "source_labels": sources, "regex": f"({re.escape(value)});true"})
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "Exists", expression  # the chart uses no other
        source = f"__meta_kubernetes_pod_labelpresent_{_label(expression['key'])}"
        relabel.append({"action": "keep", "source_labels": [source], "regex": "true"})
    port_name = "__meta_kubernetes_pod_container_port_name"
    relabel.append({"action": "keep", "source_labels": [port_name], "regex": endpoint["port"]})
    relabel.append({"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"})
    return {
        "job_name": f"podMonitor/{monitor['metadata'].get('namespace', '')}/{monitor['metadata']['name']}/0",
        "honor_labels": endpoint["honorLabels"],
        "metrics_path": endpoint["path"],
        "scrape_interval": f"{SCRAPE_S}s",
        "scrape_timeout": f"{SCRAPE_S}s",
        "proxy_url": proxy,
        "file_sd_configs": [{"files": [str(targets)], "refresh_interval": f"{SCRAPE_S}s"}],
        "relabel_configs": relabel,
    }


def discover(kube: KubeCluster, token: str, namespaces: list[str]) -> list[dict[str, Any]]:
    """Kubernetes pod discovery's targets: one per container port of every pod with an IP in
    ``namespaces``, labelled as ``kubernetes_sd_configs`` (role ``pod``) labels them."""
    api = api_client(str(kube.write_kubeconfig(kube.workdir / "prometheus.kubeconfig", "prometheus", token)))
    core: Any = client.CoreV1Api(api)
    out = []
    for ns in namespaces:
        for pod in core.list_namespaced_pod(ns).items:
            if not pod.status.pod_ip:
                continue
            labels = {
                "__meta_kubernetes_namespace": ns,
                "__meta_kubernetes_pod_name": pod.metadata.name,
                "__meta_kubernetes_pod_phase": pod.status.phase or "",
            }
            for key, value in (pod.metadata.labels or {}).items():
                labels[f"__meta_kubernetes_pod_label_{_label(key)}"] = value
                labels[f"__meta_kubernetes_pod_labelpresent_{_label(key)}"] = "true"
            for container in pod.spec.containers:
                for port in container.ports or []:
                    target = {**labels, "__meta_kubernetes_pod_container_port_name": port.name or ""}
                    out.append({"targets": [f"{pod.status.pod_ip}:{port.container_port}"], "labels": target})
    api.close()
    return out


def service_account_token(kube: KubeCluster) -> str:
    """A token of ``monitoring/prometheus``, bound to what kube-prometheus-stack grants it here:
    get, list and watch pods."""
    kube.namespace("monitoring")
    if kube.get("serviceaccount", "prometheus", "monitoring") is None:
        kube.kubectl("create", "serviceaccount", "prometheus", "-n", "monitoring")
        kube.kubectl("create", "clusterrole", "prometheus-pods", "--verb=get,list,watch", "--resource=pods")
        kube.kubectl(
            "create", "clusterrolebinding", "prometheus-pods", "--clusterrole=prometheus-pods",
            "--serviceaccount=monitoring:prometheus",
        )  # fmt: skip
    return kube.token("monitoring", "prometheus")


@contextlib.contextmanager
def prometheus(kube: KubeCluster, workdir: Path, proxy: str) -> Iterator[str]:
    """A real ``prometheus`` scraping what the chart's PodMonitor selects; yields its URL."""
    workdir.mkdir(parents=True, exist_ok=True)
    monitor = chart_pod_monitor()
    token, targets = service_account_token(kube), workdir / "targets.json"
    namespaces = monitor["spec"]["namespaceSelector"]["matchNames"]
    targets.write_text(json.dumps(discover(kube, token, namespaces)))
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [scrape_config(monitor, targets, proxy)],
    }
    port = free_port()
    cmd = prometheus_cmd(workdir, config, port)
    url, log = f"http://127.0.0.1:{port}", workdir / "prometheus.log"
    stop = threading.Event()

    def rediscover() -> None:  # pods come and go: discovery follows, as Kubernetes discovery does
        while not stop.wait(SCRAPE_S):
            with contextlib.suppress(Exception):
                fresh = workdir / "targets.tmp"
                fresh.write_text(json.dumps(discover(kube, token, namespaces)))
                fresh.replace(targets)

    follower = threading.Thread(target=rediscover, daemon=True)
    with run_process(cmd, log, signal.SIGTERM, 30, group=False):
        follower.start()

        def ready() -> int | str:
            try:
                return httpx.get(f"{url}/-/ready").status_code
            except httpx.HTTPError as err:
                return repr(err)

        try:
            wait_for(ready, "prometheus ready", lambda c: c == 200, timeout=60)
            yield url
        finally:
            stop.set()
            follower.join(timeout=10)


def query(url: str, expr: str) -> list[tuple[dict[str, str], float]]:
    body = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", body
    return [(s["metric"], float(s["value"][1])) for s in body["data"]["result"]]
