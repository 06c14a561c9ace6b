"""``fp8rl bench api``: latency of POST and GET /v1/jobs at 1, 10 and 50 concurrent clients.

The service runs on a free port (uvicorn, SQLite store, no executor, so only the control plane is
measured) in a process of its own, as it does when deployed: clients that shared its interpreter
would take their HTTP work out of its GIL, and the numbers would be the clients' as much as the
service's (``in_process=True`` runs it in this process, the first version of this benchmark).
Clients are threads with their own HTTP connections. It prints
p50/p99 per operation and concurrency level, and the requests per second all clients together
got answered (requests over the wall time from the first request sent to the last answer).
"""

from __future__ import annotations

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
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


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


def _clients(url: str, concurrency: int, requests: int, op: str, prefix: str) -> tuple[list[float], float]:
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
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as http:
            for i in range(requests):
                t = time.perf_counter()
                if op == "POST":
                    r = http.post("/v1/jobs", json={"name": f"{prefix}-{c}-{i}"})
                else:
                    r = http.get(f"/v1/jobs/{prefix}-0-0")
                dt = time.perf_counter() - t
                if r.status_code >= 400:
                    raise RuntimeError(f"{op} answered {r.status_code}: {r.text[:200]}")
                with lock:
                    latencies.append(dt)

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
    levels: tuple[int, ...] = (1, 10, 50), requests: int = 20, in_process: bool = False
) -> list[dict[str, Any]]:
    rows = []
    server = local_server if in_process else service_process
    with tempfile.TemporaryDirectory() as tmp, server(Path(tmp)) as url:
        for n in levels:
            post = _clients(url, n, requests, "POST", f"c{n}")
            get = _clients(url, n, requests, "GET", f"c{n}")
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
