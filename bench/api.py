"""``fp8rl bench api``: latency of POST and GET /v1/jobs at 1, 10 and 50 concurrent clients.

The service runs on a free port (uvicorn, SQLite store, no executor, so only the control plane is
measured) in a process of its own, as it does when deployed: clients that shared its interpreter
would take their HTTP work out of its GIL, and the numbers would be the clients' as much as the
service's (``in_process=True`` runs it in this process, the first version of this benchmark).
Clients are threads, each with its own keep-alive connection through the standard library's
``http.client`` (``client="httpx"``: through httpx, as ``fp8rl submit`` talks, which costs the
clients several times the CPU per request and, on a 2-core machine, takes it from the service). It prints
p50/p99 per operation and concurrency level, and the requests per second all clients together
got answered (requests over the wall time from the first request sent to the last answer).
"""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.operator import stop

TOKEN = "bench-token-0123456789abcdef"


def _app(data_dir: Path) -> Any:
    from service.main import create_app
    from service.settings import Settings

    return create_app(Settings(data_dir=data_dir, max_concurrent_jobs=10**9), tokens={TOKEN: "bench"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve(data_dir: str, port: int) -> None:
    """The benchmarked service, in the process that calls this (the child of :func:`service_process`)."""
    import uvicorn

    uvicorn.run(_app(Path(data_dir)), host="127.0.0.1", port=port, log_level="error")


@contextmanager
def service_process(data_dir: Path) -> Iterator[str]:
    """The service in a child process; yields its URL once it answers."""
    port = _free_port()
    code = f"from bench.api import serve; serve({str(data_dir)!r}, {port})"
    child = subprocess.Popen([sys.executable, "-c", code])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if child.poll() is not None:
                raise RuntimeError(f"the benchmarked service exited with code {child.returncode}")
            try:
                if httpx.get(f"{url}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)
        yield url
    finally:
        stop(child, timeout_s=10)


@contextmanager
def local_server(data_dir: Path) -> Iterator[str]:
    """The service in a thread of this process."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(_app(data_dir), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


class _StdlibClient:
    """One keep-alive connection through the standard library's ``http.client``: a fraction of
    httpx's CPU per request, so that on a small machine the clients take less of the cores the
    service runs on (the numbers are then more the service's)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
        self.conn.request(method, path, json.dumps(body) if body is not None else None, self.headers)
        answer = self.conn.getresponse()
        return answer.status, answer.read().decode(errors="replace")

    def close(self) -> None:
        self.conn.close()


class _HttpxClient:
    """The same over httpx (what ``fp8rl submit`` uses): heavier on the clients' side."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
        answer = self.http.request(method, path, json=body)
        return answer.status_code, answer.text

    def close(self) -> None:
        self.http.close()


CLIENTS: dict[str, type[_StdlibClient] | type[_HttpxClient]] = {
    "stdlib": _StdlibClient,
    "httpx": _HttpxClient,
}


def _clients(
    url: str, concurrency: int, requests: int, op: str, prefix: str, client: str = "stdlib"
) -> tuple[list[float], float]:
    """Every request's latency, and the wall time of them all (s)."""
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(c: int) -> None:
        try:
            _work(c)
        except BaseException as err:  # a failed request fails the benchmark, not one thread quietly
            with lock:
                errors.append(err)

    def _work(c: int) -> None:
        http = CLIENTS[client](url)
        try:
            for i in range(requests):
                t = time.perf_counter()
                if op == "POST":
                    code, text = http.request("POST", "/v1/jobs", {"name": f"{prefix}-{c}-{i}"})
                else:
                    code, text = http.request("GET", f"/v1/jobs/{prefix}-0-0")
                dt = time.perf_counter() - t
                if code >= 400:
                    raise RuntimeError(f"{op} answered {code}: {text[:200]}")
                with lock:
                    latencies.append(dt)
        finally:
            http.close()

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} clients failed: {errors[0]!r}")
    return latencies, wall


def run(
    levels: tuple[int, ...] = (1, 10, 50),
    requests: int = 20,
    in_process: bool = False,
    client: str = "stdlib",
) -> list[dict[str, Any]]:
    if client not in CLIENTS:
        raise ValueError(f"client {client!r}: pick one of {', '.join(CLIENTS)}")
    rows = []
    server = local_server if in_process else service_process
    with tempfile.TemporaryDirectory() as tmp, server(Path(tmp)) as url:
        for n in levels:
            post = _clients(url, n, requests, "POST", f"c{n}", client)
            get = _clients(url, n, requests, "GET", f"c{n}", client)
            for op, (lat, wall) in (("POST", post), ("GET", get)):
                rows.append(
                    {
                        "op": op,
                        "clients": n,
                        "requests": len(lat),
                        "p50_ms": 1000 * percentile(lat, 50),
                        "p99_ms": 1000 * percentile(lat, 99),
                        "mean_ms": 1000 * statistics.fmean(lat),
                        "per_s": len(lat) / wall,
                    }
                )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'op':<5} {'clients':>7} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7}"]
    for r in rows:
        lines.append(
            f"{r['op']:<5} {r['clients']:>7} {r['requests']:>8} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f}"
            f" {r['per_s']:>7.0f}"
        )
    return "\n".join(lines)
