"""The RLJob CRD: generated from the models, committed for the chart, structural, accepted by the
Kubernetes schema for CRDs, and it accepts the examples and rejects what the models reject."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rljob import resource as rl
from rljob.crd import CRD_PATH, crd, crd_yaml, openapi_to_jsonschema
from rljob.status import JobStatus, Progress

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("rljob-*.yaml"))


def schema() -> dict[str, Any]:
    version: dict[str, Any] = crd()["spec"]["versions"][0]
    out: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return out


def test_committed_crd_matches_the_models() -> None:
    assert CRD_PATH.read_text() == crd_yaml(), "the CRD drifted from rljob/: run `make crd`"


def test_names_and_columns() -> None:
    spec = crd()["spec"]
    assert crd()["metadata"]["name"] == "rljobs.fp8rl.io" and spec["group"] == "fp8rl.io"
    assert spec["names"]["kind"] == "RLJob" and spec["names"]["shortNames"] == ["rlj"]
    [version] = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == ["Phase", "Step", "Reward", "Tokens/s", "Mismatch", "Age"]
    # every column's path exists in a status the models produce
    status = {"status": JobStatus(progress=Progress(step=3, reward=0.5)).model_dump(mode="json")}
    for column in version["additionalPrinterColumns"][:-1]:
        node: Any = status
        for part in column["jsonPath"].strip(".").split("."):
            assert part in node, column
            node = node[part]


def test_accepted_by_the_kubernetes_crd_schema() -> None:
    kubernetes_validate.validate(crd(), desired_version="1.33", strict=True)


def _walk(node: dict[str, Any], path: str = "") -> list[str]:
    """Violations of the structural-schema rules a real API server enforces."""
    bad = []
    for key in ("$ref", "anyOf", "oneOf", "allOf", "default", "prefixItems", "$defs"):
        if key in node:
            bad.append(f"{path}: {key}")
    if "type" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        bad.append(f"{path}: no type")
    if "properties" in node and "additionalProperties" in node:
        bad.append(f"{path}: properties and additionalProperties")
    for name, child in node.get("properties", {}).items():
        bad += _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        bad += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        bad += _walk(node["additionalProperties"], f"{path}.*")
    return bad


def test_schema_is_structural() -> None:
    assert _walk(schema()) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    jsonschema.validate(obj, openapi_to_jsonschema(schema()))
    spec = rl.spec_of(obj)  # and the models accept them
    assert obj["kind"] == rl.KIND and spec.job.steps > 0


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"job": {"steps": "many"}}, "steps"),
        ({"job": {"precision": {"recipe": "fp16"}}}, "recipe"),
        ({"job": {"rollout": {"group_size": 0}}}, "group_size"),
        ({"job": {"optimizer": {"betas": [0.9]}}}, "betas"),
        ({"cluster": {"queue": {"scheduler": "slurm", "name": "q"}}}, "scheduler"),
        ({"cluster": {"generation": {"nodeSelector": {"pool": 3}}}}, "pool"),
        ({"suspend": "maybe"}, "suspend"),
        ({"job": {"task": {"grader": {"type": "nope"}}}}, "type"),
        ({"job": {"task": {"grader": {"type": "numeric", "tolerance": "near"}}}}, "tolerance"),
        ({"job": {"task": {"graders": [{"weight": 1}]}}}, "type"),  # the discriminator is required
    ],
)
def test_schema_rejects_what_the_models_reject(patch: dict[str, Any], field: str) -> None:
    obj = {"apiVersion": rl.API_VERSION, "kind": rl.KIND, "metadata": {"name": "x"}, "spec": patch}
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.validate(obj, openapi_to_jsonschema(schema()))
    assert field in str(err.value.path) or field in err.value.message or field in str(err.value.schema_path)
    with pytest.raises(ValueError):
        rl.spec_of(obj)
