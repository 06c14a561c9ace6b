"""``/v1/graders/validate`` and ``/v1/graders/run``: a grader checked and run on one sample before a
job uses it, with the tenant's token, a rate limit, the sandbox for tenants' code (or a refusal
without one), and 501 where the control plane has no grader runtime. Expected scores are worked by
hand; the jobs' own admission refuses tenants' code in local jobs without a sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.graders import GraderRuntime
from service.main import create_app
from service.settings import Settings
from tests.helm.tools import tool

ALICE = "alice-token-0123456789"
HEADERS = {"Authorization": f"Bearer {ALICE}"}
SQUARE = {"prompt": "def f(x):\n", "test": "def check(c):\n    assert c(2) == 4\n", "entry_point": "f"}
SHOUTS = "def grade(sample, item):\n    return sample['output_text'].count('!') / item['most']\n"


def client(tmp_path: Path, **settings: Any) -> TestClient:
    chosen = {"data_dir": tmp_path, "bwrap": str(tool("bwrap")), **settings}
    return TestClient(create_app(Settings(**chosen), tokens={ALICE: "team-a"}))


def run(api: TestClient, grader: dict[str, Any], item: dict[str, Any], text: str) -> Any:
    return api.post(
        "/v1/graders/run",
        json={"grader": grader, "item": item, "sample": {"output_text": text}},
        headers=HEADERS,
    )


@pytest.mark.parametrize(
    ("grader", "item", "text", "reward"),
    [
        ({"type": "string_check", "operation": "contains", "reference": "{{item.city}}"},
         {"city": "Paris"}, "In Paris.", 1.0),
        ({"type": "numeric", "tolerance": 0.5}, {"answer": 10}, "about 10.4", 1.0),
        ({"type": "python", "source": SHOUTS}, {"most": 4}, "hi!!!", 0.75),  # 3 of 4
        ({"type": "math"}, {"answer": "\\frac{3}{4}"}, "so $0.75$", 1.0),
        ({"type": "code"}, SQUARE, "    return x * x\n", 1.0),
    ],
)  # fmt: skip
def test_run_scores_one_sample_by_hand(
    tmp_path: Path, grader: dict[str, Any], item: dict[str, Any], text: str, reward: float
) -> None:
    r = run(client(tmp_path), grader, item, text)
    assert r.status_code == 200, r.text
    assert r.json()["reward"] == pytest.approx(reward)


def test_run_reports_each_sub_grader_and_its_error(tmp_path: Path) -> None:
    multi = {
        "type": "multi",
        "graders": {
            "loud": {"type": "python", "source": SHOUTS},
            "json": {"type": "json"},
        },
        "formula": "0.5 * loud + 0.5 * json",
    }
    r = run(client(tmp_path), multi, {}, "hi!")  # item has no "most": the python grader fails
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["reward"] == 0.0
    assert body["graders"]["multi.loud"] == {
        "score": 0.0,
        "error": "line 2: KeyError: 'most'",
        "timeout": False,
    }
    assert body["graders"]["multi.json"]["score"] == 0.0


def test_validate_compiles_a_python_grader_in_the_sandbox(tmp_path: Path) -> None:
    api = client(tmp_path)
    r = api.post(
        "/v1/graders/validate", json={"grader": {"type": "python", "source": SHOUTS}}, headers=HEADERS
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["user_code"] == ["python"] and body["checked_in_sandbox"] is True
    assert body["grader"]["timeout_s"] == 5.0  # defaults filled in
    assert body["sandbox"].startswith("bubblewrap")
    bad = api.post(
        "/v1/graders/validate",
        json={"grader": {"type": "python", "source": "import not_installed_anywhere\n"}},
        headers=HEADERS,
    )
    assert bad.status_code == 422
    [error] = bad.json()["errors"]
    assert error["field"] == "grader"
    assert "ModuleNotFoundError: No module named 'not_installed_anywhere'" in error["message"]
    # the schema, as for a job: the field named
    r = api.post(
        "/v1/graders/validate", json={"grader": {"type": "numeric", "tolerance": -1}}, headers=HEADERS
    )
    assert r.status_code == 422 and "tolerance" in r.text


def test_a_grader_file_is_refused_over_rest(tmp_path: Path) -> None:
    r = run(client(tmp_path), {"type": "python", "file": "mine.py"}, {}, "x")
    assert r.status_code == 422 and "give its source" in r.text


def test_without_a_sandbox_tenants_code_is_refused_unless_the_operator_allows_it(tmp_path: Path) -> None:
    api = client(tmp_path, bwrap="no-such-bubblewrap", data_dir=tmp_path / "a")
    r = run(api, {"type": "python", "source": SHOUTS}, {"most": 1}, "!")
    assert r.status_code == 422
    assert "--allow-unsandboxed-graders" in r.json()["errors"][0]["message"]
    # graders without user code still run
    assert run(api, {"type": "json"}, {}, "[1]").json()["reward"] == 1.0
    # the job admission alike, on the embedded default (local drivers)
    job = {"task": {"dataset": "rows.jsonl", "grader": {"type": "python", "source": SHOUTS}}}
    r = api.post("/v1/jobs", json={"name": "loud", "spec": job}, headers=HEADERS)
    assert r.status_code == 422
    [error] = r.json()["errors"]
    assert error["field"] == "spec.task.graders" and "graders python run tenants' code" in error["message"]
    allowed = client(
        tmp_path, bwrap="no-such-bubblewrap", data_dir=tmp_path / "b", allow_unsandboxed_graders=True
    )
    assert run(allowed, {"type": "python", "source": SHOUTS}, {"most": 1}, "!").json()["reward"] == 1.0
    r = allowed.post("/v1/jobs", json={"name": "loud", "spec": job}, headers=HEADERS)
    assert r.status_code == 201, r.text


def test_a_tenant_is_rate_limited(tmp_path: Path) -> None:
    api = client(tmp_path, grader_runs_per_minute=2)
    grader = {"type": "json"}
    assert [run(api, grader, {}, "1").status_code for _ in range(2)] == [200, 200]
    r = run(api, grader, {}, "1")
    assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60
    r = api.post("/v1/graders/validate", json={"grader": grader}, headers=HEADERS)
    assert r.status_code == 429  # one budget for both


def test_no_token_no_grading_and_both_routes_are_documented(tmp_path: Path) -> None:
    api = client(tmp_path)
    assert api.post("/v1/graders/run", json={}).status_code == 401
    paths = api.get("/openapi.json").json()["paths"]
    assert "/v1/graders/validate" in paths and "/v1/graders/run" in paths


def test_a_control_plane_without_the_worker_tier_answers_501_and_still_validates(tmp_path: Path) -> None:
    api = client(tmp_path)
    runtime: GraderRuntime = api.app.state.graders  # type: ignore[attr-defined]
    runtime._probed, runtime.available, runtime.how = True, False, "no grader runtime (no worker tier)"
    r = run(api, {"type": "json"}, {}, "1")
    assert r.status_code == 501 and "fp8rl grade" in r.text
    r = api.post(
        "/v1/graders/validate", json={"grader": {"type": "python", "source": SHOUTS}}, headers=HEADERS
    )
    assert r.status_code == 200 and r.json()["checked_in_sandbox"] is False


def test_the_control_plane_never_calls_an_http_grader(tmp_path: Path) -> None:
    r = run(client(tmp_path), {"type": "http", "url": "http://169.254.169.254/latest/meta-data"}, {}, "x")
    assert r.status_code == 422 and "called by the job that uses it" in r.text
    r = run(client(tmp_path), {"type": "model", "model": "/etc"}, {}, "x")  # nor loads a tenant's model
    assert r.status_code == 422 and "runs on the job's own actor" in r.text
