"""`fp8rl operator` as a real process on kmock (a real HTTP Kubernetes API emulator). The test plays
KubeRay by patching RayJob status, and plays the driver with a real Prometheus exporter on a port
the operator scrapes through a head pod object."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from kubernetes import client

from bench.kube_emulator import KubeEmulator, start_operator
from operators.builders import SPEC_HASH
from rljob import resource as rl
from rljob.kube import KubernetesJobStore, api_client
from rljob.spec import JobSpec
from rljob.status import Phase
from service.main import create_app
from service.operator_handoff import OperatorHandoff
from service.settings import Settings
from tests.helpers import wait_for
from workers.prom_exporter import PromExporter

NS = "team-a"
RL = (rl.GROUP, rl.VERSION, NS, rl.PLURAL)
RAY = ("ray.io", "v1", NS, "rayjobs")


class Cluster:
    """The emulated API with the operator running against it, and shortcuts for the test."""

    def __init__(self, tmp_path: Path, kube: KubeEmulator, metrics_port: int) -> None:
        self.tmp_path, self.kube = tmp_path, kube
        self.env = {"FP8RL_OPERATOR_POLL_SECONDS": "0.5", "FP8RL_OPERATOR_METRICS_PORT": str(metrics_port)}
        self.api = api_client(str(kube.kubeconfig))
        self.objects = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)
        self.operator: subprocess.Popen[bytes] | None = None
        self.log = tmp_path / "operator.log"

    def start(self) -> None:
        self.operator = start_operator(self.kube.kubeconfig, self.log, self.env)

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.send_signal(signal.SIGTERM)
            self.operator.wait(timeout=30)
            self.operator = None

    def rljob(self, name: str) -> dict[str, Any] | None:
        found = [o for o in self.kube.objects("rljobs", NS) if o["metadata"]["name"] == name]
        return found[0] if found else None

    def rayjobs(self) -> list[dict[str, Any]]:
        return self.kube.objects("rayjobs", NS)

    def phase(self, name: str) -> str:
        obj = self.rljob(name)
        return str(((obj or {}).get("status") or {}).get("phase", ""))

    def wait_phase(self, name: str, phase: str, timeout: float = 30) -> dict[str, Any]:
        wait_for(lambda: self.phase(name), f"{name} to be {phase}", lambda got: got == phase, timeout)
        return self.rljob(name) or {}

    def kuberay(self, name: str, **status: Any) -> None:
        """Play KubeRay: write the RayJob's status."""
        self.objects.patch_namespaced_custom_object_status(*RAY, name, {"status": status})

    def events(self, name: str) -> list[str]:
        return [e["reason"] for e in self.kube.objects("events", NS) if e["involvedObject"]["name"] == name]


@contextlib.contextmanager
def running_cluster(
    tmp_path: Path, job: str, recipe: str, env: dict[str, str] | None = None
) -> Iterator[Cluster]:
    """kmock with the operator running against it (``env`` added to the operator's), and a real
    exporter on the driver's metrics port labelled as the driver of ``job`` labels its series."""
    exporter = PromExporter(job=job, namespace=NS, recipe=recipe)
    port = exporter.serve(0, addr="127.0.0.1")
    with KubeEmulator(tmp_path, namespaces=[NS]) as kube:
        c = Cluster(tmp_path, kube, port)
        c.env.update(env or {})
        c.exporter = exporter  # type: ignore[attr-defined]
        c.start()
        try:
            yield c
        finally:
            c.stop()
            exporter.stop()
            print(c.log.read_text()[-4000:])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with running_cluster(tmp_path, "j1", "fp8-e2e") as c:
        yield c


def create(c: Cluster, name: str, job: dict[str, Any] | None = None) -> None:
    body = rl.manifest(name, NS, JobSpec.model_validate(job or {"steps": 10}))
    c.objects.create_namespaced_custom_object(*RL, body)


