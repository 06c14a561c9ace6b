"""fp8rl on the test cluster as a platform engineer installs it: ``helm install`` of the chart (real
helm), then the operator and the control plane as processes of this machine that act with the
chart's own ServiceAccounts (a token of each, from the TokenRequest API), so RBAC decides what
they may do exactly as it would for the chart's pods. The chart's pods themselves are scheduled
and "run" by kwok; nothing runs in them, which is why the processes run here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.helm.tools import tool
from tests.kube.cluster import RESTRICTED, KubeCluster

ROOT = Path(__file__).resolve().parents[2]
# Another checkout's operator, control plane and chart (FP8RL_TEST_OTHER_CHECKOUT=<its root>), to
# show what a test sees on an earlier commit: the processes run from there, and its chart is
# installed (FP8RL_TEST_CHART=<a chart directory> installs another). The tests themselves, and the
# cluster, stay this checkout's.
OTHER = os.environ.get("FP8RL_TEST_OTHER_CHECKOUT")
SOURCE = Path(OTHER) if OTHER else ROOT
INSTALLED_CHART = Path(os.environ.get("FP8RL_TEST_CHART") or SOURCE / "helm" / "fp8rl")
RELEASE, NAMESPACE = "fp8rl", "fp8rl-system"
TENANTS = ("team-a", "team-b", "team-c")
TOKENS = {f"{tenant}-token-0123456789abcdef": tenant for tenant in TENANTS}
OPERATOR_SA = f"system:serviceaccount:{NAMESPACE}:fp8rl-operator"
CONTROL_PLANE_SA = f"system:serviceaccount:{NAMESPACE}:fp8rl-api"

# the values a platform engineer would set for this cluster: its node pools' labels, KubeRay
# 1.5.0's auth mode (it has no authOptions), images pulled as tagged (kwok pulls nothing)
# team-a's policy is the GPU example's (what examples/rljob-qwen-gpu.yaml asks for)
_GPU_TENANTS = yaml.safe_load((ROOT / "examples" / "helm-values-gpu.yaml").read_text())["tenants"]
POLICIES = {
    "team-a": {"jobPolicy": next(t["jobPolicy"] for t in _GPU_TENANTS if t["name"] == "team-a")},
    "team-c": {"jobPolicy": {"volumeClaims": ["smollm2-models"]}},
}
VALUES: dict[str, Any] = {
    # team-a's jobs may ask for what the GPU example asks for, team-c's may mount its models volume
    # (tests/kube/test_pretrained_rljob.py); nothing else beyond the pools below (jobDefaults.jobPolicy)
    "tenants": [{"name": t, "createNamespace": True, **POLICIES.get(t, {})} for t in TENANTS],
    "auth": {"tokens": TOKENS},
    "images": {"pullPolicy": "IfNotPresent"},
    "gpuPools": {
        "generation": {"nodeSelector": {"fp8rl.test/pool": "generation"}, "gpusPerPod": 8},
        "training": {"nodeSelector": {"fp8rl.test/pool": "training"}, "gpusPerPod": 8},
    },
    "jobDefaults": {
        "rayAuth": "secret",
        "pollSeconds": 1,
        "headMemory": "2Gi",
        "workerMemory": "8Gi",
        "modelRoots": ["/runs/models"],  # tests/kube/test_pretrained_rljob.py: models on the job's volume
    },
    "monitoring": {"enabled": False},
}


def add_tenant(kube: KubeCluster, namespace: str) -> str:
    """A tenant namespace added as the chart adds one (``tenants[]``): Pod Security ``restricted``,
    and the RoleBinding that lets the control plane write RLJobs there (it may not elsewhere)."""
    kube.namespace(namespace, {**RESTRICTED, "fp8rl.io/tenant": "true"})
    kube.apply(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "fp8rl-api", "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "fp8rl-api"},
            "subjects": [{"kind": "ServiceAccount", "name": "fp8rl-api", "namespace": NAMESPACE}],
        }
    )
    return namespace


def helm(kube: KubeCluster, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [tool("helm"), f"--kubeconfig={kube.kubeconfig}", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if check and done.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)} failed:\n{done.stderr}")
    return done


def install(
    kube: KubeCluster, workdir: Path, values: dict[str, Any] | None = None, chart: Path = INSTALLED_CHART
) -> Path:
    """``helm install`` the chart into ``NAMESPACE`` (itself Pod Security ``restricted``, so the
    chart's own pods are held to it too) and wait for its Deployments."""
    kube.namespace(NAMESPACE, RESTRICTED)
    path = workdir / "values.yaml"
    path.write_text(yaml.safe_dump(values or VALUES))
    helm(kube, "install", RELEASE, str(chart), "-n", NAMESPACE, "-f", str(path), "--wait", "--timeout=180s")
    wait_for_quotas(kube)
    return path


def wait_for_quotas(kube: KubeCluster, timeout: float = 60.0) -> None:
    """Until the quota controller has counted what every tenant namespace's ResourceQuota (the
    chart's ``tenantQuota``) names: before that the API server refuses to create those objects
    there ("status unknown for quota")."""
    deadline = time.monotonic() + timeout
    while True:
        out = json.loads(kube.kubectl("get", "resourcequota", "-A", "-o", "json").stdout)
        pending = [
            f"{q['metadata']['namespace']}/{q['metadata']['name']}"
            for q in out["items"]
            if set(q["spec"].get("hard", {})) - set((q.get("status") or {}).get("used", {}))
        ]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"quotas not counted after {timeout:.0f} s: {pending}")
        time.sleep(1)


@dataclass
class Process:
    """A long-running fp8rl command; ``stop()`` sends SIGTERM and waits."""

    name: str
    log: Path
    proc: subprocess.Popen[bytes]
    env: dict[str, str] = field(default_factory=dict)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def fp8rl(name: str, workdir: Path, *args: str, env: dict[str, str] | None = None) -> Process:
    log = workdir / f"{name}.log"
    full = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "HTTP_PROXY", "http_proxy")}
    full.update(env or {})
    if OTHER:
        full["PYTHONPATH"] = str(SOURCE)
    argv = [sys.executable, "-m", "fp8rl", *args]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=full, cwd=SOURCE, start_new_session=True
        )
    return Process(name, log, proc, env or {})


def operator_config(
    kube: KubeCluster, workdir: Path, configmap: str = "fp8rl-operator", namespace: str = NAMESPACE
) -> Path:
    """The config file the chart mounts into the operator's pod, as rendered into its ConfigMap."""
    found = kube.get("configmap", configmap, namespace)
    assert found is not None, f"the chart's operator ConfigMap {namespace}/{configmap}"
    path = workdir / "operator-config.yaml"
    path.write_text(found["data"]["config.yaml"])
    return path


def start_operator(
    kube: KubeCluster,
    workdir: Path,
    proxy: str,
    namespaces: tuple[str, ...] = TENANTS,
    config: Path | None = None,
    name: str = "operator",
    service_account: tuple[str, str] = (NAMESPACE, "fp8rl-operator"),
) -> Process:
    """``fp8rl operator`` with the chart's config and its ServiceAccount's token, watching the
    tenants as the chart's Deployment does; pods are reached through the pod network stand-in."""
    kubeconfig = kube.token_kubeconfig(workdir / f"{name}.kubeconfig", *service_account)
    args = ["operator", f"--config={config or operator_config(kube, workdir)}", f"--kubeconfig={kubeconfig}"]
    args += [f"--namespace={ns}" for ns in namespaces]
    return fp8rl(name, workdir, *args, env={"HTTP_PROXY": proxy, "NO_PROXY": "127.0.0.1,localhost"})
