"""Admission caps what one job can cost (``rljob.costs``, ``service.admission``): a tiny model's
parameters, tokens per step, threads and the size of ``task.params``, each a 422 naming the field
and the setting, from settings with stated defaults. The jobs of issue 49's attack (a tiny model
at every maximum, ~5.5e11 parameters; 65,536 prompts x 1,024 samples x 32,768 tokens; 64 actors x
256 threads) are refused; the examples pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from rljob import load_spec, parse_spec
from rljob.costs import BYTES_VOCAB, tiny_parameters
from service.main import create_app
from service.settings import Settings
from workers.engines.models import build_policy

TOKEN = "cost-token-0123456789ab"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    "tiny",
    [
        {},
        {"arch": "qwen2"},
        {"tie_word_embeddings": True, "num_layers": 3, "hidden_size": 64, "num_heads": 8, "num_kv_heads": 2},
        {"hidden_size": 576, "intermediate_size": 1536, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3},
    ],
)
def test_the_parameter_estimate_is_the_built_models_count(tiny: dict[str, Any]) -> None:
    """A second implementation: the engines' own model, built on ``meta`` (no memory), counted."""
    spec = parse_spec({"model": {"tiny": tiny}})
    model = build_policy(spec, BYTES_VOCAB, torch.float32, device="meta")
    assert spec.model.tiny is not None
    assert tiny_parameters(spec.model.tiny, BYTES_VOCAB) == sum(p.numel() for p in model.parameters())


def _post(spec: dict[str, Any], **settings: Any) -> tuple[int, list[dict[str, str]]]:
    app = create_app(Settings(**settings), tokens={TOKEN: "team-a"})
    with TestClient(app) as api:
        r = api.post(
            "/v1/jobs", json={"name": "j", "spec": spec}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
    return r.status_code, r.json().get("errors", []) if r.status_code == 422 else []


MAXIMAL_TINY = {
    "hidden_size": 16384,
    "intermediate_size": 65536,
    "num_layers": 128,
    "num_heads": 256,
    "num_kv_heads": 256,
}


@pytest.mark.parametrize(
    ("spec", "field", "setting"),
    [
        ({"model": {"tiny": MAXIMAL_TINY}}, "spec.model.tiny", "max_parameters"),
        (
            {"rollout": {"prompts_per_step": 65536, "group_size": 1024, "max_new_tokens": 32768}},
            "spec.rollout.max_new_tokens",
            "max_tokens_per_step",
        ),
        (
            {"resources": {"trainers": 32, "generators": 32, "threads_per_actor": 256}},
            "spec.resources.threads_per_actor",
            "max_threads",
        ),
    ],
)
def test_a_job_over_a_cost_cap_is_422_naming_the_field_and_setting(
    tmp_path: Path, spec: dict[str, Any], field: str, setting: str
) -> None:
    code, errors = _post(spec, data_dir=tmp_path)
    assert code == 422
    assert any(e["field"] == field and setting in e["message"] for e in errors), errors


def test_the_maximal_tiny_model_is_hundreds_of_billions_of_parameters() -> None:
    # worked by hand: 128 x (2 x 16384^2 + 2 x 16384^2 [kv = heads] + 3 x 16384 x 65536 + 2 x 16384)
    # + 2 x 272 x 16384 + 16384, the vocabulary 259 padded to 272
    per_layer = 4 * 16384**2 + 3 * 16384 * 65536 + 2 * 16384
    expected = 128 * per_layer + 2 * 272 * 16384 + 16384
    tiny = parse_spec({"model": {"tiny": MAXIMAL_TINY}}).model.tiny
    assert tiny is not None and tiny_parameters(tiny, BYTES_VOCAB) == expected
    assert expected > 5e11


def test_the_params_size_cap(tmp_path: Path) -> None:
    params = {"operators": ["+"] * 200}  # ~800 bytes of JSON
    code, errors = _post({"task": {"params": params}}, data_dir=tmp_path, max_task_params_bytes=500)
    assert code == 422 and errors[0]["field"] == "spec.task.params", errors
    assert "max_task_params_bytes" in errors[0]["message"]
    assert _post({"task": {"params": params}}, data_dir=tmp_path)[0] == 201  # the 16 KiB default


@pytest.mark.parametrize(
    "example", ["arithmetic-cpu.yaml", "addition-cpu.yaml", "smollm2-addition.yaml", "arithmetic-gpu.yaml"]
)
def test_the_examples_pass_the_default_caps(tmp_path: Path, example: str) -> None:
    from rljob.costs import costs

    spec = load_spec(EXAMPLES / example)
    cost = costs(spec)
    s = Settings(data_dir=tmp_path)
    assert cost.parameters <= s.max_parameters and cost.tokens_per_step <= s.max_tokens_per_step
    assert cost.threads <= s.max_threads and cost.params_bytes <= s.max_task_params_bytes
