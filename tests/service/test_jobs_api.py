"""The /v1/jobs API on the embedded SQLite store (no executor): every endpoint and error."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from rljob.jobs import Limits
from service.auth import TokenFileError, load_tokens
from service.main import create_app
from service.settings import Settings

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"
TOKENS = {ALICE: "team-a", BOB: "team-b"}


def client(tmp_path: Path, **settings: object) -> TestClient:
    app = create_app(Settings(data_dir=tmp_path, **settings), tokens=TOKENS)  # type: ignore[arg-type]
    return TestClient(app)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def api(tmp_path: Path) -> TestClient:
    return client(tmp_path, max_concurrent_jobs=100)


def test_token_required(api: TestClient) -> None:
    assert api.get("/v1/jobs").status_code == 401
    assert api.get("/v1/jobs", headers=auth("wrong-token-0123456789")).status_code == 401
    r = api.get("/v1/jobs", headers={"Authorization": "Basic x"})
    assert r.status_code == 401 and "Bearer" in r.json()["detail"]
    assert ALICE not in r.text


def test_create_get_list_delete(api: TestClient) -> None:
    r = api.post("/v1/jobs", json={"name": "job-1", "spec": {"steps": 3}}, headers=auth(ALICE))
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["name"] == "job-1" and body["tenant"] == "team-a"
    assert body["status"]["phase"] == "Pending" and body["spec"]["steps"] == 3
    assert api.get("/v1/jobs/job-1", headers=auth(ALICE)).json()["spec"]["steps"] == 3
    listing = api.get("/v1/jobs", headers=auth(ALICE)).json()
    assert [j["name"] for j in listing["items"]] == ["job-1"] and listing["total"] == 1
    assert api.delete("/v1/jobs/job-1", headers=auth(ALICE)).status_code == 204
    assert api.get("/v1/jobs/job-1", headers=auth(ALICE)).status_code == 404
    assert api.delete("/v1/jobs/job-1", headers=auth(ALICE)).status_code == 404


def test_duplicate_name_is_409_per_tenant(api: TestClient) -> None:
    assert api.post("/v1/jobs", json={"name": "same"}, headers=auth(ALICE)).status_code == 201
    r = api.post("/v1/jobs", json={"name": "same"}, headers=auth(ALICE))
    assert r.status_code == 409 and "already exists" in r.json()["detail"]
    assert api.post("/v1/jobs", json={"name": "same"}, headers=auth(BOB)).status_code == 201  # other tenant


def test_tenants_never_see_each_other(api: TestClient) -> None:
    api.post("/v1/jobs", json={"name": "secret"}, headers=auth(ALICE))
    assert api.get("/v1/jobs/secret", headers=auth(BOB)).status_code == 404
    assert api.delete("/v1/jobs/secret", headers=auth(BOB)).status_code == 404
    assert api.post("/v1/jobs/secret:suspend", headers=auth(BOB)).status_code == 404
    assert api.get("/v1/jobs", headers=auth(BOB)).json()["total"] == 0
    assert api.get("/v1/jobs/secret", headers=auth(ALICE)).status_code == 200


def test_invalid_spec_is_422_with_field_paths(api: TestClient) -> None:
    r = api.post(
        "/v1/jobs",
        json={"name": "x", "spec": {"rollout": {"group_size": 0}, "precision": {"recipe": "fp4"}}},
        headers=auth(ALICE),
    )
    assert r.status_code == 422
    fields = sorted(p["field"] for p in r.json()["errors"])
    assert fields == ["spec.precision.recipe", "spec.rollout.group_size"]
    bad_name = api.post("/v1/jobs", json={"name": "Not_A_Label"}, headers=auth(ALICE))
    assert bad_name.status_code == 422 and bad_name.json()["errors"][0]["field"] == "name"
    unknown = api.post("/v1/jobs", json={"name": "y", "extra": 1}, headers=auth(ALICE))
    assert unknown.status_code == 422 and unknown.json()["errors"][0]["field"] == "extra"


def test_malformed_and_oversized_bodies_are_4xx(tmp_path: Path) -> None:
    api = client(tmp_path, max_body_bytes=2048)
    headers = {**auth(ALICE), "Content-Type": "application/json"}
    malformed = api.post("/v1/jobs", content=b"{not json", headers=headers)
    assert malformed.status_code == 400 and "not valid JSON" in malformed.json()["detail"]
    assert malformed.headers["content-type"] == "application/problem+json"
    assert api.post("/v1/jobs", content=b"[]", headers=headers).status_code == 422  # JSON, wrong shape
    big = json.dumps({"name": "big", "spec": {"task": {"params": {"x": "a" * 5000}}}})
    r = api.post("/v1/jobs", content=big.encode(), headers=headers)
    assert r.status_code == 413 and "2048" in r.json()["detail"]


def test_suspend_resume_follow_the_state_machine(api: TestClient) -> None:
    api.post("/v1/jobs", json={"name": "j"}, headers=auth(ALICE))
    r = api.post("/v1/jobs/j:suspend", headers=auth(ALICE))
    assert r.status_code == 200 and r.json()["status"]["phase"] == "Suspended"
    again = api.post("/v1/jobs/j:suspend", headers=auth(ALICE))
    assert again.status_code == 409
    assert (
        again.json()["detail"]
        == "cannot suspend a job in phase Suspended; allowed next phases: Cancelled, Pending"
    )
    r = api.post("/v1/jobs/j:resume", headers=auth(ALICE))
    assert r.status_code == 200 and r.json()["status"]["phase"] == "Pending"
    assert r.json()["status"]["reason"] == "UserResumed"
    assert api.post("/v1/jobs/nope:resume", headers=auth(ALICE)).status_code == 404


def test_list_pages_and_filters(api: TestClient) -> None:
    for i in range(5):
        api.post("/v1/jobs", json={"name": f"j{i}"}, headers=auth(ALICE))
    api.post("/v1/jobs/j1:suspend", headers=auth(ALICE))
    page = api.get("/v1/jobs?limit=2", headers=auth(ALICE)).json()
    assert (
        [j["name"] for j in page["items"]] == ["j0", "j1"] and page["next_offset"] == 2 and page["total"] == 5
    )
    last = api.get("/v1/jobs?limit=2&offset=4", headers=auth(ALICE)).json()
    assert [j["name"] for j in last["items"]] == ["j4"] and last["next_offset"] is None
    suspended = api.get("/v1/jobs?phase=Suspended", headers=auth(ALICE)).json()
    assert [j["name"] for j in suspended["items"]] == ["j1"]
    assert api.get("/v1/jobs?phase=Sleeping", headers=auth(ALICE)).status_code == 422
    assert api.get("/v1/jobs?limit=0", headers=auth(ALICE)).status_code == 422


def test_tenant_limits(tmp_path: Path) -> None:
    api = client(tmp_path, max_concurrent_jobs=2, max_gpus=4)
    gpu_job = {"resources": {"gpus_per_generator": 1, "trainers": 2, "gpus_per_trainer": 1}}  # 1*1 + 2*1 = 3
    assert api.post("/v1/jobs", json={"name": "a", "spec": gpu_job}, headers=auth(ALICE)).status_code == 201
    r = api.post("/v1/jobs", json={"name": "b", "spec": gpu_job}, headers=auth(ALICE))
    assert (
        r.status_code == 403
        and "asks for 3 GPUs" in r.json()["detail"]
        and "uses 3 of 4" in r.json()["detail"]
    )
    assert api.post("/v1/jobs", json={"name": "c"}, headers=auth(ALICE)).status_code == 201
    r = api.post("/v1/jobs", json={"name": "d"}, headers=auth(ALICE))
    assert r.status_code == 403 and "limit 2" in r.json()["detail"]
    api.post("/v1/jobs/c:suspend", headers=auth(ALICE))  # suspended jobs do not count
    assert api.post("/v1/jobs", json={"name": "d"}, headers=auth(ALICE)).status_code == 201


def test_per_tenant_limit_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8RL_TENANT_LIMITS overrides the service-wide limits for the tenants it names."""
    monkeypatch.setenv(
        "FP8RL_TENANT_LIMITS", '{"team-a": {"max_concurrent_jobs": 1}, "team-b": {"max_gpus": 0}}'
    )
    settings = Settings(data_dir=tmp_path, max_concurrent_jobs=3, max_gpus=4)
    assert settings.limits("team-a") == Limits(1, 4, 1000, 64 << 20) and settings.limits("team-b") == Limits(
        3, 0, 1000, 64 << 20
    )
    assert settings.limits("team-z") == Limits(3, 4, 1000, 64 << 20)
    api = TestClient(create_app(settings, tokens=TOKENS))
    assert api.post("/v1/jobs", json={"name": "a1"}, headers=auth(ALICE)).status_code == 201
    r = api.post("/v1/jobs", json={"name": "a2"}, headers=auth(ALICE))
    assert r.status_code == 403 and "limit 1" in r.json()["detail"]
    gpu_job = {"resources": {"gpus_per_generator": 1}}
    r = api.post("/v1/jobs", json={"name": "b1", "spec": gpu_job}, headers=auth(BOB))
    assert r.status_code == 403 and "uses 0 of 0" in r.json()["detail"]
    for i in range(3):
        assert api.post("/v1/jobs", json={"name": f"b{i}"}, headers=auth(BOB)).status_code == 201


