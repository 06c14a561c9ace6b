"""The pod network, simulated: what would answer on the job pods' ports if their processes ran.

kwok gives pods IPs from a range nothing on this machine routes, and there is no kubelet, no
container and no kube-proxy. So the API server (its ``pods/proxy`` and ``services/proxy``), the
KubeRay operator, fp8rl's operator and Prometheus reach pods and Services through an HTTP proxy,
this one (``HTTP_PROXY``; Go's and httpx's clients honour it and never proxy 127.0.0.1). It resolves
the destination the way the cluster would, from the real API server's objects: a pod IP to its pod,
a Service name (``<svc>.<ns>.svc[.cluster.local]``) through its selector to a Ready pod, the
Service port to the container port. Then it answers as the process in that pod would:

- a Ray head's dashboard (8265): Ray's token authentication, as Ray 2.60 does it, from the head
  container's own environment (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN`` from its Secret): 401 without
  the token. With the token, the Jobs API's version and job reads. KubeRay 1.5.0 sends no token, so
  it is refused, as it is by a real Ray head (docs/deploy.md, "Ray clusters").
- the driver's metrics port on a head: a real ``PromExporter`` the test feeds, as the driver would
  (``SimulatedDriver``); nothing listens there until the test starts the driver.
- a submitter pod (``rayAuth: secret``): it "runs" ``ray job submit`` and follows the job's logs, so
  it ends when the driver does; ``SimulatedDriver.finish`` ends it (its container exits 0, as
  ``ray job logs --follow`` does whatever the job's outcome).

Anything else is a connection refused (502 from the proxy). This is the only simulated part of the
chain; the test says which driver runs and when it ends, nothing else.

The API server's ``pods/proxy`` and ``services/proxy`` requests reach this proxy addressed to the
API server's own address (URL and ``Host``), with the pod or Service only in the
``X-Forwarded-Uri`` header it adds; those are routed by that header.
"""

from __future__ import annotations

import base64
import http.server
import ipaddress
import json
import re
import threading
import urllib.parse
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from tests.kube.cluster import POD_CIDR, KubeCluster
from workers.job.prom_exporter import PromExporter

DASHBOARD_PORT = 8265


@dataclass
class SimulatedDriver:
    """The driver of one RLJob as its head pod would run it: its metrics exporter (real, fed by the
    test) and its end. ``state`` is Ray's job status the dashboard reports with the token."""

    namespace: str
    rljob: str
    exporter: PromExporter
    port: int = 0  # where the exporter listens on 127.0.0.1
    state: str = "RUNNING"
    ended: bool = False
    previous_exit: str = ""  # the exit of the attempt before (its supervisor's fp8rl_driver_attempt label)
    submission_ids: list[str] = field(default_factory=list)

    def step(self, row: dict[str, float]) -> None:
        """The driver finished a step: its metrics change as the real driver's do."""
        self.exporter.observe(row)