def test_lifecycle_suspend_resume_drift_restart_delete(cluster: Cluster) -> None:
    c = cluster
    create(c, "j1")
    [rayjob] = wait_for(c.rayjobs, "the RayJob")
    obj = c.wait_phase("j1", "Starting")
    uid = obj["metadata"]["uid"]
    assert "fp8rl.io/finalizer" in obj["metadata"]["finalizers"]
    assert rayjob["metadata"]["ownerReferences"][0]["uid"] == uid
    [cm] = c.kube.objects("configmaps", NS)
    assert cm["metadata"]["name"] == "j1-spec" and cm["metadata"]["ownerReferences"][0]["uid"] == uid
    assert JobSpec.model_validate_json(cm["data"]["job.json"]).steps == 10

    # KubeRay brings the cluster up and the driver runs; its progress reaches the RLJob status
    labels = {"ray.io/cluster": "j1-raycluster", "ray.io/node-type": "head"}
    head: Any = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "j1-head", "namespace": NS}}
    head["metadata"]["labels"] = labels
    head["status"] = {"podIP": "127.0.0.1", "phase": "Running"}
    c.core.create_namespaced_pod(NS, head)
    c.exporter.observe({"step": 4, "reward/mean": 0.5, "mismatch/token_mult_prob_error": 1.003})  # type: ignore[attr-defined]
    c.kuberay("j1", jobDeploymentStatus="Running", jobStatus="RUNNING", rayClusterName="j1-raycluster")
    c.wait_phase("j1", "Running")
    wait_for(lambda: (c.rljob("j1") or {})["status"]["progress"]["step"] == 4, "progress step 4")
    progress = (c.rljob("j1") or {})["status"]["progress"]
    assert progress["reward"] == 0.5 and progress["token_mult_prob_error"] == 1.003
    assert progress["total_steps"] == 10

    # a spec change while running is refused, with a condition saying why
    c.objects.patch_namespaced_custom_object(*RL, "j1", {"spec": {"job": {"steps": 99}}})

    def refused() -> bool:
        conds = (c.rljob("j1") or {})["status"]["conditions"]
        return any(x["type"] == "SpecChangeRefused" and x["status"] for x in conds)

    wait_for(refused, "the SpecChangeRefused condition")
    assert (
        c.rayjobs()[0]["metadata"]["annotations"][SPEC_HASH] == rayjob["metadata"]["annotations"][SPEC_HASH]
    )
    c.objects.patch_namespaced_custom_object(*RL, "j1", {"spec": {"job": {"steps": 10}}})  # put it back

    # suspend and resume through spec.suspend
    c.objects.patch_namespaced_custom_object(*RL, "j1", {"spec": {"suspend": True}})
    wait_for(lambda: c.rayjobs()[0]["spec"]["suspend"] is True, "the RayJob to be suspended")
    c.wait_phase("j1", "Suspended")
    c.kuberay("j1", jobDeploymentStatus="Suspended", jobStatus="STOPPED")
    c.objects.patch_namespaced_custom_object(*RL, "j1", {"spec": {"suspend": False}})
    wait_for(lambda: c.rayjobs()[0]["spec"]["suspend"] is False, "the RayJob to be resumed")
    c.wait_phase("j1", "Pending")
    c.kuberay("j1", jobDeploymentStatus="Running", jobStatus="RUNNING")
    c.wait_phase("j1", "Running")

    # drift: someone deletes the RayJob while the job should run; it comes back
    first_uid = c.rayjobs()[0]["metadata"]["uid"]
    c.objects.delete_namespaced_custom_object(*RAY, "j1")
    wait_for(lambda: c.rayjobs() and c.rayjobs()[0]["metadata"]["uid"] != first_uid, "the RayJob recreated")
    wait_for(lambda: "RayJobRecreated" in c.events("j1"), "a RayJobRecreated event")
    c.kuberay("j1", jobDeploymentStatus="Running", jobStatus="RUNNING", rayClusterName="j1-raycluster")
    c.wait_phase("j1", "Running")

    # an operator restart creates no duplicates and keeps the status
    c.stop()
    c.start()
    c.kuberay("j1", jobDeploymentStatus="Complete", jobStatus="SUCCEEDED")
    c.wait_phase("j1", "Succeeded")
    assert len(c.rayjobs()) == 1 and len(c.kube.objects("configmaps", NS)) == 1

    for reason in ("RayJobCreated", "Starting", "Running", "SpecChangeRefused", "Suspended", "Succeeded"):
        wait_for(lambda r=reason: r in c.events("j1"), f"a {reason} event")  # type: ignore[misc]
    assert c.events("j1").count("SpecChangeRefused") == 1

    # delete: the finalizer holds the RLJob until its RayJob and ConfigMap are gone
    c.objects.delete_namespaced_custom_object(*RL, "j1")
    wait_for(lambda: c.rljob("j1") is None, "the RLJob to go")
    assert c.rayjobs() == [] and c.kube.objects("configmaps", NS) == []