def test_fifty_clients_at_once_record_every_job_exactly_once(tmp_path: Path) -> None:
    api = client(tmp_path, max_concurrent_jobs=1000)
    with ThreadPoolExecutor(50) as pool:
        distinct = list(
            pool.map(lambda i: api.post("/v1/jobs", json={"name": f"n{i}"}, headers=auth(ALICE)), range(50))
        )
        same = list(
            pool.map(lambda i: api.post("/v1/jobs", json={"name": "one"}, headers=auth(BOB)), range(50))
        )
    assert [r.status_code for r in distinct] == [201] * 50
    assert sorted(r.status_code for r in same) == [201] + [409] * 49
    names = [j["name"] for j in api.get("/v1/jobs?limit=500", headers=auth(ALICE)).json()["items"]]
    assert sorted(names) == sorted(f"n{i}" for i in range(50))


def test_jobs_survive_a_restart(tmp_path: Path) -> None:
    client(tmp_path).post("/v1/jobs", json={"name": "kept"}, headers=auth(ALICE))
    assert client(tmp_path).get("/v1/jobs/kept", headers=auth(ALICE)).status_code == 200


def test_health_and_openapi(api: TestClient) -> None:
    assert api.get("/healthz").json() == {"status": "ok"}
    assert api.get("/readyz").json() == {"status": "ready"}
    schema = api.get("/openapi.json").json()
    assert "/v1/jobs/{name}:suspend" in schema["paths"]
    assert api.get("/docs").status_code == 200


