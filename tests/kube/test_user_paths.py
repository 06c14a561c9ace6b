"""The README's user paths on the real API server: ``kubectl apply`` of every RLJob example, a job
posted to ``fp8rl serve --store kubernetes`` picked up by the operator, ``fp8rl operator`` from a
laptop reading progress through the API server, and what KubeRay 1.5.0 (no ``authOptions``) means
for ``rayAuth``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from operators.reconcile import Reconciler
from operators.settings import OperatorSettings
from rljob.kube import api_client
from tests.helpers import wait_for
from tests.kube import install
from tests.kube.cluster import KubeCluster, wait_object
from tests.kube.install import TOKENS
from tests.kube.jobs import Jobs, tenant_kubeconfig
from tests.kube.podnet import PodNetwork
from tests.kube.test_operator import TINY, step_row
from tests.service import servers

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def rljob_examples() -> list[Path]:
    found = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if isinstance(doc, dict) and doc.get("kind") == "RLJob":
            found.append(path)
    return found


def test_there_are_rljob_examples() -> None:
    assert {p.name for p in rljob_examples()} >= {"rljob-arithmetic-cpu.yaml", "rljob-qwen-gpu.yaml"}


@pytest.mark.parametrize("example", rljob_examples(), ids=lambda p: p.name)
def test_kubectl_apply_of_each_example_as_the_readme_writes_it(
    kube: KubeCluster, operator: install.Process, tmp_path: Path, example: Path
) -> None:
    """``kubectl apply -n team-a -f examples/<x>.yaml`` by a tenant with RLJob rights only: the API
    server admits it (the CRD's schema), and the operator gives it a RayJob whose pods are admitted
    in a restricted namespace; the GPU example waits for what it names (its Kueue queue, its
    volume, its PriorityClass), which a cluster admin provides."""
    jobs = Jobs(kube, "team-a", tenant_kubeconfig(kube, "team-a", tmp_path))
    name = yaml.safe_load(example.read_text())["metadata"]["name"]
    kube.kubectl("apply", "-n", "team-a", "-f", str(example), kubeconfig=jobs.tenant)
    rayjob = wait_object(lambda: jobs.rayjob(name), f"the RayJob of {example.name}")
    spec = rayjob["spec"]
    if rayjob["metadata"].get("labels", {}).get("kueue.x-k8s.io/queue-name"):
        # no Kueue here: the RayJob waits suspended for its queue to admit it, and says so
        assert spec["suspend"] is True
        st = jobs.wait_phase(name, "Pending")
        assert st["reason"] == "RayJobSuspended"
    else:
        pods = wait_for(lambda: jobs.pods(name), "its pods Running", lambda ps: len(ps) >= 3 and all(
            p["status"].get("phase") == "Running" for p in ps), timeout=90)  # fmt: skip
        for pod in pods:
            [container] = pod["spec"]["containers"]
            if container.get("workingDir"):
                assert container["workingDir"] == "/data"
        jobs.wait_phase(name, "Starting")
    jobs.delete(name)


def test_a_job_posted_to_the_service_is_run_by_the_operator(
    kube: KubeCluster, operator: install.Process, tmp_path: Path
) -> None:
    """``fp8rl serve --store kubernetes`` as the chart's control plane and the operator on one API
    server: POST, the RayJob, suspend, DELETE, all as the tenant's REST client sees them."""
    kubeconfig = kube.token_kubeconfig(tmp_path / "api.kubeconfig", install.NAMESPACE, "fp8rl-api")
    token = next(t for t, tenant in TOKENS.items() if tenant == "team-b")
    auth = {"Authorization": f"Bearer {token}"}
    with servers.serve(tmp_path, TOKENS, "--store", "kubernetes", "--kubeconfig", str(kubeconfig)) as url:
        body = {"name": "posted", "spec": {**TINY, "resources": {}}}
        assert httpx.post(f"{url}/v1/jobs", json=body, headers=auth).status_code == 201
        rayjob = wait_object(lambda: kube.get("rayjob", "posted", "team-b"), "the RayJob of the posted job")
        assert rayjob["metadata"]["labels"]["fp8rl.io/rljob"] == "posted"

        def phase() -> str:
            return str(httpx.get(f"{url}/v1/jobs/posted", headers=auth).json()["status"]["phase"])

        wait_for(phase, "Starting", lambda p: p == "Starting")
        assert httpx.post(f"{url}/v1/jobs/posted:suspend", headers=auth).status_code == 200
        wait_for(
            lambda: (kube.get("rayjob", "posted", "team-b") or {}).get("spec", {}).get("suspend"), "suspended"
        )
        assert httpx.delete(f"{url}/v1/jobs/posted", headers=auth).status_code == 204
        wait_for(
            lambda: (kube.get("rayjob", "posted", "team-b"), kube.get("rljob", "posted", "team-b")),
            "everything gone",
            lambda both: both == (None, None),
        )


def test_a_laptop_operator_reads_progress_through_the_api_server(
    kube: KubeCluster, operator: install.Process, podnet: PodNetwork, tmp_path: Path
) -> None:
    """Outside the cluster the head pod's IP is unreachable: ``progress_route: auto`` goes through
    the API server's pods/proxy (a laptop's own credentials; the chart's operator does not need
    that right and has not got it)."""
    jobs = Jobs(kube, "team-c", tenant_kubeconfig(kube, "team-c", tmp_path))
    jobs.apply("laptop", TINY)
    rayjob = wait_object(
        lambda: jobs.rayjob("laptop"),
        "KubeRay to run the RayJob",
        lambda r: (r or {}).get("status", {}).get("jobDeploymentStatus") == "Running",
        timeout=90,
    )

    def head_has_ip(pods: list[dict[str, Any]]) -> bool:
        return any(
            p["metadata"]["labels"].get("ray.io/node-type") == "head" and p["status"].get("podIP")
            for p in pods
        )

    wait_for(lambda: jobs.pods("laptop"), "the head pod", head_has_ip)
    driver = podnet.run_driver("team-c", "laptop")
    driver.exporter.observe(step_row(2, 0.75))
    laptop = Reconciler(api_client(str(kube.kubeconfig)), OperatorSettings(ray_auth="secret"))
    assert laptop.progress_route() == "api-proxy"  # not in a pod
    # this process has no route to pod IPs (no proxy in its environment): only the API server has
    assert not {"HTTP_PROXY", "http_proxy", "KUBERNETES_SERVICE_HOST"} & set(os.environ)
    direct = Reconciler(
        api_client(str(kube.kubeconfig)), OperatorSettings(ray_auth="secret", progress_route="pod-ip")
    )
    assert direct.scrape("team-c", rayjob) is None
    text = laptop.scrape("team-c", rayjob)
    assert text is not None and 'fp8rl_step{job="laptop",namespace="team-c",recipe="fp8-e2e"} 2.0' in text
    # the chart's operator ServiceAccount may not use pods/proxy: it reads at the pod's IP
    as_chart = kube.token_kubeconfig(tmp_path / "op.kubeconfig", install.NAMESPACE, "fp8rl-operator")
    refused = Reconciler(
        api_client(str(as_chart)), OperatorSettings(ray_auth="secret", progress_route="api-proxy")
    )
    assert refused.scrape("team-c", rayjob) is None
    jobs.delete("laptop")
    podnet.finish("team-c", "laptop")


def test_kuberay_1_5_0_has_no_auth_options_and_the_operator_says_what_to_do(
    kube: KubeCluster, chart: Path, tmp_path: Path
) -> None:
    """With ``rayAuth: kuberay`` the operator reads the real RayJob CRD of KubeRay 1.5.0, finds no
    ``authOptions``, and refuses to start (every job's Ray cluster would accept anyone)."""
    config = yaml.safe_load(install.operator_config(kube, tmp_path).read_text())
    config["ray_auth"] = "kuberay"
    path = tmp_path / "kuberay-auth.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = install.start_operator(kube, tmp_path, "http://127.0.0.1:9", config=path, name="kuberay-auth")
    try:
        assert proc.proc.wait(timeout=90) != 0
    finally:
        proc.stop()
    log = proc.log.read_text()
    # one line, no traceback: what is wrong and the two ways out
    assert log.strip().splitlines()[-1] == (
        "error: KubeRay's RayJob CRD has no rayClusterSpec.authOptions (KubeRay older than 1.5.1): "
        "every job's Ray cluster would start without a token. Upgrade KubeRay to 1.5.1 or later, or set "
        "the chart's jobDefaults.rayAuth=secret (FP8RL_OPERATOR_RAY_AUTH=secret)"
    )
    assert "Traceback" not in log


def test_each_job_has_its_own_token_kept_when_its_rayjob_is_rebuilt(
    kube: KubeCluster, operator: install.Process, tmp_path: Path
) -> None:
    jobs = Jobs(kube, "team-c", tenant_kubeconfig(kube, "team-c", tmp_path))
    for name in ("tok-1", "tok-2"):
        jobs.apply(name, TINY)

    def rayjob_of(name: str) -> dict[str, Any]:
        return wait_object(lambda: jobs.rayjob(name), f"the RayJob of {name}")

    rayjobs = {name: rayjob_of(name) for name in ("tok-1", "tok-2")}

    def token_ref(rayjob: dict[str, Any]) -> str:
        env = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
        [ref] = [e["valueFrom"]["secretKeyRef"]["name"] for e in env if e["name"] == "RAY_AUTH_TOKEN"]
        return str(ref)

    def token(name: str) -> str:
        secret = kube.get("secret", name, "team-c") or {}
        import base64

        return base64.b64decode(secret["data"]["auth_token"]).decode()

    refs = {n: token_ref(r) for n, r in rayjobs.items()}
    first = token(refs["tok-1"])
    assert len(first) >= 32 and first != token(refs["tok-2"])
    secret = kube.get("secret", refs["tok-1"], "team-c") or {}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == (jobs.get("tok-1") or {})["metadata"]["uid"]
    # someone deletes the running RayJob: it is rebuilt, with the same token
    kube.kubectl("delete", "rayjob", "tok-1", "-n", "team-c")
    rebuilt = wait_object(
        lambda: jobs.rayjob("tok-1"),
        "the RayJob rebuilt",
        lambda r: r is not None and r["metadata"]["uid"] != rayjobs["tok-1"]["metadata"]["uid"],
        timeout=60,
    )
    assert token_ref(rebuilt) == refs["tok-1"] and token(refs["tok-1"]) == first
    wait_for(
        lambda: jobs.events("tok-1"), "RayJobRecreated", lambda ev: any(r == "RayJobRecreated" for r, _ in ev)
    )
    for name in ("tok-1", "tok-2"):
        jobs.delete(name)
    wait_for(
        lambda: [kube.get("secret", r, "team-c") for r in refs.values()],
        "the tokens collected",
        lambda s: s == [None, None],
    )
    json.dumps(refs)  # the names, for the log on failure
