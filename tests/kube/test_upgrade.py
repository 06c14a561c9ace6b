"""``helm upgrade`` from the previous chart (0.1.0, as released at HEAD e7cfa40, packaged in
``tests/kube/data``) to this one, with an RLJob running: the job keeps running, its RayJob, Ray
cluster and pods untouched, and the upgraded operator, with the chart's own ServiceAccount, takes
it over. Under 0.1.0 the chart's operator could not reconcile at all (its role had no ``get`` on
ConfigMaps), so the job runs there as the README then offered: ``fp8rl operator`` from a laptop
with the admin's credentials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.tools import CHART
from tests.helpers import wait_for
from tests.kube import install
from tests.kube.cluster import RESTRICTED, KubeCluster
from tests.kube.jobs import Jobs, tenant_kubeconfig
from tests.kube.podnet import PodNetwork
from tests.kube.test_operator import TINY, step_row

pytestmark = pytest.mark.slow
PREVIOUS = Path(__file__).with_name("data") / "fp8rl-0.1.0.tgz"
RELEASE, NS, TENANT = "prev", "prev-system", "prev-a"
OPERATOR = f"system:serviceaccount:{NS}:prev-fp8rl-operator"


def values() -> dict[str, Any]:
    return {**install.VALUES, "tenants": [{"name": TENANT, "createNamespace": True}], "auth": {"tokens": {}}}


def can_i(kube: KubeCluster, verb: str, resource: str) -> bool:
    done = kube.kubectl("auth", "can-i", verb, resource, f"--as={OPERATOR}", "-n", TENANT, check=False)
    return done.stdout.strip() == "yes"


def snapshot(kube: KubeCluster, jobs: Jobs, name: str) -> dict[str, Any]:
    rayjob = jobs.rayjob(name) or {}
    cluster = rayjob.get("status", {}).get("rayClusterName", "")
    return {
        "rayjob": rayjob.get("metadata", {}).get("uid"),
        "raycluster": (kube.get("raycluster", cluster, TENANT) or {}).get("metadata", {}).get("uid"),
        "pods": sorted(p["metadata"]["uid"] for p in jobs.pods(name)),
        "policy": (kube.get("networkpolicy", name, TENANT) or {}).get("metadata", {}).get("resourceVersion"),
    }


def test_helm_upgrade_from_0_1_0_keeps_a_running_job_running(
    kube: KubeCluster, chart: Path, podnet: PodNetwork, tmp_path: Path
) -> None:
    kube.namespace(NS, RESTRICTED)
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values()))
    install.helm(
        kube, "install", RELEASE, str(PREVIOUS), "-n", NS, "-f", str(path), "--wait", "--timeout=180s"
    )
    assert not can_i(kube, "get", "configmaps")  # 0.1.0's defect, as the API server decides it

    # a job running under 0.1.0, reconciled by an operator with the admin's credentials
    config = install.operator_config(kube, tmp_path, "prev-fp8rl-operator", NS)
    args = ("operator", f"--config={config}", f"--kubeconfig={kube.kubeconfig}", f"--namespace={TENANT}")
    laptop = install.fp8rl("laptop-operator", tmp_path, *args)
    jobs = Jobs(kube, TENANT, tenant_kubeconfig(kube, TENANT, tmp_path))
    try:
        jobs.apply("carried", TINY)
        wait_for(lambda: jobs.pods("carried"), "its pods Running", lambda ps: len(ps) == 4 and all(
            p["status"].get("phase") == "Running" for p in ps), timeout=90)  # fmt: skip
        driver = podnet.run_driver(TENANT, "carried")
        driver.exporter.observe(step_row(1, 0.5))
        jobs.wait_phase("carried", "Running")
    finally:
        laptop.stop()
    before = snapshot(kube, jobs, "carried")
    running_since = [c for c in jobs.status("carried")["conditions"] if c["type"] == "Running"]

    # the upgrade, then the chart's operator (its pod restarts: the config's checksum changed)
    install.helm(kube, "upgrade", RELEASE, str(CHART), "-n", NS, "-f", str(path), "--wait", "--timeout=180s")
    assert can_i(kube, "get", "configmaps") and not can_i(kube, "get", "secrets")
    labels = (kube.get("namespace", TENANT) or {})["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"  # new pods are held to it
    config = install.operator_config(kube, tmp_path, "prev-fp8rl-operator", NS)
    operator = install.start_operator(
        kube, tmp_path, podnet.url, (TENANT,), config, "chart-operator", (NS, "prev-fp8rl-operator")
    )
    try:
        driver.exporter.observe(step_row(2, 0.75))
        st = wait_for(
            lambda: jobs.status("carried"),
            "the upgraded operator to read step 2",
            lambda s: s.get("progress", {}).get("step") == 2,
        )
        assert st["phase"] == "Running"
        assert [c for c in st["conditions"] if c["type"] == "Running"] == running_since  # never left it
        assert snapshot(kube, jobs, "carried") == before  # nothing rebuilt, restarted or rewritten
        calls = [c for c in kube.audit(OPERATOR) if c.namespace == TENANT]
        assert calls and not [c for c in calls if c.code == 403]
        assert not [c for c in calls if c.verb in ("create", "delete") and c.resource == "rayjobs"]
        jobs.delete("carried")
        podnet.finish(TENANT, "carried")
    finally:
        operator.stop()
        print(operator.tail())
    install.helm(kube, "uninstall", RELEASE, "-n", NS, "--wait")
