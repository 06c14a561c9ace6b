"""The SmolLM2 example (``examples/smollm2-addition.yaml``) as a tenant submits it to the service,
on the model ``fp8rl model fetch`` put in the models cache (the session fixture ``smollm2_dir``).

The operator of the service shares the cache read-only with every tenant: ``FP8RL_MODEL_ROOTS``
names the cache's ``models`` directory. A real ``fp8rl serve`` with a real local driver then runs
one step of the example on a models root (SmolLM2's tokenizer on 2 layers), and its metrics
endpoint shows the step the run directory holds. Without the
root, the same directory named by absolute path, by ``..`` from the tenant's home, or through a
symlink in that home is refused at POST (422 naming ``spec.model.name``): no driver runs for those.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient

from service.main import create_app
from service.settings import Settings
from tests.helpers import wait_for
from tests.service.servers import serve

# above its longest wait (pyproject's timeout of 300 s would cut that short: tests/test_timeouts.py)
pytestmark = pytest.mark.timeout(960)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2-addition.yaml"
TOKEN = "smollm2-token-0123456789"
TENANT = "team-a"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
RUN_TIMEOUT = 900  # s: Ray's start, the model's load and one step, with a training run beside it


def example(model_name: str) -> dict[str, Any]:
    """The example's spec as a user posts it, scaled to one small step: 2 prompts x 2 responses,
    BF16, no validation; ``model.name`` replaced."""
    spec: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec["model"]["name"] = model_name
    spec["rollout"].update(prompts_per_step=2, group_size=2)
    spec["validation"]["interval"] = 0
    spec["precision"]["recipe"] = "bf16"
    spec["steps"] = 1
    return spec


def post(api: TestClient, name: str, model_name: str) -> Any:
    return api.post("/v1/jobs", json={"name": name, "spec": example(model_name)}, headers=HEADERS)


def service(tmp_path: Path) -> tuple[TestClient, Path]:
    """The service's app (its settings from the environment, as ``fp8rl serve`` reads them; jobs
    are recorded and stay Pending) and the tenant's home."""
    settings = Settings(data_dir=tmp_path / "data")
    home = settings.tenant_home(TENANT)
    home.mkdir(parents=True)
    return TestClient(create_app(settings, tokens={TOKEN: TENANT})), home


def refused(r: Any) -> str:
    """The message of a 422 that names ``spec.model.name`` alone."""
    assert r.status_code == 422, r.text
    [error] = r.json()["errors"]
    assert error["field"] == "spec.model.name", error
    assert "leads outside the tenant's files" in error["message"]
    return str(error["message"])


def test_the_fetched_model_is_admitted_under_the_model_roots(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FP8RL_MODEL_ROOTS", str(smollm2_dir.parent))
    api, home = service(tmp_path)
    assert post(api, "absolute", str(smollm2_dir)).status_code == 201
    # a link in the tenant's home that leads into a read-only root reaches the same shared files
    (home / "smollm2").symlink_to(smollm2_dir)
    assert post(api, "linked", "smollm2").status_code == 201


def test_the_fetched_model_is_refused_outside_the_model_roots(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FP8RL_MODEL_ROOTS", raising=False)
    api, home = service(tmp_path)
    refused(post(api, "absolute", str(smollm2_dir)))
    refused(post(api, "dotdot", os.path.relpath(smollm2_dir, home)))
    (home / "smollm2").symlink_to(smollm2_dir)
    refused(post(api, "symlink", "smollm2"))
    # a root that is not the cache: still refused, and the message names the root a tenant may use
    monkeypatch.setenv("FP8RL_MODEL_ROOTS", str(tmp_path / "shared-models"))
    other, _ = service(tmp_path / "other")
    assert str(tmp_path / "shared-models") in refused(post(other, "elsewhere", str(smollm2_dir)))
    assert api.get("/v1/jobs", headers=HEADERS).json()["items"] == []  # nothing was recorded


@pytest.mark.slow
def test_the_example_runs_on_a_models_root_through_fp8rl_serve(
    smollm2_small_dir: Path, tmp_path: Path
) -> None:
    """``fp8rl serve`` with ``FP8RL_MODEL_ROOTS`` naming a models directory; a tenant POSTs the
    example naming a model there (SmolLM2's tokenizer and chat template on 2 random layers: this
    is the plumbing, tests/workers/test_smollm2.py runs the real weights); the driver runs its one
    step, and what the REST API reports is what the run directory holds."""
    roots = {"FP8RL_MODEL_ROOTS": str(smollm2_small_dir.parent)}
    with serve(tmp_path, {TOKEN: TENANT}, "--store", "sql", env=roots) as url:
        body = {"name": "smollm2", "spec": example(str(smollm2_small_dir))}
        r = httpx.post(f"{url}/v1/jobs", json=body, headers=HEADERS)
        assert r.status_code == 201, r.text

        def job() -> dict[str, Any]:
            answer: dict[str, Any] = httpx.get(f"{url}/v1/jobs/smollm2", headers=HEADERS).json()
            return answer

        done = wait_for(
            job, "the job to end", lambda j: j["status"]["phase"] in ("Succeeded", "Failed"), RUN_TIMEOUT, 1.0
        )
        logs = httpx.get(f"{url}/v1/jobs/smollm2/logs", headers=HEADERS, timeout=30).text
        assert done["status"]["phase"] == "Succeeded", (done["status"], logs[-3000:])
        rows = httpx.get(f"{url}/v1/jobs/smollm2/metrics", headers=HEADERS).json()
    run = tmp_path / "data" / "runs" / TENANT / "smollm2"
    on_disk = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == on_disk
    [row] = [r for r in rows if "reward/mean" in r]
    assert row["step"] == 1
    assert row["response_length/mean"] <= 12  # the example's max_new_tokens
    # every weight the trainer sent is held by the generator: 2 layers x (7 linears, 2 norms), the
    # embedding and the final norm (the lm_head is tied to the embedding)
    assert (row["sync/layers_checked"], row["sync/layers_mismatched"]) == (2 * 9 + 2, 0)
    progress = done["status"]["progress"]
    assert (progress["step"], progress["total_steps"], progress["reward"]) == (1, 1, row["reward/mean"])
    resolved = json.loads((run / "spec.resolved.json").read_text())
    assert resolved["model"]["name"] == str(smollm2_small_dir)


def test_the_example_as_shipped_names_the_cache_of_the_services_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example's ``model.name: ~/.cache/fp8rl/models/...`` is expanded where the service reads
    the spec (the home of the service's user), then confined like any absolute path."""
    monkeypatch.setenv("HOME", str(tmp_path / "svc"))
    spec = yaml.safe_load(EXAMPLE.read_text())
    assert spec["model"]["name"] == "~/.cache/fp8rl/models/smollm2-135m-instruct"
    monkeypatch.delenv("FP8RL_MODEL_ROOTS", raising=False)
    api, _ = service(tmp_path / "closed")
    r = api.post("/v1/jobs", json={"name": "as-shipped", "spec": spec}, headers=HEADERS)
    assert str(tmp_path / "svc" / ".cache") in refused(r)
    monkeypatch.setenv("FP8RL_MODEL_ROOTS", str(tmp_path / "svc" / ".cache" / "fp8rl" / "models"))
    api, _ = service(tmp_path / "shared")
    r = api.post("/v1/jobs", json={"name": "as-shipped", "spec": spec}, headers=HEADERS)
    assert r.status_code == 201, r.text
