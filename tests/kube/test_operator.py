"""The operator on a real API server with the chart's RBAC, and the real KubeRay below it:
RLJob -> RayJob (fp8rl's operator, as its ServiceAccount) -> RayCluster and pods (KubeRay 1.5.0)
-> scheduled on the GPU pools (kube-scheduler) -> "running" (kwok) -> the driver's progress back on
the RLJob (through the pod network stand-in, the only simulated part: tests/kube/README.md).

Each test says which KubeRay and fp8rl transitions it waits for; a failure prints the objects."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rljob import metrics as m
from tests.helpers import wait_for
from tests.kube import install
from tests.kube.cluster import KubeCluster, wait_object
from tests.kube.jobs import Jobs, tenant_kubeconfig
from tests.kube.podnet import PodNetwork

pytestmark = pytest.mark.slow

TINY: dict[str, Any] = {
    "model": {"tiny": {"arch": "llama", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2}},
    "tokenizer": {"kind": "bytes"},
    "steps": 3,
    "output_dir": "runs/job",
    "resources": {"gpus_per_generator": 1, "gpus_per_trainer": 1},
}


@pytest.fixture
def team_a(kube: KubeCluster, operator: install.Process, tmp_path: Path) -> Iterator[Jobs]:
    jobs = Jobs(kube, "team-a", tenant_kubeconfig(kube, "team-a", tmp_path))
    yield jobs
    print(operator.tail(6000))


def dump(kube: KubeCluster, ns: str) -> str:
    return kube.kubectl("get", "rljobs,rayjobs,rayclusters,jobs,pods,events", "-n", ns, "-o", "wide").stdout


def step_row(step: int, reward: float) -> dict[str, float]:
    return {m.STEP: step, m.REWARD_MEAN: reward, m.GENERATION_TOKENS_PER_S: 1000.0 + step}


def running_pods(jobs: Jobs, name: str, count: int = 4) -> list[dict[str, Any]]:
    return wait_for(
        lambda: jobs.pods(name),
        f"{count} pods of {name} Running",
        lambda ps: len(ps) == count and all(p["status"].get("phase") == "Running" for p in ps),
        timeout=90,
    )


def test_an_rljob_runs_through_kuberay_to_pods_on_the_gpu_pools_and_back(
    kube: KubeCluster, team_a: Jobs, podnet: PodNetwork
) -> None:
    jobs, name = team_a, "life"
    jobs.apply(name, TINY)
    # fp8rl: the RayJob, as the chart's operator ServiceAccount may make it
    rayjob = wait_object(lambda: jobs.rayjob(name), "the operator's RayJob")
    rljob = jobs.get(name) or {}
    uid = rljob["metadata"]["uid"]
    assert "fp8rl.io/finalizer" in rljob["metadata"]["finalizers"]
    assert rayjob["metadata"]["ownerReferences"][0]["uid"] == uid
    configmap = kube.get("configmap", f"{name}-spec", "team-a") or {}
    assert configmap["metadata"]["ownerReferences"][0]["uid"] == uid
    assert json.loads(configmap["data"]["job.json"])["steps"] == 3
    # KubeRay: New -> Initializing (the RayCluster) -> Running (its submitter Job in K8sJobMode)
    rayjob = wait_object(
        lambda: jobs.rayjob(name),
        "KubeRay to run the RayJob",
        lambda r: (r or {}).get("status", {}).get("jobDeploymentStatus") == "Running",
        timeout=90,
    )
    cluster = rayjob["status"]["rayClusterName"]
    assert kube.get("raycluster", cluster, "team-a") is not None
    by_group = {p["metadata"]["labels"]["fp8rl.io/group"]: p for p in running_pods(jobs, name)}
    assert by_group["generation"]["spec"]["nodeName"].startswith("h100-gen-")
    assert by_group["training"]["spec"]["nodeName"] == "h100-train-0"
    assert by_group["head"]["spec"]["nodeName"].startswith("cpu-")  # no GPU asked, no toleration needed
    for group in ("generation", "training"):
        limits = by_group[group]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"
    jobs.wait_phase(name, "Starting")
    # the job's NetworkPolicy, made before the RayJob, selects every pod of the job and admits no one
    # unnamed (each rule names its sources)
    policy = kube.get("networkpolicy", name, "team-a") or {}
    assert policy["metadata"]["ownerReferences"][0]["uid"] == uid
    assert policy["metadata"]["creationTimestamp"] <= rayjob["metadata"]["creationTimestamp"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert all(selector.items() <= p["metadata"]["labels"].items() for p in jobs.pods(name))
    for rule in policy["spec"]["ingress"]:
        assert rule["from"] and all(peer.get("podSelector") is not None for peer in rule["from"])

    # the driver starts (simulated): its metrics answer, the operator reads them at the pod's IP
    driver = podnet.run_driver("team-a", name)
    driver.exporter.observe(step_row(1, 0.25))
    st = wait_for(
        lambda: jobs.status(name),
        "progress on the RLJob",
        lambda s: s.get("phase") == "Running" and s.get("progress", {}).get("step") == 1,
    )
    assert st["progress"]["reward"] == 0.25 and st["progress"]["total_steps"] == 3
    printed = kube.kubectl("get", "rljob", name, "-n", "team-a").stdout  # the printer columns
    assert "Running" in printed and "0.25" in printed
    # KubeRay 1.5.0 asked the Ray head for the job's status without a token: refused, as a real
    # Ray with token authentication refuses it
    asked = [r for r in podnet.requests if "/api/jobs/" in r[1] and r[1].split("/")[2].startswith(cluster)]
    assert asked and {status for _, _, status in asked} == {401}, asked

    # a spec change while it runs is refused, once, and the RayJob keeps its spec
    jobs.patch(name, {"job": {**TINY, "steps": 99}})
    wait_for(
        lambda: jobs.status(name),
        "the SpecChangeRefused condition",
        lambda s: any(c["type"] == "SpecChangeRefused" and c["status"] for c in s.get("conditions", [])),
    )
    spec_hash = "fp8rl.io/spec-hash"
    assert (jobs.rayjob(name) or {})["metadata"]["annotations"][spec_hash] == rayjob["metadata"][
        "annotations"
    ][spec_hash]
    jobs.patch(name, {"job": TINY})  # put back

    # suspend: KubeRay tears the Ray cluster down; resume: a new one, the driver continues
    jobs.patch(name, {"suspend": True})
    jobs.wait_phase(name, "Suspended")
    wait_for(lambda: jobs.pods(name), "the pods to go on suspend", lambda ps: ps == [], timeout=60)
    jobs.patch(name, {"suspend": False})
    running_pods(jobs, name)
    driver.exporter.observe(step_row(2, 0.5))
    wait_for(
        lambda: jobs.status(name),
        "Running again after resume",
        lambda s: s.get("phase") == "Running" and s.get("progress", {}).get("step") == 2,
        timeout=90,
    )

    # the last step, the driver's word, its exit: KubeRay gives up on the outcome 30 s after its
    # submitter ended; the operator knows better from what the driver said while it lingered
    driver.exporter.observe(step_row(3, 0.5))
    driver.exporter.complete()
    wait_for(
        lambda: jobs.status(name),
        "the DriverCompleted condition",
        lambda s: any(c["type"] == "DriverCompleted" for c in s.get("conditions", [])),
    )
    podnet.finish("team-a", name, succeeded=True)
    done = jobs.wait_phase(name, "Succeeded", timeout=120)
    assert done["progress"]["step"] == 3
    assert (jobs.rayjob(name) or {}).get("status", {}).get("reason") == (
        "JobDeploymentStatusTransitionGracePeriodExceeded"
    )
    reasons = [r for r, _ in jobs.events(name)]
    for reason in ("RayJobCreated", "Starting", "Running", "SpecChangeRefused", "Suspended", "Succeeded"):
        assert reason in reasons, reasons
    assert reasons.count("SpecChangeRefused") == 1

    # delete: the finalizer holds the RLJob until its RayJob and pods are gone
    jobs.delete(name)
    assert jobs.get(name) is None
    assert jobs.pods(name) == [] and jobs.rayjob(name) is None
    for kind, obj in (("configmap", f"{name}-spec"), ("networkpolicy", name)):

        def gone(k: str = kind, o: str = obj) -> bool:
            return kube.get(k, o, "team-a") is None

        wait_for(gone, f"{kind} {obj} to go")
    tokens = [
        s["metadata"]["name"]
        for s in kube.objects("secrets", "team-a")
        if s["metadata"]["name"].startswith(f"{name}-")
    ]
    wait_for(
        lambda: [t for t in tokens if kube.get("secret", t, "team-a")],
        "the token collected",
        lambda x: x == [],
    )


def test_every_pod_passes_restricted_and_can_write_where_it_works(kube: KubeCluster, team_a: Jobs) -> None:
    """Pod Security ``restricted`` is enforced in the tenant namespace (the chart labelled it), so
    each pod that exists passed it; each works in a directory backed by a writable volume."""
    jobs, name = team_a, "pods"
    labels = (kube.get("namespace", "team-a") or {})["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    jobs.apply(name, TINY)
    pods = wait_for(lambda: jobs.pods(name), "the job's pods", lambda ps: len(ps) == 4, timeout=90)
    for pod in pods:
        spec = pod["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}  # the submitter has none
        for container in spec["containers"] + spec.get("initContainers", []):
            workdir = container.get("workingDir")
            if workdir is None:
                continue
            [mount] = [mt for mt in container["volumeMounts"] if mt["mountPath"] == workdir]
            assert not mount.get("readOnly")
            volume = volumes[mount["name"]]
            # an emptyDir is created world-writable; a claim is group-owned by fsGroup
            assert "emptyDir" in volume or "persistentVolumeClaim" in volume, volume
        assert spec["securityContext"]["runAsUser"] == 1000
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    jobs.delete(name)


def test_admission_refuses_a_job_pod_that_is_not_restricted(kube: KubeCluster, team_a: Jobs) -> None:
    """What HEAD's pod templates lacked (a seccomp profile) is refused by the real admission: the
    RayJob is made but KubeRay cannot create its head pod, and says why in an event."""
    rayjob = json.loads(
        kube.kubectl("create", "--dry-run=client", "-o", "json", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "no-seccomp", "namespace": "team-a"},
            "spec": {
                "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
                "containers": [{"name": "c", "image": "x", "securityContext": {
                    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
            },
        })).stdout
    )  # fmt: skip
    refused = kube.kubectl("apply", "-f", "-", input=json.dumps(rayjob), check=False)
    assert refused.returncode != 0 and "seccompProfile" in refused.stderr
