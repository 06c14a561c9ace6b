"""The README's `helm install` on a GPU cluster, command for command, on a cluster of its own (the
GPU example's tenants would collide with the session's): the namespace, the tokens Secret, the
install with the example's values and the digests a push printed, and the pods it lists.

The example turns the Prometheus Operator's monitors on and puts its Grafana dashboard in the
namespace ``monitoring``, so the Prometheus Operator's CRDs and that namespace must be on the cluster
(kube-prometheus-stack puts them there, the README's prerequisite); here the CRDs are stand-ins with
an open schema, made by the test: the API server stores the chart's monitors, nothing reads them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.tools import CHART, ROOT
from tests.helpers import wait_for
from tests.kube import build, install
from tests.kube.cluster import KubeCluster

pytestmark = pytest.mark.slow
GPU_VALUES = ROOT / "examples" / "helm-values-gpu.yaml"
PUSHED = {
    image: f"sha256:{n * 64}" for image, n in (("controlPlane", "a"), ("operator", "b"), ("worker", "c"))
}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    with KubeCluster(build.ensure(), tmp_path_factory.mktemp("kube-readme")) as cluster:
        yield cluster


def monitoring_crd(kind: str, plural: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}],
        },
    }  # fmt: skip


def test_the_readme_helm_install_as_written(fresh: KubeCluster, tmp_path: Path) -> None:
    kube = fresh
    for kind, plural in (
        ("ServiceMonitor", "servicemonitors"),
        ("PodMonitor", "podmonitors"),
        ("PrometheusRule", "prometheusrules"),
    ):
        kube.apply(monitoring_crd(kind, plural))
    kube.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    kube.namespace("monitoring")
    readme = (ROOT / "README.md").read_text()
    assert "kubectl create namespace fp8rl-system" in readme
    assert "helm install fp8rl helm/fp8rl -n fp8rl-system -f examples/helm-values-gpu.yaml" in readme

    # kubectl create namespace fp8rl-system
    kube.kubectl("create", "namespace", "fp8rl-system")
    # kubectl create secret generic fp8rl-tokens -n fp8rl-system --from-file=tokens.yaml
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump({"team-a-token-0123456789": "team-a", "team-b-token-0123456789": "team-b"})
    )
    kube.kubectl("create", "secret", "generic", "fp8rl-tokens", "-n", "fp8rl-system", f"--from-file={tokens}")
    # helm install fp8rl helm/fp8rl -n fp8rl-system -f examples/helm-values-gpu.yaml --set ...digest=...
    digests = ",".join(f"images.{image}.digest={digest}" for image, digest in PUSHED.items())
    install.helm(
        kube,
        "install",
        "fp8rl",
        str(CHART),
        "-n",
        "fp8rl-system",
        "-f",
        str(GPU_VALUES),
        "--set",
        digests,
        "--wait",
        "--timeout=180s",
    )

    # kubectl get pods -n fp8rl-system: fp8rl-api-... (2) and fp8rl-operator-... (1)
    pods = wait_for(
        lambda: kube.objects("pods", "fp8rl-system"),
        "the chart's pods Running",
        lambda ps: len(ps) == 3 and all(p["status"].get("phase") == "Running" for p in ps),
    )
    names = sorted(p["metadata"]["name"].rsplit("-", 2)[0] for p in pods)
    assert names == ["fp8rl-api", "fp8rl-api", "fp8rl-operator"]
    values = yaml.safe_load(GPU_VALUES.read_text())
    for pod in pods:
        image = pod["spec"]["containers"][0]["image"]
        component = "operator" if "operator" in pod["metadata"]["name"] else "controlPlane"
        assert image == f"{values['images'][component]['repository']}@{PUSHED[component]}"
    # the jobs' default image is the worker, pinned the same way; the tenants are restricted
    config = yaml.safe_load(
        (kube.get("configmap", "fp8rl-operator", "fp8rl-system") or {})["data"]["config.yaml"]
    )
    assert config["image"] == f"{values['images']['worker']['repository']}@{PUSHED['worker']}"
    for tenant in ("team-a", "team-b"):
        labels = (kube.get("namespace", tenant) or {})["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    monitors = json.loads(
        kube.kubectl("get", "servicemonitors,podmonitors,prometheusrules", "-A", "-o", "json").stdout
    )
    assert {m["kind"] for m in monitors["items"]} == {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    dashboard = kube.get("configmap", "fp8rl-dashboard", "monitoring")
    assert dashboard is not None and dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