class PodNetwork:
    """The proxy; ``start(cluster)`` before the cluster's components start (they read its address)."""

    def __init__(self) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.podnet = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.cluster: KubeCluster | None = None
        self.drivers: dict[tuple[str, str], SimulatedDriver] = {}
        self.requests: list[tuple[str, str, int]] = []  # (who asked: client kind, url, status)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.server.serve_forever, name="podnet", daemon=True)

    def start(self) -> PodNetwork:
        self._thread.start()
        return self

    def attach(self, cluster: KubeCluster) -> None:
        self.cluster = cluster

    def stop(self) -> None:
        self.server.shutdown()
        for driver in self.drivers.values():
            driver.exporter.stop()

    # -- what the tests drive -------------------------------------------------------------------

    def run_driver(
        self, namespace: str, rljob: str, recipe: str = "fp8-e2e", attempt: int = 1, previous_exit: str = ""
    ) -> SimulatedDriver:
        """The driver of ``namespace/rljob`` starts (``attempt`` on its Ray cluster, as the
        driver's supervisor numbers them): its metrics port answers from now on."""
        exporter = PromExporter(job=rljob, namespace=namespace, recipe=recipe)
        exporter.attempt(attempt, previous_exit)
        port = exporter.serve(0, addr="127.0.0.1")
        driver = SimulatedDriver(namespace, rljob, exporter, port)
        with self._lock:
            old = self.drivers.get((namespace, rljob))
            self.drivers[(namespace, rljob)] = driver
        if old is not None:
            old.exporter.stop()
        return driver

    def restart_driver(self, namespace: str, rljob: str, exit_code: int) -> SimulatedDriver:
        """The driver exited with ``exit_code`` and its supervisor started it again on the same
        Ray cluster (workers.job.supervisor): the next attempt's metrics."""
        with self._lock:
            old = self.drivers[(namespace, rljob)]
        attempt = int(old.exporter.registry.get_sample_value(
            "fp8rl_driver_attempt", {**old.exporter.labels, "previous_exit": old.previous_exit}
        ) or 1)  # fmt: skip
        driver = self.run_driver(namespace, rljob, old.exporter.labels["recipe"], attempt + 1, str(exit_code))
        driver.previous_exit = str(exit_code)
        return driver

    def finish(self, namespace: str, rljob: str, succeeded: bool = True) -> None:
        """The driver exits (its metrics port closes); a submitter pod following it ends too."""
        with self._lock:
            driver = self.drivers[(namespace, rljob)]
        driver.state = "SUCCEEDED" if succeeded else "FAILED"
        driver.ended = True
        driver.exporter.stop()
        assert self.cluster is not None
        selector = f"fp8rl.io/rljob={rljob},fp8rl.io/group=submitter"
        for pod in self.cluster.objects("pods", namespace, selector):
            if pod.get("status", {}).get("phase") == "Running":
                self._exit(pod, 0)

    def _exit(self, pod: dict[str, Any], code: int) -> None:
        """Report ``pod``'s containers as exited with ``code`` (what its kubelet would write)."""
        assert self.cluster is not None
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        statuses = [
            {
                "name": c["name"],
                "image": c["image"],
                "ready": False,
                "restartCount": 0,
                "state": {
                    "terminated": {
                        "exitCode": code,
                        "reason": "Completed" if code == 0 else "Error",
                        "startedAt": now,
                        "finishedAt": now,
                    }
                },
            }
            for c in pod["spec"]["containers"]
        ]
        phase = "Succeeded" if code == 0 else "Failed"
        patch = {
            "status": {
                "phase": phase,
                "containerStatuses": statuses,
                "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
            }
        }
        meta = pod["metadata"]
        self.cluster.kubectl(
            "patch",
            "pod",
            meta["name"],
            "-n",
            meta["namespace"],
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(patch),
        )

    # -- resolving an address as the cluster would ----------------------------------------------

    def resolve(self, host: str, port: int) -> tuple[dict[str, Any], int] | None:
        """The pod and container port behind ``host:port`` (a pod IP or a Service name), or None."""
        assert self.cluster is not None
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return self._resolve_service(host, port)
        if ip not in ipaddress.ip_network(POD_CIDR):
            return None
        # an IP is reused once its pod is gone: the one running now, not one being deleted
        pods = self.cluster.objects("pods")
        found = [
            p
            for p in pods
            if p.get("status", {}).get("podIP") == host
            and p.get("status", {}).get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")
        ]
        return (found[0], port) if found else None

    def _resolve_service(self, host: str, port: int) -> tuple[dict[str, Any], int] | None:
        parts = host.split(".")
        if len(parts) < 3 or parts[2] != "svc":
            return None
        assert self.cluster is not None
        service = self.cluster.get("service", parts[0], parts[1])
        if service is None:
            return None
        target = None
        for p in service["spec"].get("ports", []):
            if p["port"] == port:
                target = p.get("targetPort", port)
        selector = service["spec"].get("selector") or {}
        if target is None or not selector:
            return None
        label = ",".join(f"{k}={v}" for k, v in selector.items())
        for pod in self.cluster.objects("pods", parts[1], label):
            ready = any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in pod.get("status", {}).get("conditions", [])
            )
            if ready:
                return pod, _container_port(pod, target)
        return None

    def resolve_forwarded(self, uri: str) -> tuple[dict[str, Any], int, str] | None:
        """The pod, port and path of an API server proxy URI
        (``/api/v1/namespaces/NS/pods|services/[SCHEME:]NAME[:PORT]/proxy/PATH``)."""
        found = re.fullmatch(
            r"/api/v1/namespaces/([^/]+)/(pods|services)/([^/]+)/proxy(/.*)?", uri.split("?")[0]
        )
        if found is None:
            return None
        ns, kind, ref, path = found.groups()
        parts = urllib.parse.unquote(ref).split(":")
        name, port = (parts[-2], parts[-1]) if len(parts) >= 2 else (parts[0], "80")
        assert self.cluster is not None
        if kind == "services":
            target = self._resolve_service(f"{name}.{ns}.svc", int(port) if port.isdigit() else -1)
            return (target[0], target[1], path or "/") if target else None
        pod = self.cluster.get("pod", name, ns)
        return (pod, int(port), path or "/") if pod is not None and port.isdigit() else None

    # -- the processes ------------------------------------------------------------------------------

    def answer(
        self, pod: dict[str, Any], port: int, method: str, path: str, headers: dict[str, str]
    ) -> tuple[int, str, bytes]:
        """(status, content type, body) of what listens on ``pod:port``; 502 where nothing does."""
        labels = pod["metadata"].get("labels") or {}
        ns = pod["metadata"]["namespace"]
        if labels.get("ray.io/node-type") != "head":
            return 502, "text/plain", b"connection refused: nothing listens in this simulated pod"
        driver = self.drivers.get((ns, labels.get("fp8rl.io/rljob", "")))
        if port == DASHBOARD_PORT:
            return self._dashboard(pod, method, path, headers, driver)
        if driver is not None and not driver.ended and _has_port(pod, port):
            response = httpx.get(f"http://127.0.0.1:{driver.port}{path}", timeout=5)
            return response.status_code, response.headers.get("content-type", "text/plain"), response.content
        return 502, "text/plain", b"connection refused"

    def _dashboard(
        self,
        pod: dict[str, Any],
        method: str,
        path: str,
        headers: dict[str, str],
        driver: SimulatedDriver | None,
    ) -> tuple[int, str, bytes]:
        mode, token = self._ray_auth(pod)
        if mode == "token":
            sent = headers.get("authorization", "")
            if sent != f"Bearer {token}":
                return 401, "application/json", b'{"error": "Unauthorized: missing or invalid token"}'
        if path.startswith("/api/version"):
            return 200, "application/json", json.dumps({"version": "4", "ray_version": "2.60.0"}).encode()
        if path.startswith("/api/jobs/") and method == "GET":
            job_id = path.rstrip("/").split("/")[-1]
            if driver is None:
                return 404, "application/json", b'{"error": "job not found"}'
            body = {
                "job_id": job_id,
                "submission_id": job_id,
                "status": driver.state,
                "message": "",
                "entrypoint": "",
            }
            return 200, "application/json", json.dumps(body).encode()
        return 404, "text/plain", b"not simulated"

    def _ray_auth(self, pod: dict[str, Any]) -> tuple[str, str]:
        """Ray's auth mode and token as the head container's environment gives them."""
        assert self.cluster is not None
        env = {e["name"]: e for e in pod["spec"]["containers"][0].get("env", [])}
        mode = (env.get("RAY_AUTH_MODE") or {}).get("value", "disabled")
        token_env = env.get("RAY_AUTH_TOKEN") or {}
        token = token_env.get("value", "")
        ref = (token_env.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            secret = self.cluster.get("secret", ref["name"], pod["metadata"]["namespace"]) or {}
            token = base64.b64decode((secret.get("data") or {}).get(ref["key"], "")).decode()
        return mode, token


def _has_port(pod: dict[str, Any], port: int) -> bool:
    return any(p.get("containerPort") == port for c in pod["spec"]["containers"] for p in c.get("ports", []))


def _container_port(pod: dict[str, Any], target: int | str) -> int:
    if isinstance(target, int):
        return target
    for c in pod["spec"]["containers"]:
        for p in c.get("ports", []):
            if p.get("name") == target:
                return int(p["containerPort"])
    return -1


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the tests read .requests
        return

    def _serve(self) -> None:
        net: PodNetwork = self.server.podnet  # type: ignore[attr-defined]
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        status, ctype, body = 502, "text/plain", b"bad proxy request"
        headers = {k.lower(): v for k, v in self.headers.items()}
        target: tuple[dict[str, Any], int] | None = None
        path = url.path + (f"?{url.query}" if url.query else "")
        if url.scheme == "http" and url.hostname:
            if "x-forwarded-uri" in headers:
                # the API server's pods/proxy and services/proxy name the pod or Service in the
                # X-Forwarded-Uri it sets (the URL it sends is its own address)
                found = net.resolve_forwarded(headers["x-forwarded-uri"])
                if found is not None:
                    target, path = (found[0], found[1]), found[2]
            else:
                target = net.resolve(url.hostname, url.port or 80)
            if target is None:
                status, body = 502, b"no route to host"
            else:
                status, ctype, body = net.answer(target[0], target[1], self.command, path, headers)
        with net._lock:
            net.requests.append((self.headers.get("user-agent", ""), self.path, status))
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve
