"""The REST contract: the OpenAPI document says exactly what the service answers.

schemathesis runs with every check (status codes, media types, headers, response schemas, the
``Allow`` of a 405, negative data rejected, the stateful phase following the document's links),
``positive_data_acceptance`` aside (a valid-looking spec can still be refused on purpose, e.g.
over a tenant's job limit), against a real ``fp8rl serve`` in both store modes: ``sql`` (jobs run
as local drivers; one at a time, so the run stays small) and ``kubernetes`` on the real API server
(tests/kube), acting as the chart's control plane ServiceAccount. It must find
nothing. The command is the one in docs/control-plane.md; the seed is fixed so that CI is
repeatable (run it by hand without ``--seed`` to explore further).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.servers import serve

# above its longest wait (pyproject's timeout of 300 s would cut that short: tests/test_timeouts.py)
pytestmark = pytest.mark.timeout(660)

TOKEN = "contract-token-0123456789"
TENANT = "team-a"
SEED = 20261123


def schemathesis(url: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json"]
    cmd += ["-H", f"Authorization: Bearer {TOKEN}", "--checks", "all"]
    cmd += ["--exclude-checks", "positive_data_acceptance", "--max-examples", "60"]
    cmd += ["--phases", "examples,coverage,fuzzing,stateful", "--seed", str(SEED), "--no-color"]
    cmd += ["--report-dir", str(tmp_path / "report")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def _assert_clean(result: subprocess.CompletedProcess[str]) -> None:
    out = result.stdout + result.stderr
    summary = out[out.rfind("SUMMARY") :] if "SUMMARY" in out else out[-3000:]
    assert result.returncode == 0, out[-12000:]
    assert "No issues found" in out or " passed" in summary, out[-3000:]
    assert "failure" not in summary.lower().replace("0 failures", ""), summary


@pytest.mark.slow
def test_the_sql_store_answers_as_documented(tmp_path: Path) -> None:
    # one job at a time for the tenant: the fuzzing cannot start more than one training process
    with serve(tmp_path, {TOKEN: TENANT}, "--store", "sql", env={"FP8RL_MAX_CONCURRENT_JOBS": "1"}) as url:
        result = schemathesis(url, tmp_path)
    _assert_clean(result)


@pytest.mark.slow
def test_the_kubernetes_store_answers_as_documented(
    tmp_path: Path, tenant: str, control_plane_kubeconfig: Path
) -> None:
    args = ("--store", "kubernetes", "--kubeconfig", str(control_plane_kubeconfig))
    with serve(tmp_path, {TOKEN: tenant}, *args) as url:
        result = schemathesis(url, tmp_path)
    _assert_clean(result)


def test_the_document_states_errors_media_types_and_rules() -> None:
    """What the schemathesis runs rely on, read from the document itself (fast, no server)."""
    import tempfile

    from service.main import create_app
    from service.settings import Settings

    doc = create_app(Settings(data_dir=Path(tempfile.mkdtemp())), tokens={TOKEN: TENANT}).openapi()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and {"Problem", "ValidationProblem", "FieldError"} <= set(
        schemas
    )
    for path, item in doc["paths"].items():
        for method, op in item.items():
            for code, response in op["responses"].items():
                if int(code) >= 400:  # every error is a problem, documented with its schema
                    assert list(response["content"]) == ["application/problem+json"], (method, path, code)
            if path.startswith("/v1/"):
                assert "401" in op["responses"], (method, path)
    jobs = doc["paths"]["/v1/jobs"]
    assert "Location" in jobs["post"]["responses"]["201"]["headers"]
    assert "Retry-After" in jobs["post"]["responses"]["503"]["headers"]
    assert "Allow" in jobs["get"]["responses"]["405"]["headers"]
    logs = doc["paths"]["/v1/jobs/{name}/logs"]["get"]["responses"]["200"]
    assert list(logs["content"]) == ["text/plain"]
    # the cross-field rules JSON Schema cannot express are stated in the fields' descriptions
    model = schemas["ModelSpec"]["properties"]
    assert "exactly one of `name` and `tiny`" in model["name"]["description"]
    assert "exactly one of `name` and `tiny`" in model["tiny"]["description"]
    assert "at most `high`" in schemas["ImportanceSamplingSpec"]["properties"]["low"]["description"]
    assert "setting both is an error" in schemas["TaskSpec"]["properties"]["reasoning_gym"]["description"]
