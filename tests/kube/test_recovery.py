"""Failures, resumes and races on the real API server, with the real KubeRay failing the RayJob:
what was tested on kmock by writing KubeRay's status by hand now comes from KubeRay itself."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from operators.reconcile import Reconciler
from operators.settings import OperatorSettings
from rljob import resource as rl
from rljob.kube import KubernetesJobStore, api_client
from rljob.spec import JobSpec
from rljob.status import Phase
from tests.helpers import wait_for
from tests.kube import install
from tests.kube.cluster import KubeCluster, wait_object
from tests.kube.jobs import Jobs, tenant_kubeconfig
from tests.kube.test_operator import TINY

pytestmark = pytest.mark.slow


def test_a_failed_job_resumes_on_a_new_rayjob(
    kube: KubeCluster, operator: install.Process, tmp_path: Path
) -> None:
    jobs = Jobs(kube, "team-a", tenant_kubeconfig(kube, "team-a", tmp_path))
    # KubeRay fails a RayJob past its deadline: DeadlineExceeded, its own reason and message
    jobs.apply("deadline", TINY, cluster={"activeDeadlineSeconds": 2})
    failed = jobs.wait_phase("deadline", "Failed", timeout=60)
    assert failed["reason"] == "DeadlineExceeded", failed
    first = (jobs.rayjob("deadline") or {})["metadata"]["uid"]
    wait_for(lambda: jobs.events("deadline"), "a Failed event", lambda ev: any(r == "Failed" for r, _ in ev))
    # the control plane's resume: Pending again; the finished RayJob is replaced by a new one
    store = KubernetesJobStore(api_client(str(kube.kubeconfig)))
    store.update(
        "team-a", "deadline", lambda s: s.moved(Phase.PENDING, "UserResumed", "resume requested", "resume")
    )
    wait_for(
        lambda: (jobs.rayjob("deadline") or {}).get("metadata", {}).get("uid"),
        "a new RayJob",
        lambda uid: uid not in (None, first),
    )
    wait_for(
        lambda: jobs.events("deadline"),
        "RayJobRestarted",
        lambda ev: any(r == "RayJobRestarted" for r, _ in ev),
    )
    jobs.delete("deadline")
    store.close()


def test_a_spec_the_crd_admits_but_the_job_model_refuses_fails_with_the_field(
    kube: KubeCluster, operator: install.Process, tmp_path: Path
) -> None:
    jobs = Jobs(kube, "team-a", tenant_kubeconfig(kube, "team-a", tmp_path))
    # what the CRD's schema can say, the API server refuses at once, naming the field
    refused = kube.kubectl(
        "apply", "-n", "team-a", "-f", "-", kubeconfig=jobs.tenant, check=False,
        input='{"apiVersion": "fp8rl.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "zero"},'
        ' "spec": {"job": {"rollout": {"group_size": 0}}}}',
    )  # fmt: skip
    assert refused.returncode != 0 and "spec.job.rollout.group_size" in refused.stderr
    # a rule across fields (share_gpu needs one GPU each) passes the schema: the operator refuses it
    jobs.apply(
        "shared", {**TINY, "resources": {"share_gpu": True, "gpus_per_generator": 2, "gpus_per_trainer": 1}}
    )
    st = jobs.wait_phase("shared", "Failed")
    assert st["reason"] == "InvalidSpec" and "resources" in st["message"] and "share_gpu" in st["message"]
    assert jobs.rayjob("shared") is None
    wait_for(
        lambda: jobs.events("shared"),
        "an InvalidSpec event",
        lambda ev: any(r == "InvalidSpec" for r, _ in ev),
    )
    # as do a foreign image and an output directory the pods cannot write
    jobs.apply("evil", TINY, cluster={"image": "docker.io/evil/miner:1"})
    jobs.apply("rootdir", {**TINY, "output_dir": "/runs/rootdir"})
    st = jobs.wait_phase("evil", "Failed")
    assert st["message"].startswith("spec.cluster.image: 'docker.io/evil/miner:1' is not an allowed")
    st = jobs.wait_phase("rootdir", "Failed")
    assert st["message"].startswith("spec.job.output_dir: '/runs/rootdir' is not writable in the job's pods")
    for name in ("shared", "evil", "rootdir"):
        assert jobs.rayjob(name) is None
        jobs.delete(name)


def test_a_resume_landing_mid_reconcile_is_not_undone(kube: KubeCluster, chart: Path, tenant: str) -> None:
    """The control plane's resume (Failed -> Pending) lands after a reconcile read the RLJob and
    before it writes: the reconcile must not move the resumed job back to Failed from what it read;
    the next reconcile restarts the RayJob. (An in-process reconciler on a namespace no running
    operator watches, so the test decides when each reconcile runs; KubeRay is real.)"""
    api = api_client(str(kube.kubeconfig))
    store = KubernetesJobStore(api)
    kube.apply({**rl.manifest("j3", tenant, JobSpec.model_validate(TINY)), "spec": {
        "job": TINY, "suspend": False, "cluster": {"activeDeadlineSeconds": 1}}})  # fmt: skip
    r = Reconciler(api, OperatorSettings(ray_auth="secret"))
    r.reconcile(tenant, "j3")
    uid = wait_object(
        lambda: kube.get("rayjob", "j3", tenant),
        "KubeRay to fail the RayJob at its deadline",
        lambda rj: (rj or {}).get("status", {}).get("jobDeploymentStatus") == "Failed",
        timeout=60,
    )["metadata"]["uid"]
    r.reconcile(tenant, "j3")
    assert store.get(tenant, "j3").status.phase is Phase.FAILED

    read_rayjob = r.read_rayjob

    def resume_then_read(ns: str, name: str) -> dict[str, Any] | None:
        store.update(
            tenant, "j3", lambda s: s.moved(Phase.PENDING, "UserResumed", "resume requested", "resume")
        )
        r.read_rayjob = read_rayjob  # type: ignore[method-assign]
        return read_rayjob(ns, name)

    r.read_rayjob = resume_then_read  # type: ignore[method-assign]
    r.reconcile(tenant, "j3")  # read Failed; the resume lands; the RayJob still says Failed
    assert store.get(tenant, "j3").status.phase is Phase.PENDING

    # the next reconciles (the operator's ticks) delete the finished RayJob and, once KubeRay's
    # finalizer let it go, make its successor
    def tick() -> str | None:
        r.reconcile(tenant, "j3")
        return (kube.get("rayjob", "j3", tenant) or {}).get("metadata", {}).get("uid")

    wait_for(tick, "a new RayJob", lambda got: got not in (None, uid), every=1)
    assert store.get(tenant, "j3").status.phase is Phase.STARTING
    store.close()


def test_idle_ticks_write_no_status(kube: KubeCluster, operator: install.Process, tmp_path: Path) -> None:
    """Once a job's status says what KubeRay says, the operator's ticks (every second here) read and
    write nothing more: the API server's audit log counts its status writes."""
    jobs = Jobs(kube, "team-b", tenant_kubeconfig(kube, "team-b", tmp_path))
    jobs.apply("idle", TINY)
    wait_for(
        lambda: jobs.status("idle"),
        "DriverStarting",
        lambda s: s.get("reason") == "DriverStarting",
        timeout=90,
    )
    time.sleep(2)

    def writes() -> int:
        return sum(
            1
            for c in kube.audit(install.OPERATOR_SA)
            if c.rule == ("fp8rl.io", "rljobs/status", "patch")
            and c.name == "idle"
            and c.namespace == "team-b"
        )

    def reads() -> int:
        return sum(
            1
            for c in kube.audit(install.OPERATOR_SA)
            if c.rule == ("fp8rl.io", "rljobs", "get") and c.name == "idle"
        )

    before, read_before = writes(), reads()
    time.sleep(5)
    assert reads() - read_before >= 3  # it kept looking, once a second
    assert writes() == before
    jobs.delete("idle")
