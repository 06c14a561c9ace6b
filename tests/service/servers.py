"""A real ``fp8rl serve`` process for the tests that talk to the service over HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.driver_process import DriverProcess
from tests.helpers import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Served(str):
    """The URL of a running ``fp8rl serve`` (a ``str``), with its ``pid`` and the URL of its
    metrics port (``metrics``)."""

    pid: int
    metrics: str


@contextlib.contextmanager
def serve(
    workdir: Path,
    tokens: dict[str, str],
    *args: str,
    env: dict[str, str] | None = None,
    ready: str = "/readyz",
) -> Iterator[Served]:
    """``fp8rl serve ARGS`` on a free port (and its metrics on another, unless ARGS name one) with
    ``tokens`` ({token: tenant}) and its data under ``workdir/data``; yields its URL once ``ready``
    answers 200. On exit every tenant's jobs are deleted (which stops their drivers), the server
    stops, and any driver left is killed."""
    tokens_file = workdir / "tokens.json"
    tokens_file.write_text(json.dumps(tokens))
    port = free_port()
    data = workdir / "data"
    cmd = [sys.executable, "-m", "fp8rl", "serve", "--port", str(port), "--tokens-file", str(tokens_file)]
    if "--metrics-port" not in args:
        args = ("--metrics-port", str(free_port()), *args)
    metrics_port = args[args.index("--metrics-port") + 1]
    cmd += ["--data-dir", str(data), *args]
    log_path = workdir / "serve.log"
    tools_bwrap = Path(__file__).resolve().parents[2] / ".tools" / "bin" / "bwrap"  # make tools (.ci/tools)
    sandbox = {"FP8RL_BWRAP": str(tools_bwrap)} if tools_bwrap.exists() else {}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, env={**os.environ, **sandbox, **(env or {})}, stdout=log, stderr=subprocess.STDOUT
        )
    url = Served(f"http://127.0.0.1:{port}")
    url.pid, url.metrics = proc.pid, f"http://127.0.0.1:{metrics_port}"

    def answer() -> int | str:
        assert proc.poll() is None, f"fp8rl serve exited:\n{log_path.read_text()}"
        try:
            return httpx.get(f"{url}{ready}").status_code
        except httpx.HTTPError as err:
            return repr(err)

    try:
        try:
            wait_for(answer, f"fp8rl serve to answer {ready} with 200", lambda got: got == 200, every=0.1)
        except pytest.fail.Exception:
            print(f"fp8rl serve log:\n{log_path.read_text()}")
            raise
        yield url
    finally:
        for token in tokens:
            headers = {"Authorization": f"Bearer {token}"}
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                jobs = httpx.get(f"{url}/v1/jobs", params={"limit": 500}, headers=headers).json()["items"]
                for job in jobs:
                    httpx.delete(f"{url}/v1/jobs/{job['name']}", headers=headers, timeout=30)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        # what is left of the drivers (each in a session of its own, with its local Ray): only a
        # driver still running, as its pid record's start time says. The pid of one that ended long
        # ago may be another test's process group by now (pids wrap, at 32768 by default), and a
        # blind killpg would take that test's processes down with it (a Ray head, say)
        for record in data.glob("runs/*/*/driver.pid"):
            driver = DriverProcess.attach(record)
            if driver is not None:
                driver.kill()
