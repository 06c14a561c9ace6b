"""Attempts and retries on the real KubeRay (issue 48, item 5): a driver started again in place
keeps the Ray cluster (kuberay#4971), a failure that needs a new cluster gets one, and the RLJob's
status lists each attempt and how it ended (kuberay#5211). The driver's exits are simulated (its
supervisor's numbering, tests/kube/podnet.py); the RayJobs, Ray clusters and pods are KubeRay's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_for
from tests.kube import install
from tests.kube.cluster import KubeCluster
from tests.kube.jobs import Jobs, tenant_kubeconfig
from tests.kube.podnet import PodNetwork
from tests.kube.test_operator import TINY, running_pods, step_row

pytestmark = pytest.mark.slow


def cluster_of(kube: KubeCluster, jobs: Jobs, name: str) -> tuple[str, str, list[str]]:
    """(RayJob uid, RayCluster uid, pod uids) of a job."""
    rayjob = jobs.rayjob(name) or {}
    raycluster = kube.get("raycluster", rayjob["status"]["rayClusterName"], jobs.ns) or {}
    pods = sorted(
        p["metadata"]["uid"]
        for p in jobs.pods(name)
        if p["metadata"]["labels"]["fp8rl.io/group"] != "submitter"
    )
    return rayjob["metadata"]["uid"], raycluster["metadata"]["uid"], pods


def attempts(jobs: Jobs, name: str) -> list[dict[str, Any]]:
    return list(jobs.status(name).get("attempts") or [])


def test_a_driver_started_again_in_place_keeps_its_ray_cluster(
    kube: KubeCluster, operator: install.Process, podnet: PodNetwork, tmp_path: Path
) -> None:
    jobs = Jobs(kube, "team-b", tenant_kubeconfig(kube, "team-b", tmp_path))
    jobs.apply("inplace", TINY)
    running_pods(jobs, "inplace")
    rayjob = jobs.rayjob("inplace") or {}
    # the entrypoint asks for in-place retries (the chart's jobDefaults.inPlaceRetries, 2)
    assert rayjob["spec"]["entrypoint"].endswith("--in-place-retries 2")
    driver = podnet.run_driver("team-b", "inplace")
    driver.exporter.observe(step_row(1, 0.5))
    [first] = wait_for(lambda: attempts(jobs, "inplace"), "attempt 1", lambda a: len(a) == 1)
    assert (first["number"], first["cluster"], first["cause"], first["outcome"]) == (
        1,
        "new",
        "created",
        "Running",
    )
    before = cluster_of(kube, jobs, "inplace")

    # the driver dies (exit 1); its supervisor starts it again on the same cluster
    again = podnet.restart_driver("team-b", "inplace", exit_code=1)
    again.exporter.observe(step_row(1, 0.5))
    got = wait_for(lambda: attempts(jobs, "inplace"), "attempt 2", lambda a: len(a) == 2)
    assert (got[0]["outcome"], got[0]["reason"]) == ("Failed", "DriverExited")
    assert got[0]["message"] == "the driver exited with 1; started again on the same Ray cluster"
    assert (got[1]["number"], got[1]["cluster"], got[1]["cause"], got[1]["outcome"]) == (
        2,
        "reused",
        "in-place",
        "Running",
    )
    assert cluster_of(kube, jobs, "inplace") == before  # same RayJob, same Ray cluster, same pods
    assert jobs.status("inplace")["phase"] == "Running"
    jobs.delete("inplace")
    podnet.finish("team-b", "inplace")


def test_a_failure_that_needs_a_new_cluster_gets_one_and_the_attempts_say_so(
    kube: KubeCluster, operator: install.Process, podnet: PodNetwork, tmp_path: Path
) -> None:
    """KubeRay 1.5.0 with rayAuth secret cannot tell a failed job from a succeeded one, so its own
    retry is off (backoffLimit 0 on the RayJob) and the operator retries: the driver ended without
    saying it was done (out of in-place retries, or its cluster lost a node), KubeRay fails the
    RayJob 30 s after its submitter ended, and a new RayJob brings a new Ray cluster."""
    jobs = Jobs(kube, "team-b", tenant_kubeconfig(kube, "team-b", tmp_path))
    jobs.apply("rebuilt", TINY, cluster={"backoffLimit": 1})
    running_pods(jobs, "rebuilt")
    assert (jobs.rayjob("rebuilt") or {})["spec"]["backoffLimit"] == 0
    driver = podnet.run_driver("team-b", "rebuilt")
    driver.exporter.observe(step_row(1, 0.5))
    jobs.wait_phase("rebuilt", "Running")
    first_rayjob, first_cluster, first_pods = cluster_of(kube, jobs, "rebuilt")

    podnet.finish("team-b", "rebuilt", succeeded=False)  # the driver exits without being done
    got = wait_for(
        lambda: attempts(jobs, "rebuilt"), "attempt 2 on a new cluster", lambda a: len(a) == 2, timeout=120
    )
    assert (got[0]["outcome"], got[0]["reason"]) == (
        "Failed",
        "JobDeploymentStatusTransitionGracePeriodExceeded",
    )
    assert (got[1]["cluster"], got[1]["cause"], got[1]["outcome"]) == ("new", "retried", "Running")
    wait_for(
        lambda: jobs.events("rebuilt"), "RayJobRetried", lambda ev: any(r == "RayJobRetried" for r, _ in ev)
    )
    running_pods(jobs, "rebuilt")
    rayjob, raycluster, pods = cluster_of(kube, jobs, "rebuilt")
    assert rayjob != first_rayjob and raycluster != first_cluster and not set(pods) & set(first_pods)

    # attempt 2 finishes: the job succeeded, with both attempts on record
    driver = podnet.run_driver("team-b", "rebuilt")
    driver.exporter.observe(step_row(3, 0.9))
    driver.exporter.complete()
    wait_for(
        lambda: jobs.status("rebuilt"),
        "DriverCompleted",
        lambda s: any(c["type"] == "DriverCompleted" for c in s.get("conditions", [])),
    )
    podnet.finish("team-b", "rebuilt")
    done = jobs.wait_phase("rebuilt", "Succeeded", timeout=120)
    assert [(a["number"], a["outcome"]) for a in done["attempts"]] == [(1, "Failed"), (2, "Succeeded")]
    jobs.delete("rebuilt")
