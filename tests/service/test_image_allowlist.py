"""The REST API never lets a tenant pick the image its job runs (issue 40, the image allow-list on
the REST path): the POST body is a name and the job spec only, so an image anywhere in it
(``spec.cluster.image``, or a ``cluster`` beside the spec) is an unknown field, answered 422 with
the field, and nothing is recorded. The RLJobs the service records carry no ``spec.cluster``, so
they run the operator's default image, which the operator's allow-list always admits; an RLJob
made with kubectl is checked by the operator (tests/operators: InvalidSpec naming
``spec.cluster.image``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from operators import admission, builders
from operators.settings import OperatorSettings
from rljob import resource as rl
from rljob.kube import KubernetesJobStore, api_client
from service.main import create_app
from service.settings import Settings
from tests.kube.cluster import KubeCluster

pytestmark = pytest.mark.slow
TOKEN = "image-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EVIL = "docker.io/evil/miner:1"


@pytest.fixture
def api(
    kube: KubeCluster, tenant: str, control_plane_kubeconfig: Path
) -> Iterator[tuple[TestClient, KubeCluster, str]]:
    """The REST API on the real API server, as the chart's control plane, for the tenant ``tenant``."""
    store = KubernetesJobStore(api_client(str(control_plane_kubeconfig)))
    yield TestClient(create_app(Settings(store="kubernetes"), store, {TOKEN: tenant})), kube, tenant
    store.close()


def fields(answer: Any) -> list[str]:
    return [e["field"] for e in answer.json()["errors"]]


def test_an_image_in_the_body_is_refused_with_422_and_nothing_is_recorded(
    api: tuple[TestClient, KubeCluster, str],
) -> None:
    http, kube, ns = api
    inside = http.post(
        "/v1/jobs", json={"name": "j1", "spec": {"steps": 2, "cluster": {"image": EVIL}}}, headers=AUTH
    )
    assert inside.status_code == 422, inside.text
    assert [f for f in fields(inside) if f.startswith("spec.cluster")], inside.json()
    beside = http.post(
        "/v1/jobs", json={"name": "j2", "spec": {"steps": 2}, "cluster": {"image": EVIL}}, headers=AUTH
    )
    assert beside.status_code == 422, beside.text
    assert "cluster" in fields(beside)
    assert kube.objects("rljobs", ns) == []


def test_a_job_the_service_records_runs_the_operators_default_image(
    api: tuple[TestClient, KubeCluster, str],
) -> None:
    http, kube, ns = api
    assert http.post("/v1/jobs", json={"name": "j3", "spec": {"steps": 2}}, headers=AUTH).status_code == 201
    [obj] = kube.objects("rljobs", ns)
    assert "image" not in (obj["spec"].get("cluster") or {})
    job, settings = rl.RLJob.of(obj), OperatorSettings()
    assert admission.image_problems(job.spec, settings) == []
    head = builders.rayjob(job, settings)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    assert head["spec"]["containers"][0]["image"] == settings.image
