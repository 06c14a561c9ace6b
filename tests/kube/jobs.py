"""Acting on RLJobs in the test cluster as a tenant does (kubectl, with a ServiceAccount that may
touch RLJobs and nothing else), and reading what followed as an admin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers import wait_for
from tests.kube.cluster import KubeCluster

# what a tenant is granted: its RLJobs, nothing else (no pods, RayJobs, Secrets, policies)
TENANT_RULES = [
    {
        "apiGroups": ["fp8rl.io"],
        "resources": ["rljobs"],
        "verbs": ["create", "get", "list", "watch", "patch", "update", "delete"],
    },
    {"apiGroups": ["fp8rl.io"], "resources": ["rljobs/status"], "verbs": ["get"]},
]


def tenant_kubeconfig(kube: KubeCluster, namespace: str, workdir: Path) -> Path:
    """A kubeconfig acting as ``namespace/tenant``, a ServiceAccount with ``TENANT_RULES``."""
    if kube.get("serviceaccount", "tenant", namespace) is None:
        kube.kubectl("create", "serviceaccount", "tenant", "-n", namespace)
        role = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "rljob-user", "namespace": namespace},
            "rules": TENANT_RULES,
        }
        kube.apply(role)
        account = f"--serviceaccount={namespace}:tenant"
        kube.kubectl("create", "rolebinding", "rljob-user", "--role=rljob-user", account, "-n", namespace)
    return kube.token_kubeconfig(workdir / f"tenant-{namespace}.kubeconfig", namespace, "tenant")


class Jobs:
    """RLJobs of one namespace: the tenant writes, the admin reads."""

    def __init__(self, kube: KubeCluster, namespace: str, tenant: Path) -> None:
        self.kube, self.ns, self.tenant = kube, namespace, tenant

    def apply(self, name: str, job: dict[str, Any], **spec: Any) -> None:
        body = {
            "apiVersion": "fp8rl.io/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": name},
            "spec": {"job": job, **spec},
        }
        self.kube.kubectl("apply", "-n", self.ns, "-f", "-", kubeconfig=self.tenant, input=json.dumps(body))

    def patch(self, name: str, spec: dict[str, Any]) -> None:
        self.kube.kubectl(
            "patch", "rljob", name, "-n", self.ns, "--type=merge", "-p", json.dumps({"spec": spec}),
            kubeconfig=self.tenant,
        )  # fmt: skip

    def delete(self, name: str, wait: bool = True) -> None:
        self.kube.kubectl(
            "delete", "rljob", name, "-n", self.ns, f"--wait={str(wait).lower()}", kubeconfig=self.tenant
        )

    def get(self, name: str) -> dict[str, Any] | None:
        return self.kube.get("rljob", name, self.ns)

    def status(self, name: str) -> dict[str, Any]:
        return dict(((self.get(name) or {}).get("status")) or {})

    def wait_phase(self, name: str, phase: str, timeout: float = 90) -> dict[str, Any]:
        return wait_for(
            lambda: self.status(name),
            f"RLJob {self.ns}/{name} to be {phase}",
            lambda st: st.get("phase") == phase,
            timeout,
        )

    def rayjob(self, name: str) -> dict[str, Any] | None:
        return self.kube.get("rayjob", name, self.ns)

    def pods(self, name: str) -> list[dict[str, Any]]:
        return self.kube.objects("pods", self.ns, f"fp8rl.io/rljob={name}")

    def events(self, name: str) -> list[tuple[str, str]]:
        """(reason, message) of the events on the RLJob ``name``."""
        found = self.kube.objects("events", self.ns)
        return [
            (e.get("reason", ""), e.get("message", ""))
            for e in found
            if e["involvedObject"].get("kind") == "RLJob" and e["involvedObject"].get("name") == name
        ]
