"""``helm upgrade`` from the previous chart (0.1.0, as released at HEAD e7cfa40, packaged in
``tests/kube/data``) to this one, on a cluster of its own (its CRDs are 0.1.0's, as on a real
cluster that ran that release):

0. This chart mints the tokens Secret only when rendered against the cluster (``helm template``
   without one, as a GitOps tool renders, is refused).
1. Under 0.1.0 an RLJob is made. Nothing runs it: the chart's operator role has no ``get`` on
   ConfigMaps (the API server says so).
2. ``helm upgrade``: the roles are fixed, but helm does not update CRDs, and this operator writes
   fields 0.1.0's RLJob CRD lacks (``status.attempts``). It refuses to start, naming the command;
   once the CRD is applied as it says, it starts and runs the job made under 0.1.0.
3. ``helm upgrade`` again, with changed values, while the job runs: the operator's pod restarts
   with the new config, and the job keeps running, its RayJob, Ray cluster and pods untouched.
   The tokens 0.1.0 generated are kept through both upgrades.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.auth import load_tokens
from tests.helm.tools import CHART
from tests.helpers import wait_for
from tests.kube import build, install
from tests.kube.cluster import RESTRICTED, KubeCluster
from tests.kube.jobs import Jobs, tenant_kubeconfig
from tests.kube.podnet import PodNetwork
from tests.kube.test_operator import TINY, running_pods, step_row

pytestmark = pytest.mark.slow
PREVIOUS = Path(__file__).with_name("data") / "fp8rl-0.1.0.tgz"
RELEASE, NS, TENANT = "prev", "prev-system", "prev-a"
SA = (NS, "prev-fp8rl-operator")
OPERATOR = f"system:serviceaccount:{NS}:prev-fp8rl-operator"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KubeCluster, PodNetwork]]:
    """A cluster of its own: no CRD of this version on it yet."""
    net = PodNetwork().start()
    cluster = KubeCluster(build.ensure(), tmp_path_factory.mktemp("kube-upgrade"), proxy=net.url)
    net.attach(cluster)
    with cluster:
        yield cluster, net
    net.stop()


def values(poll_seconds: int) -> dict[str, Any]:
    chosen = {
        **install.VALUES,
        "tenants": [{"name": TENANT, "createNamespace": True}],
        "auth": {"tokens": {}},
    }
    chosen["jobDefaults"] = {**install.VALUES["jobDefaults"], "pollSeconds": poll_seconds}
    return chosen


def tokens(kube: KubeCluster, workdir: Path) -> dict[str, str]:
    """The tokens the chart generated into its Secret, as the control plane loads them."""
    secret = kube.get("secret", f"{RELEASE}-fp8rl-tokens", NS)
    assert secret is not None, "the chart generated no tokens Secret"
    path = workdir / "tokens.yaml"
    path.write_bytes(base64.b64decode(secret["data"]["tokens.yaml"]))
    return load_tokens(path)


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


def helm_release(kube: KubeCluster, verb: str, chart: Path, workdir: Path, poll_seconds: int) -> None:
    path = workdir / f"values-{verb}-{poll_seconds}.yaml"
    path.write_text(yaml.safe_dump(values(poll_seconds)))
    install.helm(kube, verb, RELEASE, str(chart), "-n", NS, "-f", str(path), "--wait", "--timeout=180s")
    install.wait_for_quotas(kube)


def test_helm_upgrade_from_0_1_0_runs_the_jobs_made_under_it_and_keeps_a_running_one_running(
    fresh: tuple[KubeCluster, PodNetwork], tmp_path: Path
) -> None:
    kube, podnet = fresh
    kube.namespace(NS, RESTRICTED)
    # this chart mints tokens only where the cluster keeps them: rendered against the cluster,
    # one per tenant; rendered without it (helm template, a GitOps tool), refused
    path = tmp_path / "values-render.yaml"
    path.write_text(yaml.safe_dump(values(1)))
    render = ["template", RELEASE, str(CHART), "-n", NS, "-f", str(path)]
    [secret] = [
        doc
        for doc in yaml.safe_load_all(install.helm(kube, *render, "--dry-run=server").stdout)
        if doc and doc["kind"] == "Secret"
    ]
    (tmp_path / "rendered.yaml").write_bytes(base64.b64decode(secret["data"]["tokens.yaml"]))
    assert list(load_tokens(tmp_path / "rendered.yaml").values()) == [TENANT]
    offline = install.helm(kube, *render, check=False)
    assert offline.returncode != 0 and "no cluster to keep generated tokens in" in offline.stderr
    helm_release(kube, "install", PREVIOUS, tmp_path, 1)
    assert not can_i(kube, "get", "configmaps")  # 0.1.0's defect, as the API server decides it
    generated = tokens(kube, tmp_path)  # auth.tokens empty: one per tenant, minted on install
    assert list(generated.values()) == [TENANT] and all(len(t) >= 16 for t in generated)
    jobs = Jobs(kube, TENANT, tenant_kubeconfig(kube, TENANT, tmp_path))
    jobs.apply("carried", TINY)

    # the upgrade: roles fixed; the CRD is still 0.1.0's, and the operator says what to do
    helm_release(kube, "upgrade", CHART, tmp_path, 1)
    assert tokens(kube, tmp_path) == generated  # kept: the upgrade read them back (lookup)
    assert can_i(kube, "get", "configmaps") and not can_i(kube, "get", "secrets")
    assert (kube.get("namespace", TENANT) or {})["metadata"]["labels"][
        "pod-security.kubernetes.io/enforce"
    ] == ("restricted")
    config = install.operator_config(kube, tmp_path, "prev-fp8rl-operator", NS)
    refused = install.start_operator(kube, tmp_path, podnet.url, (TENANT,), config, "old-crd", SA)
    assert refused.proc.wait(timeout=90) != 0
    last = refused.log.read_text().strip().splitlines()[-1]
    assert last == (
        "error: the RLJob CRD on the cluster is older than this operator: it lacks "
        "spec.job.task.validation_dataset, spec.job.task.grader, spec.job.task.graders, "
        "spec.job.task.max_grader_error_fraction, spec.job.validation.pass_k, "
        "spec.job.validation.pass_k_temperature, spec.job.precision.kv_calibration_sequences, "
        "spec.job.precision.bf16_layers, "
        "spec.job.precision.mismatch_slo, spec.cluster.inPlaceRetries, status.attempts, which the API "
        "server would drop from what the "
        "operator writes. Apply this version's CRD first (helm install/upgrade does not update CRDs): "
        "kubectl apply --server-side --force-conflicts -f helm/fp8rl/crds/"
    ), last
    # as it says (helm owns the CRD's fields: without --force-conflicts the apply is refused)
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))

    operator = install.start_operator(kube, tmp_path, podnet.url, (TENANT,), config, "operator", SA)
    try:
        running_pods(jobs, "carried")
        driver = podnet.run_driver(TENANT, "carried")
        driver.exporter.observe(step_row(1, 0.5))
        jobs.wait_phase("carried", "Running")
        before = snapshot(kube, jobs, "carried")
        running_since = [c for c in jobs.status("carried")["conditions"] if c["type"] == "Running"]
        [attempt] = jobs.status("carried")["attempts"]  # the CRD keeps what the operator writes
        assert (attempt["number"], attempt["cluster"], attempt["outcome"]) == (1, "new", "Running")
    finally:
        operator.stop()

    # an upgrade with a job running: the operator's pod restarts with the new config
    helm_release(kube, "upgrade", CHART, tmp_path, 2)
    config = install.operator_config(kube, tmp_path, "prev-fp8rl-operator", NS)
    assert yaml.safe_load(config.read_text())["poll_seconds"] == 2
    assert tokens(kube, tmp_path) == generated
    operator = install.start_operator(kube, tmp_path, podnet.url, (TENANT,), config, "upgraded", SA)
    try:
        driver.exporter.observe(step_row(2, 0.75))
        st = wait_for(
            lambda: jobs.status("carried"),
            "the upgraded operator to read step 2",
            lambda s: s.get("progress", {}).get("step") == 2,
        )
        assert st["phase"] == "Running"
        assert [c for c in st["conditions"] if c["type"] == "Running"] == running_since  # never left it
        assert len(st["attempts"]) == 1  # the same attempt: nothing restarted
        assert snapshot(kube, jobs, "carried") == before  # nothing rebuilt, restarted or rewritten
        calls = [c for c in kube.audit(OPERATOR) if c.namespace == TENANT]
        assert calls and not [c for c in calls if c.code == 403]
        jobs.delete("carried")
        podnet.finish(TENANT, "carried")
    finally:
        operator.stop()
        print(operator.tail())
