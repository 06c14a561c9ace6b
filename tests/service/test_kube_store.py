"""``--store kubernetes`` against the real API server (tests/kube), acting as the chart's control
plane ServiceAccount: each job is an RLJob in its tenant's namespace, created, listed, read,
changed and deleted through the official client, under the chart's RBAC. The tenants' namespaces
here are not watched by the operator, so what is checked is the store alone."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from rljob import resource as rl
from rljob.jobs import JobExists, JobNotFound, TenantNamespaceMissing
from rljob.kube import KubernetesJobStore, api_client
from rljob.spec import JobSpec, load_spec
from rljob.status import JobStatus, Phase
from service.main import create_app
from service.operator_handoff import OperatorHandoff
from service.settings import Settings
from tests.helpers import wait_for
from tests.kube.cluster import KubeCluster
from tests.kube.install import CONTROL_PLANE_SA

pytestmark = pytest.mark.slow
ALICE, BOB, CAROL = "alice-token-0123456789", "bob-token-0123456789ab", "carol-token-0123456789"
EXAMPLE = Path(__file__).parents[2] / "examples" / "arithmetic-cpu.yaml"
_missing = itertools.count()


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def tenants(tenant: str, second_tenant: str) -> dict[str, str]:
    """Alice's and Bob's namespaces, and Carol's, which no admin created."""
    return {ALICE: tenant, BOB: second_tenant, CAROL: f"no-such-namespace-{next(_missing)}"}


@pytest.fixture
def store(control_plane_kubeconfig: Path) -> Iterator[KubernetesJobStore]:
    s = KubernetesJobStore(api_client(str(control_plane_kubeconfig)))
    yield s
    s.close()


@pytest.fixture
def api(store: KubernetesJobStore, tenants: dict[str, str]) -> TestClient:
    settings = Settings(store="kubernetes", max_concurrent_jobs=3, max_gpus=0)
    return TestClient(create_app(settings, store, tenants, OperatorHandoff(store)))


def rljobs(kube: KubeCluster, ns: str) -> list[dict[str, Any]]:
    return kube.objects("rljobs", ns)


def test_the_rljob_is_the_record(
    store: KubernetesJobStore, kube: KubeCluster, tenants: dict[str, str]
) -> None:
    a, b = tenants[ALICE], tenants[BOB]
    spec = load_spec(EXAMPLE)
    job = store.create(a, "arith", spec)
    assert job.name == "arith" and job.tenant == a and job.status.phase is Phase.PENDING
    [obj] = rljobs(kube, a)
    assert obj["apiVersion"] == "fp8rl.io/v1alpha1" and obj["kind"] == "RLJob"
    assert obj["metadata"]["labels"][rl.TENANT_LABEL] == a
    assert obj["spec"]["suspend"] is False
    # what the object holds is the whole spec, nothing else: it parses back to the same spec
    # (the CRD's schema kept every field: a field it pruned would be missing here)
    assert JobSpec.model_validate(obj["spec"]["job"]) == spec
    assert store.get(a, "arith").spec == spec
    assert rljobs(kube, b) == []


def test_create_list_get_delete_per_namespace(store: KubernetesJobStore, tenants: dict[str, str]) -> None:
    a, b = tenants[ALICE], tenants[BOB]
    for name in ("b-job", "a-job"):
        store.create(a, name, JobSpec(steps=3))
    store.create(b, "a-job", JobSpec(steps=5))  # same name, other tenant: fine
    with pytest.raises(JobExists):
        store.create(a, "a-job", JobSpec())
    with pytest.raises(TenantNamespaceMissing, match=tenants[CAROL]):
        store.create(tenants[CAROL], "x", JobSpec())
    jobs, total = store.query(a)
    assert total == 2 and {j.name for j in jobs} == {"a-job", "b-job"}
    assert store.get(b, "a-job").spec.steps == 5
    page, total = store.query(a, limit=1, offset=1)
    assert total == 2 and len(page) == 1
    everyone = {(j.tenant, j.name) for j in store.query(None, limit=1000)[0]}
    assert {(a, "a-job"), (a, "b-job"), (b, "a-job")} <= everyone
    store.delete(a, "a-job")
    with pytest.raises(JobNotFound):
        store.get(a, "a-job")
    with pytest.raises(JobNotFound):
        store.delete(a, "a-job")


