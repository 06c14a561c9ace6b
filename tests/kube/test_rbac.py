"""RBAC from the code: what the operator and the control plane call, recorded by the real API
server's audit log while each does everything it does, must equal what the installed chart grants
them, verb by verb. A call the chart does not grant is a 403 (the defect at HEAD e7cfa40: the
operator GETs each job's ConfigMap, the chart granted create/patch/delete only); a grant no call
uses is a privilege nobody needs. Neither list is written by hand here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.helpers import wait_for
from tests.kube import install
from tests.kube.cluster import KubeCluster, wait_object
from tests.kube.install import CONTROL_PLANE_SA, OPERATOR_SA, RELEASE, TOKENS
from tests.kube.jobs import Jobs, tenant_kubeconfig
from tests.kube.podnet import PodNetwork
from tests.kube.test_operator import TINY, step_row
from tests.service import servers

pytestmark = pytest.mark.slow
Rule = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)


def granted(kube: KubeCluster, subject: str) -> set[Rule]:
    """The rules the installed release grants ``subject`` (a ServiceAccount's user name), from the
    manifests helm applied: every (Cluster)Role a (Cluster)RoleBinding binds to it."""
    manifest = install.helm(kube, "get", "manifest", RELEASE, "-n", install.NAMESPACE).stdout
    objects = [o for o in yaml.safe_load_all(manifest) if o]
    _, _, ns, name = subject.split(":")
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objects if o["kind"] in ("Role", "ClusterRole")}
    out: set[Rule] = set()
    for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s.get("name") == name and s.get("namespace") == ns for s in binding.get("subjects", [])):
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out |= {(group, resource, verb) for verb in rule["verbs"]}
    return out


def recorded(kube: KubeCluster, subject: str) -> tuple[set[Rule], list[Any]]:
    """The rules ``subject``'s calls used so far, and those it was refused."""
    calls = kube.audit(subject)
    return {c.rule for c in calls if c.resource}, [c for c in calls if c.code == 403]


def test_the_operator_is_granted_exactly_what_it_calls(
    kube: KubeCluster, operator: install.Process, podnet: PodNetwork, tmp_path: Path
) -> None:
    ns = "team-c"
    jobs = Jobs(kube, ns, tenant_kubeconfig(kube, ns, tmp_path))
    # everything the operator does to a job: create (policy, token, spec, RayJob, events, status),
    # read progress, suspend, resume, a spec change while suspended (RayJob rebuilt, ConfigMap
    # replaced, a policy an admin edited put back), delete
    jobs.apply("every", TINY)
    wait_for(
        lambda: jobs.rayjob("every"),
        "KubeRay to run it",
        lambda r: (r or {}).get("status", {}).get("jobDeploymentStatus") == "Running",
        timeout=90,
    )
    driver = podnet.run_driver(ns, "every")
    driver.exporter.observe(step_row(1, 0.5))
    jobs.wait_phase("every", "Running")
    jobs.patch("every", {"suspend": True})
    jobs.wait_phase("every", "Suspended")
    kube.kubectl(
        "patch", "networkpolicy", "every", "-n", ns, "--type=json",
        "-p", json.dumps([{"op": "remove", "path": "/spec/ingress/1"}]),
    )  # fmt: skip
    jobs.patch("every", {"job": {**TINY, "steps": 5}})
    wait_for(lambda: jobs.events("every"), "the rebuild", lambda ev: any(r == "SpecApplied" for r, _ in ev))
    policy = wait_object(
        lambda: kube.get("networkpolicy", "every", ns),
        "the policy put back",
        lambda p: p is not None and len(p["spec"]["ingress"]) == 3,
    )
    assert policy["metadata"]["ownerReferences"][0]["name"] == "every"
    jobs.patch("every", {"suspend": False})

    def resumed() -> tuple[bool, Any, list[Any]]:
        """Whether the RayJob is there, its spec.suspend, and the job's last events (what a
        timeout then says: a clean-clone run at 2464e56 waited 60 s on a RayJob that read None)."""
        rayjob = jobs.rayjob("every")
        return (
            rayjob is not None,
            ((rayjob or {}).get("spec") or {}).get("suspend"),
            jobs.events("every")[-3:],
        )

    # false, or absent: KubeRay's Go type drops a false `suspend` (`json:"suspend,omitempty"`)
    # should it write the RayJob back
    wait_for(resumed, "the rebuilt RayJob resumed", lambda v: v[0] and not v[1], timeout=120)
    jobs.delete("every")
    podnet.finish(ns, "every")

    used, refused = recorded(kube, OPERATOR_SA)
    assert refused == [], f"calls the chart does not grant: {sorted({c.rule for c in refused})}"
    grants = granted(kube, OPERATOR_SA)
    assert used - grants == set()
    assert grants - used == set(), f"granted, never called: {sorted(grants - used)}"


def test_the_control_plane_is_granted_exactly_what_it_calls(
    kube: KubeCluster, chart: Path, tmp_path: Path
) -> None:
    kubeconfig = kube.token_kubeconfig(tmp_path / "api.kubeconfig", install.NAMESPACE, "fp8rl-api")
    token = next(t for t, tenant in TOKENS.items() if tenant == "team-c")
    auth = {"Authorization": f"Bearer {token}"}
    with servers.serve(tmp_path, TOKENS, "--store", "kubernetes", "--kubeconfig", str(kubeconfig)) as url:
        # everything the REST API does to the tenant's RLJobs
        body = {"name": "api-every", "spec": {"steps": 3}}
        assert httpx.post(f"{url}/v1/jobs", json=body, headers=auth).status_code == 201
        assert httpx.get(f"{url}/v1/jobs/api-every", headers=auth).status_code == 200
        assert httpx.get(f"{url}/v1/jobs", headers=auth).status_code == 200
        assert httpx.post(f"{url}/v1/jobs/api-every:suspend", headers=auth).status_code == 200
        assert httpx.post(f"{url}/v1/jobs/api-every:resume", headers=auth).status_code == 200
        assert httpx.get(f"{url.metrics}/metrics").status_code == 200  # every tenant's jobs, counted
        assert httpx.delete(f"{url}/v1/jobs/api-every", headers=auth).status_code == 204
    used, refused = recorded(kube, CONTROL_PLANE_SA)
    assert refused == [], f"calls the chart does not grant: {sorted({c.rule for c in refused})}"
    grants = granted(kube, CONTROL_PLANE_SA)
    assert used - grants == set()
    assert grants - used == set(), f"granted, never called: {sorted(grants - used)}"
