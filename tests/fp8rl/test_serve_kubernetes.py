"""`fp8rl serve --store kubernetes` as a real process against kmock: a job submitted with the client
becomes an RLJob in the tenant's namespace, and the client reads it back from there."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from bench.kube_emulator import KubeEmulator
from fp8rl.cli import app
from tests.service import servers

TOKEN = "serve-kube-token-0123456789"
EXAMPLE = Path(__file__).parents[2] / "examples" / "arithmetic-cpu.yaml"


def test_serve_with_the_kubernetes_store(tmp_path: Path) -> None:
    with (
        KubeEmulator(tmp_path, namespaces=["team-a"]) as kube,
        servers.serve(
            tmp_path, {TOKEN: "team-a"}, "--store", "kubernetes", "--kubeconfig", str(kube.kubeconfig)
        ) as server,
    ):
        auth = ["--server", server, "--token", TOKEN]
        result = CliRunner().invoke(app, ["submit", str(EXAMPLE), "--name", "arith", *auth])
        assert result.exit_code == 0, result.output
        [obj] = kube.objects("rljobs", "team-a")
        assert obj["metadata"]["name"] == "arith" and obj["spec"]["job"]["steps"] == 250
        result = CliRunner().invoke(app, ["get", "arith", "-o", "json", *auth])
        assert json.loads(result.output)["status"]["phase"] == "Pending"
        # no SQLite, no local runs: the CR is the record
        assert not (tmp_path / "data").exists(), sorted(p.name for p in (tmp_path / "data").rglob("*"))