def test_failure_and_resume_after_it(cluster: Cluster) -> None:
    c = cluster
    create(c, "j2")
    wait_for(c.rayjobs, "the RayJob")
    c.kuberay("j2", jobDeploymentStatus="Failed", reason="DeadlineExceeded", message="ran too long")
    obj = c.wait_phase("j2", "Failed")
    assert obj["status"]["reason"] == "DeadlineExceeded" and obj["status"]["message"] == "ran too long"
    wait_for(lambda: "Failed" in c.events("j2"), "a Failed event")
    # the control plane's resume: status back to Pending; the finished RayJob is replaced
    failed_uid = c.rayjobs()[0]["metadata"]["uid"]
    store = KubernetesJobStore(c.api)
    store.update(NS, "j2", lambda s: s.moved(Phase.PENDING, "UserResumed", "resume requested", "resume"))
    wait_for(lambda: c.rayjobs() and c.rayjobs()[0]["metadata"]["uid"] != failed_uid, "a new RayJob")
    wait_for(lambda: "RayJobRestarted" in c.events("j2"), "a RayJobRestarted event")
    c.wait_phase("j2", "Starting")


def test_an_invalid_spec_fails_with_the_field(cluster: Cluster) -> None:
    c = cluster
    body = rl.manifest("bad", NS, JobSpec())
    body["spec"]["job"]["rollout"] = {"group_size": 0}
    c.objects.create_namespaced_custom_object(*RL, body)
    obj = c.wait_phase("bad", "Failed")
    assert obj["status"]["reason"] == "InvalidSpec" and "rollout.group_size" in obj["status"]["message"]
    assert c.rayjobs() == []
    wait_for(lambda: "InvalidSpec" in c.events("bad"), "an InvalidSpec event")


@pytest.mark.slow
def test_a_job_posted_to_the_service_is_picked_up(cluster: Cluster) -> None:
    """`fp8rl serve --store kubernetes` and the operator on one API: POST, suspend, DELETE."""
    c = cluster
    store = KubernetesJobStore(c.api)
    token = "service-token-0123456789"
    api = TestClient(create_app(Settings(store="kubernetes"), store, {token: NS}, OperatorHandoff(store)))
    auth = {"Authorization": f"Bearer {token}"}
    assert (
        api.post("/v1/jobs", json={"name": "posted", "spec": {"steps": 3}}, headers=auth).status_code == 201
    )
    [rayjob] = wait_for(c.rayjobs, "the RayJob of the posted job")
    assert rayjob["metadata"]["name"] == "posted"
    wait_for(
        lambda: api.get("/v1/jobs/posted", headers=auth).json()["status"]["phase"] == "Starting", "Starting"
    )
    assert api.post("/v1/jobs/posted:suspend", headers=auth).status_code == 200
    wait_for(lambda: c.rayjobs()[0]["spec"]["suspend"] is True, "the RayJob suspended")
    assert api.delete("/v1/jobs/posted", headers=auth).status_code == 204
    wait_for(lambda: c.rayjobs() == [] and c.rljob("posted") is None, "everything gone")


