"""The operator touches only what it owns (operators/ownership.py), on the real API server with the
chart's RBAC: a tenant who may create RLJobs and nothing else names one after an object of
someone else's. At HEAD e7cfa40 the operator patched the admin's NetworkPolicy with its job's
allow rules (a 409 on create, then PATCH of its spec), rewrote a foreign ConfigMap's data and,
when the RLJob was deleted, deleted all three."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_for
from tests.kube import install
from tests.kube.cluster import KubeCluster, wait_object
from tests.kube.jobs import Jobs, tenant_kubeconfig
from tests.kube.test_operator import TINY

pytestmark = pytest.mark.slow
NS = "team-b"

DENY_ALL = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "payroll", "namespace": NS, "labels": {"owner": "cluster-admin"}},
    "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
}


def foreign_objects() -> list[tuple[str, dict[str, Any]]]:
    """(the RLJob name that collides, the admin's object), one per kind the operator names."""
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        # the operator's own labels, copied: they prove nothing without the owner reference
        "metadata": {
            "name": "ledger-spec",
            "namespace": NS,
            "labels": {"app.kubernetes.io/managed-by": "fp8rl-operator", "fp8rl.io/rljob": "ledger"},
        },
        "data": {"job.json": '{"keep": "me"}'},
    }
    rayjob = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "handmade", "namespace": NS},
        "spec": {"entrypoint": "python -c 'print(1)'", "suspend": True, "rayClusterSpec": {
            "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [
                {"name": "ray-head", "image": "rayproject/ray:2.60.0"}]}}}}},
    }  # fmt: skip
    return [("payroll", DENY_ALL), ("ledger", configmap), ("handmade", rayjob)]


def fingerprint(kube: KubeCluster, kind: str, name: str) -> tuple[str, str]:
    obj = kube.get(kind, name, NS)
    assert obj is not None, f"{kind} {name} is gone"
    return obj["metadata"]["uid"], obj["metadata"]["resourceVersion"]


@pytest.mark.parametrize(("job", "index"), [("payroll", 0), ("ledger", 1), ("handmade", 2)])
def test_a_name_taken_by_someone_elses_object_fails_the_job_and_the_object_is_untouched(
    kube: KubeCluster, operator: install.Process, tmp_path: Path, job: str, index: int
) -> None:
    jobs = Jobs(kube, NS, tenant_kubeconfig(kube, NS, tmp_path))
    _, obj = foreign_objects()[index]
    kind = obj["kind"].lower()
    kube.apply(obj)
    before = fingerprint(kube, kind, obj["metadata"]["name"])
    jobs.apply(job, TINY)
    st = jobs.wait_phase(job, "Failed")
    named = f"{obj['kind']} {NS}/{obj['metadata']['name']}"
    assert st["reason"] == "NameConflict" and st["message"].startswith(
        f"{named} exists and is not this RLJob's"
    )
    [condition] = [c for c in st["conditions"] if c["type"] == "NameConflict"]
    assert condition["status"] is True
    wait_for(
        lambda: jobs.events(job), "the NameConflict event", lambda ev: any(r == "NameConflict" for r, _ in ev)
    )
    time.sleep(3)  # three of the operator's polls: it would have acted by now
    assert fingerprint(kube, kind, obj["metadata"]["name"]) == before  # neither patched nor replaced
    if obj["kind"] != "RayJob":
        assert jobs.rayjob(job) is None  # nothing of the job was made either
    # deleting the RLJob leaves the object alone
    jobs.delete(job)
    time.sleep(2)
    assert fingerprint(kube, kind, obj["metadata"]["name"]) == before
    current = kube.get(kind, obj["metadata"]["name"], NS) or {}
    if obj["kind"] == "NetworkPolicy":
        assert current["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}  # still deny-all
    if obj["kind"] == "ConfigMap":
        assert current["data"] == {"job.json": '{"keep": "me"}'}
    kube.kubectl("delete", kind, obj["metadata"]["name"], "-n", NS)


def test_removing_the_conflicting_object_lets_the_job_start(
    kube: KubeCluster, operator: install.Process, tmp_path: Path
) -> None:
    jobs = Jobs(kube, NS, tenant_kubeconfig(kube, NS, tmp_path))
    policy = json.loads(json.dumps(DENY_ALL))
    policy["metadata"]["name"] = "later"
    kube.apply(policy)
    jobs.apply("later", TINY)
    jobs.wait_phase("later", "Failed")
    kube.kubectl("delete", "networkpolicy", "later", "-n", NS)
    rayjob = wait_object(lambda: jobs.rayjob("later"), "the RayJob once the name is free")
    assert rayjob["metadata"]["ownerReferences"][0]["name"] == "later"
    jobs.wait_phase("later", "Starting")
    own = kube.get("networkpolicy", "later", NS) or {}
    assert own["metadata"]["labels"]["fp8rl.io/rljob"] == "later"
    jobs.delete("later")


def test_a_tenant_cannot_plant_the_token_secret(
    kube: KubeCluster, operator: install.Process, tmp_path: Path
) -> None:
    """The token Secret's name carries the RLJob's uid, so no Secret made before the RLJob (an
    admin's, with the key the pods read) is ever what a job's pods mount."""
    jobs = Jobs(kube, NS, tenant_kubeconfig(kube, NS, tmp_path))
    kube.kubectl(
        "create", "secret", "generic", "vault-ray-token", "--from-literal=auth_token=admin-secret", "-n", NS
    )
    jobs.apply("vault", TINY)
    rayjob = wait_object(lambda: jobs.rayjob("vault"), "the RayJob")
    uid = (jobs.get("vault") or {})["metadata"]["uid"]
    env = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    [token] = [e for e in env if e["name"] == "RAY_AUTH_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"]["name"] == f"vault-ray-token-{uid[:8]}"
    jobs.delete("vault")
    assert kube.get("secret", "vault-ray-token", NS) is not None
    kube.kubectl("delete", "secret", "vault-ray-token", "-n", NS)
