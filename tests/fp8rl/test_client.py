"""The REST client commands against a real HTTP server (uvicorn in a thread, SQLite store)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from typer.testing import CliRunner

from fp8rl.cli import app
from service.main import create_app
from service.settings import Settings
from tests.helpers import wait_for

TOKEN = "client-token-0123456789"
runner = CliRunner()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    application = create_app(Settings(data_dir=tmp_path), tokens={TOKEN: "team-a"})
    srv = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_for(lambda: srv.started, "uvicorn to start", timeout=30, every=0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


def cli(server: str, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, [*args, "--server", server, "--token", TOKEN])
    return result.exit_code, result.output


def test_submit_list_get_suspend_resume_cancel(server: str, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("steps: 7\n")
    code, out = cli(server, "submit", str(spec), "--name", "arith")
    assert code == 0, out
    header, row = out.strip().splitlines()
    assert header.split()[:3] == ["NAME", "PHASE", "STEP"] and row.split()[:3] == ["arith", "Pending", "0/7"]
    code, out = cli(server, "get", "arith", "-o", "json")
    assert code == 0 and json.loads(out)["spec"]["steps"] == 7
    code, out = cli(server, "list")
    assert code == 0 and [line.split()[0] for line in out.strip().splitlines()[1:]] == ["arith"]
    assert cli(server, "suspend", "arith")[1].splitlines()[1].split()[1] == "Suspended"
    code, out = cli(server, "suspend", "arith")
    assert code == 1 and "HTTP 409: cannot suspend a job in phase Suspended" in out
    assert cli(server, "resume", "arith")[1].splitlines()[1].split()[1] == "Pending"
    assert cli(server, "cancel", "arith") == (0, "job arith cancelled and deleted\n")
    code, out = cli(server, "get", "arith")
    assert code == 1 and "HTTP 404" in out


def test_errors_are_shown_as_the_server_sent_them(server: str, tmp_path: Path) -> None:
    bad = runner.invoke(app, ["list", "--server", server, "--token", "wrong-token-0123456789"])
    assert bad.exit_code == 1 and "HTTP 401" in bad.output
    spec = tmp_path / "job.yaml"
    spec.write_text("steps: 1\n")
    code, out = cli(server, "submit", str(spec), "--name", "Bad_Name")
    assert code == 1 and "HTTP 422: name:" in out
    unreachable = runner.invoke(app, ["list", "--server", "http://127.0.0.1:9", "--token", TOKEN])
    assert unreachable.exit_code == 1 and "cannot reach" in unreachable.output


def test_token_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FP8RL_TOKEN", raising=False)
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 2 and "FP8RL_TOKEN" in result.output


@pytest.mark.parametrize("client", ["stdlib", "httpx"])
def test_bench_api_prints_percentiles_for_each_level(client: str) -> None:
    result = runner.invoke(app, ["bench", "api", "--clients", "1,3", "--requests", "4", "--client", client])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.strip().splitlines()[1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("POST", "1", "4"),
        ("GET", "1", "4"),
        ("POST", "3", "12"),
        ("GET", "3", "12"),
    ]
    for r in rows:
        assert 0 < float(r[3]) <= float(r[4])  # p50 <= p99
        assert float(r[5]) > 0  # requests per second
    # one client sends one request at a time, so the wall time is at least the sum of latencies,
    # of which at least half are >= p50: requests/s <= n / (n/2 * p50) = 2000 / p50_ms (p50 is
    # printed to 0.05 ms, requests/s to 0.5)
    for r in rows[:2]:
        assert float(r[5]) <= 2000 / (float(r[3]) - 0.05) + 0.5
    assert runner.invoke(app, ["bench", "api", "--clients", "0"]).exit_code == 2
    assert runner.invoke(app, ["bench", "api", "--client", "curl"]).exit_code == 2


def test_nearest_rank_percentile_by_hand() -> None:
    from bench.api import percentile

    values = [5.0, 1.0, 4.0, 2.0, 3.0]  # sorted 1..5; p50: rank ceil(2.5)=3 -> 3; p99: rank 5 -> 5
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 20)) == (3.0, 5.0, 1.0)