def test_a_resume_landing_mid_reconcile_is_not_undone(tmp_path: Path) -> None:
    """The control plane's resume (Failed -> Pending) lands after a reconcile read the RLJob and
    before it writes: the reconcile must not move the resumed job back to Failed from what it
    read; the next reconcile restarts the RayJob."""
    from operators.reconcile import Reconciler
    from operators.settings import OperatorSettings

    with KubeEmulator(tmp_path, namespaces=[NS]) as kube:
        api = api_client(str(kube.kubeconfig))
        objects = client.CustomObjectsApi(api)
        objects.create_namespaced_custom_object(*RL, rl.manifest("j3", NS, JobSpec(steps=10)))
        r = Reconciler(api, OperatorSettings())
        r.reconcile(NS, "j3")
        objects.patch_namespaced_custom_object_status(
            *RAY, "j3", {"status": {"jobDeploymentStatus": "Failed"}}
        )
        r.reconcile(NS, "j3")
        store = KubernetesJobStore(api)
        assert store.get(NS, "j3").status.phase is Phase.FAILED
        failed_uid = c_uid(objects)

        read_rayjob = r.read_rayjob

        def resume_then_read(ns: str, name: str) -> dict[str, Any] | None:
            store.update(
                NS, "j3", lambda s: s.moved(Phase.PENDING, "UserResumed", "resume requested", "resume")
            )
            r.read_rayjob = read_rayjob  # type: ignore[method-assign]
            return read_rayjob(ns, name)

        r.read_rayjob = resume_then_read  # type: ignore[method-assign]
        r.reconcile(NS, "j3")  # read Failed; the resume lands; the RayJob still says Failed
        assert store.get(NS, "j3").status.phase is Phase.PENDING
        r.reconcile(NS, "j3")
        assert c_uid(objects) != failed_uid
        assert store.get(NS, "j3").status.phase is Phase.STARTING


def c_uid(objects: Any) -> str:
    """The uid of RayJob j3."""
    return str(objects.get_namespaced_custom_object(*RAY, "j3")["metadata"]["uid"])