def test_tokens_file(tmp_path: Path) -> None:
    good = tmp_path / "tokens.yaml"
    good.write_text(f"{ALICE}: team-a\n")
    assert load_tokens(good) == {ALICE: "team-a"}
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"abc": "team-a"}))
    with pytest.raises(TokenFileError, match=">= 16 characters"):
        load_tokens(short)
    bad_tenant = tmp_path / "t.yaml"
    bad_tenant.write_text(f"{ALICE}: Team_A\n")
    with pytest.raises(TokenFileError, match="DNS label"):
        load_tokens(bad_tenant)
    with pytest.raises(TokenFileError, match="tokens file"):
        load_tokens(tmp_path / "missing.yaml")


def test_an_empty_control_plane_exports_zero_jobs_per_phase(api: TestClient) -> None:
    """The series of the metrics port (tests/service/test_metrics_port.py serves them)."""
    text = generate_latest(api.app.state.metrics).decode()  # type: ignore[attr-defined]
    for tenant in ("team-a", "team-b"):
        for phase in ("Pending", "Running", "Succeeded", "Failed", "Suspended", "Cancelled"):
            assert f'fp8rl_jobs{{namespace="{tenant}",phase="{phase}"}} 0.0' in text, (tenant, phase)
    api.post("/v1/jobs", json={"name": "one"}, headers=auth(ALICE))
    text = generate_latest(api.app.state.metrics).decode()  # type: ignore[attr-defined]
    assert 'fp8rl_jobs{namespace="team-a",phase="Pending"} 1.0' in text
    assert 'fp8rl_jobs{namespace="team-b",phase="Pending"} 0.0' in text


def test_exact_with_async_is_422_naming_both_fields(api: TestClient) -> None:
    spec = {"rollout": {"max_staleness": 1}, "precision": {"exact": True, "recipe": "bf16"}}
    r = api.post("/v1/jobs", json={"name": "exact-async", "spec": spec}, headers=auth(ALICE))
    assert r.status_code == 422
    (err,) = r.json()["errors"]
    assert err["field"] == "spec"
    assert "precision.exact" in err["message"] and "rollout.max_staleness" in err["message"]
    ok = {"rollout": {"max_staleness": 1}}
    assert api.post("/v1/jobs", json={"name": "async", "spec": ok}, headers=auth(ALICE)).status_code == 201