def test_status_update_retries_on_a_conflicting_writer(
    store: KubernetesJobStore, tenants: dict[str, str], kube: KubeCluster
) -> None:
    """A second writer (as the operator would be) changes the status between our read and write:
    the real API server answers 409 and the change is re-applied to what that writer wrote."""
    a = tenants[ALICE]
    store.create(a, "race", JobSpec())
    other = KubernetesJobStore(api_client(str(kube.kubeconfig)))
    calls: list[Phase] = []

    def change(s: JobStatus) -> JobStatus:
        calls.append(s.phase)
        if len(calls) == 1:  # interleave the other writer once
            other.update(a, "race", lambda t: t.moved(Phase.STARTING, "RayJobCreated"))
        return s.model_copy(update={"message": "seen"}) if s.phase is Phase.STARTING else s

    job = store.update(a, "race", change)
    assert calls == [Phase.PENDING, Phase.STARTING]
    assert job.status.phase is Phase.STARTING and job.status.message == "seen"
    [obj] = rljobs(kube, a)
    assert obj["status"]["phase"] == "Starting" and obj["status"]["reason"] == "RayJobCreated"
    other.close()


def test_jobs_are_counted_by_a_watch_not_a_list_per_scrape(
    store: KubernetesJobStore, tenants: dict[str, str], kube: KubeCluster
) -> None:
    """``count_by_phase`` (the metrics port's fp8rl_jobs) follows creates, status changes and deletes
    through one cluster-wide watch: however many scrapes, the API server's audit log shows one LIST
    of RLJobs by the control plane, and a WATCH, all under the chart's RBAC (no 403 in this test)."""
    a, b = tenants[ALICE], tenants[BOB]
    user = CONTROL_PLANE_SA

    def cluster_lists() -> list[Any]:
        return [
            e for e in kube.audit(user) if e.resource == "rljobs" and not e.namespace and e.verb == "list"
        ]

    def counts() -> dict[tuple[str, str], int]:  # the counts of this test's two tenants (the
        # cluster holds the other tests' jobs too)
        return {k: n for k, n in store.count_by_phase().items() if k[0] in (a, b)}

    before, seen = len(cluster_lists()), len(kube.audit(user))
    store.create(a, "w1", JobSpec())
    assert counts() == {(a, "Pending"): 1}  # the first call lists (and waits for it)
    store.create(a, "w2", JobSpec())
    store.create(b, "w3", JobSpec())
    store.update(a, "w1", lambda t: t.moved(Phase.STARTING, "RayJobCreated"))
    want = {(a, "Pending"): 1, (a, "Starting"): 1, (b, "Pending"): 1}
    wait_for(counts, "the watch to see 3 jobs", lambda c: c == want, timeout=30)
    store.delete(a, "w2")
    want = {(a, "Starting"): 1, (b, "Pending"): 1}
    wait_for(counts, "the watch to see the delete", lambda c: c == want, timeout=30)
    for _ in range(20):  # scrapes
        assert counts() == want
    assert len(cluster_lists()) - before == 1
    calls = kube.audit(user)[seen:]  # this test's calls (an earlier test's refusals are its own)
    assert any(e.resource == "rljobs" and e.verb == "watch" and e.code == 200 for e in calls)
    assert not [e for e in calls if e.code == 403], [e for e in calls if e.code == 403]


