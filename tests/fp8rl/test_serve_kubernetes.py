"""`fp8rl serve --store kubernetes` as a real process on the test cluster (tests/kube), acting as the
chart's control plane ServiceAccount: a job submitted with the client becomes an RLJob in the
tenant's namespace, and the client reads it back from there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8rl.cli import app
from tests.kube.cluster import KubeCluster
from tests.service import servers

pytestmark = pytest.mark.slow
TOKEN = "serve-kube-token-0123456789"
EXAMPLE = Path(__file__).parents[2] / "examples" / "arithmetic-cpu.yaml"


def test_serve_with_the_kubernetes_store(
    tmp_path: Path, kube: KubeCluster, tenant: str, control_plane_kubeconfig: Path
) -> None:
    args = ("--store", "kubernetes", "--kubeconfig", str(control_plane_kubeconfig))
    with servers.serve(tmp_path, {TOKEN: tenant}, *args) as server:
        auth = ["--server", server, "--token", TOKEN]
        result = CliRunner().invoke(app, ["submit", str(EXAMPLE), "--name", "arith", *auth])
        assert result.exit_code == 0, result.output
        [obj] = kube.objects("rljobs", tenant)
        assert obj["metadata"]["name"] == "arith" and obj["spec"]["job"]["steps"] == 250
        result = CliRunner().invoke(app, ["get", "arith", "-o", "json", *auth])
        assert json.loads(result.output)["status"]["phase"] == "Pending"
        # no SQLite, no local runs: the CR is the record
        assert not (tmp_path / "data").exists(), sorted(p.name for p in (tmp_path / "data").rglob("*"))