def test_each_job_gets_its_network_policy_and_a_foreign_image_is_refused(cluster: Cluster) -> None:
    """The per-job NetworkPolicy exists in the job's namespace before its RayJob, owned by the
    RLJob, selects the head and worker pods of that RayJob, has no allow-all rule, and goes with
    the RLJob; an RLJob naming an image outside the allow-list fails, naming the field."""
    c = cluster
    create(c, "j4")
    [rayjob] = wait_for(c.rayjobs, "the RayJob")
    [policy] = c.kube.objects("networkpolicies", NS)  # written before the RayJob
    obj = c.rljob("j4") or {}
    assert policy["metadata"]["name"] == "j4" and policy["metadata"]["namespace"] == NS
    [owner] = policy["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("RLJob", "j4", obj["metadata"]["uid"])
    cluster_spec = rayjob["spec"]["rayClusterSpec"]
    templates = [cluster_spec["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster_spec["workerGroupSpecs"]
    ]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert len(templates) == 3 and selector
    assert all(selector.items() <= t["metadata"]["labels"].items() for t in templates)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for rule in policy["spec"]["ingress"]:  # every rule names its sources, none is "everyone"
        assert rule["from"] and all(
            p.get("podSelector") and p.get("namespaceSelector") != {} for p in rule["from"]
        )

    body = rl.manifest("evil", NS, JobSpec(steps=2))
    body["spec"]["cluster"] = {"image": "docker.io/evil/miner:1"}
    c.objects.create_namespaced_custom_object(*RL, body)
    failed = c.wait_phase("evil", "Failed")
    assert failed["status"]["reason"] == "InvalidSpec"
    assert failed["status"]["message"].startswith(
        "spec.cluster.image: 'docker.io/evil/miner:1' is not an allowed"
    )
    [condition] = [x for x in failed["status"]["conditions"] if x["type"] == "Failed"]
    assert condition["reason"] == "InvalidSpec" and "spec.cluster.image" in condition["message"]
    assert [r["metadata"]["name"] for r in c.rayjobs()] == ["j4"]

    c.objects.delete_namespaced_custom_object(*RL, "j4")
    wait_for(lambda: c.rljob("j4") is None, "the RLJob to go")
    assert c.kube.objects("networkpolicies", NS) == []


def test_with_ray_auth_secret_each_job_gets_its_own_token(tmp_path: Path) -> None:
    """``ray_auth: secret``: a Secret per job, owned by it, made before the RayJob whose containers
    read it; a rebuilt RayJob keeps the token (the Secret is not replaced); delete removes it."""
    from operators.reconcile import Reconciler
    from operators.settings import OperatorSettings

    with KubeEmulator(tmp_path, namespaces=[NS]) as kube:
        api = api_client(str(kube.kubeconfig))
        objects = client.CustomObjectsApi(api)
        objects.create_namespaced_custom_object(*RL, rl.manifest("j5", NS, JobSpec(steps=10)))
        objects.create_namespaced_custom_object(*RL, rl.manifest("j6", NS, JobSpec(steps=10)))
        r = Reconciler(api, OperatorSettings(ray_auth="secret"))
        r.reconcile(NS, "j5")
        r.reconcile(NS, "j6")
        tokens = {s["metadata"]["name"]: s for s in kube.objects("secrets", NS)}
        assert set(tokens) == {"j5-ray-token", "j6-ray-token"}
        first = tokens["j5-ray-token"]["stringData"]["auth_token"]
        assert len(first) >= 32 and first != tokens["j6-ray-token"]["stringData"]["auth_token"]
        assert tokens["j5-ray-token"]["metadata"]["ownerReferences"][0]["name"] == "j5"
        rayjob: Any = objects.get_namespaced_custom_object(*RAY, "j5")
        env = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
        assert {
            "name": "RAY_AUTH_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "j5-ray-token", "key": "auth_token"}},
        } in env

        objects.delete_namespaced_custom_object(*RAY, "j5")  # drift: the RayJob is rebuilt
        r.reconcile(NS, "j5")
        assert objects.get_namespaced_custom_object(*RAY, "j5")
        [kept] = [s for s in kube.objects("secrets", NS) if s["metadata"]["name"] == "j5-ray-token"]
        assert kept["stringData"]["auth_token"] == first

        r.cleanup(rl.ObjectMeta(name="j5", namespace=NS))
        assert [s["metadata"]["name"] for s in kube.objects("secrets", NS)] == ["j6-ray-token"]
        assert [p["metadata"]["name"] for p in kube.objects("networkpolicies", NS)] == ["j6"]


def test_the_operator_will_not_start_jobs_on_a_kuberay_without_auth_options(tmp_path: Path) -> None:
    """A KubeRay older than 1.5.1 drops ``authOptions`` unnoticed: the operator refuses to start
    (saying what to do) rather than give jobs Ray clusters without a token."""
    crd: dict[str, Any] = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "rayjobs.ray.io"},
        "spec": {
            "group": "ray.io",
            "names": {"kind": "RayJob", "plural": "rayjobs"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "properties": {"spec": {"type": "object"}}}
                    },
                }
            ],
        },
    }
    with KubeEmulator(tmp_path, namespaces=[NS]) as kube:
        api = api_client(str(kube.kubeconfig))
        extensions: Any = client.ApiextensionsV1Api(api)  # takes plain dicts as bodies
        extensions.create_custom_resource_definition(crd)
        log = tmp_path / "operator.log"
        operator = start_operator(kube.kubeconfig, log, {"FP8RL_OPERATOR_POLL_SECONDS": "0.5"})
        try:
            assert operator.wait(timeout=60) != 0
        finally:
            if operator.poll() is None:
                operator.kill()
        assert "KubeRay's RayJob CRD has no rayClusterSpec.authOptions" in log.read_text()
        # with the Secret of ray_auth: secret it starts (and with a KubeRay that knows the field)
        from operators.reconcile import Reconciler
        from operators.settings import OperatorSettings

        assert Reconciler(api, OperatorSettings(ray_auth="secret")).kuberay_problem() is None
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"] = {
            "rayClusterSpec": {"type": "object", "properties": {"authOptions": {"type": "object"}}}
        }
        extensions.delete_custom_resource_definition("rayjobs.ray.io")
        extensions.create_custom_resource_definition({**crd, "metadata": {"name": "rayjobs.ray.io"}})
        assert Reconciler(api, OperatorSettings()).kuberay_problem() is None