def test_api_on_the_kubernetes_store(api: TestClient, kube: KubeCluster, tenants: dict[str, str]) -> None:
    a = tenants[ALICE]
    r = api.post("/v1/jobs", json={"name": "j1", "spec": {"steps": 7}}, headers=auth(ALICE))
    assert r.status_code == 201, r.text
    assert r.json()["status"]["phase"] == "Pending" and r.json()["tenant"] == a
    assert api.post("/v1/jobs", json={"name": "j1"}, headers=auth(ALICE)).status_code == 409
    # tenants are namespaces: Bob sees nothing of Alice's
    assert api.get("/v1/jobs/j1", headers=auth(BOB)).status_code == 404
    assert api.get("/v1/jobs", headers=auth(BOB)).json()["total"] == 0
    assert api.get("/v1/jobs", headers=auth(ALICE)).json()["items"][0]["spec"]["steps"] == 7
    # suspend/resume: the status moves and spec.suspend tells the operator
    r = api.post("/v1/jobs/j1:suspend", headers=auth(ALICE))
    assert r.status_code == 200 and r.json()["status"]["phase"] == "Suspended"

    def obj() -> dict[str, Any]:
        [o] = rljobs(kube, a)
        return o

    assert obj()["spec"]["suspend"] is True and obj()["status"]["phase"] == "Suspended"
    assert api.post("/v1/jobs/j1:suspend", headers=auth(ALICE)).status_code == 409
    r = api.post("/v1/jobs/j1:resume", headers=auth(ALICE))
    assert r.status_code == 200 and r.json()["status"]["phase"] == "Pending"
    assert obj()["spec"]["suspend"] is False
    # per-step history and logs live with the RayJob, not the control plane
    r = api.get("/v1/jobs/j1/metrics", headers=auth(ALICE))
    assert r.status_code == 404 and "Prometheus" in r.json()["detail"]
    assert r.json()["type"].endswith("/not-kept-here")
    assert api.get("/v1/jobs/j1/logs", headers=auth(ALICE)).status_code == 404
    # a tenant without a namespace gets a clear 403
    r = api.post("/v1/jobs", json={"name": "j1"}, headers=auth(CAROL))
    assert r.status_code == 403 and f"namespace '{tenants[CAROL]}'" in r.json()["detail"]
    assert api.get("/readyz").status_code == 200
    # the metrics port's text (its counts follow a watch: the resume may take a moment to show)
    wait_for(
        lambda: generate_latest(api.app.state.metrics).decode(),  # type: ignore[attr-defined]
        "fp8rl_jobs to count the resumed job",
        lambda series: f'fp8rl_jobs{{namespace="{a}",phase="Pending"}} 1.0' in series,
        timeout=30,
    )
    assert api.delete("/v1/jobs/j1", headers=auth(ALICE)).status_code == 204
    assert rljobs(kube, a) == []


def test_limits_count_the_tenants_rljobs(api: TestClient) -> None:
    for i in range(3):
        assert api.post("/v1/jobs", json={"name": f"j{i}"}, headers=auth(BOB)).status_code == 201
    r = api.post("/v1/jobs", json={"name": "j3"}, headers=auth(BOB))
    assert r.status_code == 403 and "3 active jobs" in r.json()["detail"]
    assert api.post("/v1/jobs", json={"name": "j3"}, headers=auth(ALICE)).status_code == 201
    spec = {"resources": {"generators": 1, "gpus_per_generator": 1}}
    r = api.post("/v1/jobs", json={"name": "gpu", "spec": spec}, headers=auth(ALICE))
    assert r.status_code == 403 and "asks for 1 GPUs" in r.json()["detail"], r.text


def test_api_server_down_is_503(kube: KubeCluster, tmp_path: Path) -> None:
    # the cluster's CA and a token, but a port nobody listens on
    from tests.kube.cluster import free_port

    config = kube.write_kubeconfig(tmp_path / "down.kubeconfig", "nobody", "not-a-token")
    config.write_text(config.read_text().replace(kube.server, f"https://127.0.0.1:{free_port()}"))
    store = KubernetesJobStore(api_client(str(config)))
    api = TestClient(
        create_app(Settings(store="kubernetes"), store, {ALICE: "team-a"}, OperatorHandoff(store))
    )
    r = api.get("/v1/jobs", headers=auth(ALICE))
    assert r.status_code == 503 and "Kubernetes API server" in r.json()["detail"]
    assert api.get("/readyz").status_code == 503
