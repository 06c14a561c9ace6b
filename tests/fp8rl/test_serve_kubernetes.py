"""`fp8rl serve --store kubernetes` as a real process against kmock: a job submitted with the client
becomes an RLJob in the tenant's namespace, and the client reads it back from there."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from typer.testing import CliRunner

from bench.kube_emulator import KubeEmulator
from fp8rl.cli import app

TOKEN = "serve-kube-token-0123456789"
EXAMPLE = Path(__file__).parents[2] / "examples" / "arithmetic-cpu.yaml"


def test_serve_with_the_kubernetes_store(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({TOKEN: "team-a"}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with KubeEmulator(tmp_path, namespaces=["team-a"]) as kube:
        cmd = [sys.executable, "-m", "fp8rl", "serve", "--store", "kubernetes"]
        cmd += ["--kubeconfig", str(kube.kubeconfig), "--tokens-file", str(tokens), "--port", str(port)]
        env = {**os.environ, "FP8RL_DATA_DIR": str(tmp_path / "unused")}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        server = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                try:
                    if httpx.get(f"{server}/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "fp8rl serve did not become ready"
                time.sleep(0.2)
            auth = ["--server", server, "--token", TOKEN]
            result = CliRunner().invoke(app, ["submit", str(EXAMPLE), "--name", "arith", *auth])
            assert result.exit_code == 0, result.output
            [obj] = kube.objects("rljobs", "team-a")
            assert obj["metadata"]["name"] == "arith" and obj["spec"]["job"]["steps"] == 250
            result = CliRunner().invoke(app, ["get", "arith", "-o", "json", *auth])
            assert json.loads(result.output)["status"]["phase"] == "Pending"
            assert not (tmp_path / "unused").exists()  # no SQLite, no local runs: the CR is the record
        finally:
            proc.terminate()
            proc.wait(timeout=30)
