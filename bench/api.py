"""``fp8rl bench api``: latency of POST and GET /v1/jobs at 1, 10 and 50 concurrent clients.

The service runs in this process on a free port (uvicorn, SQLite store, no executor, so only the
control plane is measured), and clients are threads with their own HTTP connections. It prints
p50/p99 per operation and concurrency level, and the requests per second all clients together
got answered (requests over the wall time from the first request sent to the last answer).
"""

from __future__ import annotations

import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

TOKEN = "bench-token-0123456789abcdef"


@contextmanager
def local_server(data_dir: Path) -> Iterator[str]:
    import uvicorn

    from service.app import create_app
    from service.settings import Settings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(Settings(data_dir=data_dir, max_concurrent_jobs=10**9), tokens={TOKEN: "bench"})
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
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


def run(levels: tuple[int, ...] = (1, 10, 50), requests: int = 20) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, local_server(Path(tmp)) as url:
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
