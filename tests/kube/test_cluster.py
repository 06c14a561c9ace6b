"""The test cluster itself enforces what a real one does: these would pass on an emulator only if it
implemented RBAC, Pod Security admission, scheduling on GPU pools and garbage collection."""

from __future__ import annotations

import ipaddress
import json
import time
from pathlib import Path
from typing import Any

import pytest

from operators.builders import kuberay_knows_auth_options
from tests.helpers import wait_for
from tests.kube.cluster import POD_CIDR, KubeCluster, wait_object


def pod(name: str, **spec: object) -> dict[str, object]:
    container = {
        "name": "main",
        "image": "registry.example/x:1",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    body: dict[str, Any] = {
        "containers": [container],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": body}


def unschedulable(kube: KubeCluster, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
    """Apply the pod ``body`` and wait for the scheduler to say it cannot place it."""
    kube.kubectl("apply", "-n", tenant, "-f", "-", input=json.dumps(body))
    return wait_object(
        lambda: kube.get("pod", body["metadata"]["name"], tenant),
        f"the scheduler to give up on pod {body['metadata']['name']}",
        lambda p: any(c.get("reason") == "Unschedulable" for c in p.get("status", {}).get("conditions", [])),
    )


def test_versions_are_the_pinned_ones(kube: KubeCluster) -> None:
    version = json.loads(kube.kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert version["gitVersion"] == "v1.37.2"
    crd = kube.get("crd", "rayjobs.ray.io")
    assert crd is not None and "v1" in [v["name"] for v in crd["spec"]["versions"]]
    # KubeRay 1.5.0, the newest the Go module proxy serves, predates authOptions (1.5.1): the
    # operator's check reads the real CRD as it would on a cluster
    assert not kuberay_knows_auth_options(crd)


def test_rbac_refuses_what_a_service_account_was_not_granted(
    kube: KubeCluster, tenant: str, tmp_path: Path
) -> None:
    kube.kubectl("create", "serviceaccount", "nobody", "-n", tenant)
    config = kube.token_kubeconfig(tmp_path / "nobody", tenant, "nobody")
    denied = kube.kubectl("get", "configmaps", "-n", tenant, kubeconfig=config, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr
    kube.kubectl("create", "role", "read-cm", "--verb=list", "--resource=configmaps", "-n", tenant)
    kube.kubectl(
        "create",
        "rolebinding",
        "read-cm",
        "--role=read-cm",
        f"--serviceaccount={tenant}:nobody",
        "-n",
        tenant,
    )
    wait_for(
        lambda: kube.kubectl("get", "configmaps", "-n", tenant, kubeconfig=config, check=False).returncode,
        "the RoleBinding to take effect",
        lambda code: code == 0,
    )
    # the audit log names the caller and what it was told
    calls = kube.audit(f"system:serviceaccount:{tenant}:nobody")
    assert ("", "configmaps", "list") in {c.rule for c in calls}
    assert {c.code for c in calls if c.rule == ("", "configmaps", "list")} >= {403, 200}


def test_pod_security_restricted_refuses_a_root_pod_and_admits_a_hardened_one(
    kube: KubeCluster, tenant: str
) -> None:
    root = pod("root")
    root["spec"]["securityContext"] = {}  # type: ignore[index]
    refused = kube.kubectl("apply", "-n", tenant, "-f", "-", input=json.dumps(root), check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted:latest"' in refused.stderr
    kube.kubectl("apply", "-n", tenant, "-f", "-", input=json.dumps(pod("ok")))


def test_gpu_pods_land_on_the_gpu_pool_and_run(kube: KubeCluster, tenant: str) -> None:
    gpu = pod(
        "gpu",
        nodeSelector={"fp8rl.test/pool": "generation"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    )
    gpu["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "8"}}  # type: ignore[index]
    kube.kubectl("apply", "-n", tenant, "-f", "-", input=json.dumps(gpu))
    running = wait_object(
        lambda: kube.get("pod", "gpu", tenant),
        "the GPU pod to run",
        lambda p: p and p["status"].get("phase") == "Running",
    )
    assert running["spec"]["nodeName"].startswith("h100-gen-")
    assert ipaddress.ip_address(running["status"]["podIP"]) in ipaddress.ip_network(POD_CIDR)
    # a pod asking for more GPUs than any node has stays Pending, unschedulable
    big = pod("too-big", tolerations=gpu["spec"]["tolerations"])  # type: ignore[index]
    big["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "9"}}  # type: ignore[index]
    pending = unschedulable(kube, tenant, big)
    assert pending["status"]["phase"] == "Pending"
    # without the toleration a GPU pod never lands on a tainted GPU node
    stuck = unschedulable(kube, tenant, pod("untolerated", nodeSelector={"fp8rl.test/pool": "training"}))
    assert "untolerated taint" in json.dumps(stuck["status"]["conditions"])


@pytest.mark.parametrize("owned", [True, False])
def test_garbage_collection_follows_owner_references(kube: KubeCluster, tenant: str, owned: bool) -> None:
    kube.kubectl("create", "configmap", "owner", "-n", tenant)
    owner = kube.get("configmap", "owner", tenant)
    assert owner is not None
    meta: dict[str, object] = {"name": "dependent"}
    if owned:
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
        ]
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}
    kube.kubectl("apply", "-n", tenant, "-f", "-", input=json.dumps(body))
    kube.kubectl("delete", "configmap", "owner", "-n", tenant)
    if owned:
        wait_for(
            lambda: kube.get("configmap", "dependent", tenant),
            "the collector to delete the dependent",
            lambda d: d is None,
        )
    else:
        time.sleep(3)  # long enough for the collector (it acted within a second above)
        assert kube.get("configmap", "dependent", tenant) is not None
