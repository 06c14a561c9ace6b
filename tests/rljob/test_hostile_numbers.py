"""A spec a tenant wrote to break the service is refused where it is read, naming the field.

- Every float field of every spec type (the job spec and the RLJob's ``spec``, found by walking the
  models, so a new field is covered without a new line here) refuses ``NaN``, ``Infinity`` and
  ``1e309`` (a float past its range, which JSON parsers read as infinity). JSON has no such
  values: accepted, they were stored as ``null`` and the record could never be read again.
- ``task.params`` is allow-listed per reasoning-gym generator (:mod:`rljob.task_params`): a key
  that names a file is refused with one message whether the file exists or not; numbers are finite
  and bounded; strings are not paths.
"""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from rljob import SpecError, parse_spec
from rljob.resource import RLJobSpec
from rljob.spec import JobSpec


def _float_fields(model: type[BaseModel], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], bool]]:
    """``[(path, is_tuple_of_two)]`` of every float field below ``model``."""
    out: list[tuple[tuple[str, ...], bool]] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        args = typing.get_args(field.annotation) or (field.annotation,)
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                out += _float_fields(arg, (*path, key))
        text = str(field.annotation)
        if text.startswith("tuple[") and "float" in text:
            out.append(((*path, key), True))
        elif field.annotation in (float, float | None):
            out.append(((*path, key), False))
    return out


def _nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    data: Any = value
    for key in reversed(path):
        data = {key: data}
    return typing.cast(dict[str, Any], data)


FLOATS = _float_fields(RLJobSpec)
BAD = ["NaN", "Infinity", "-Infinity", "1e309"]


def test_the_walk_finds_the_fields_the_issue_named() -> None:
    # a hand-written list of fields the attack used: the walk must reach each of them
    found = {".".join(p) for p, _ in FLOATS}
    for named in (
        "job.optimizer.grad_clip",
        "job.optimizer.betas",
        "job.algorithm.importance_sampling.high",
        "job.algorithm.importance_sampling.low",
        "job.rollout.temperature",
        "job.resources.hang_timeout_s",
    ):
        assert named in found
    # counted by hand in rljob/spec.py, resources_spec.py and task_spec.py; the graders' (a union the
    # walk does not enter) are in tests/rljob/test_graders.py
    # 19, validation.pass_k_temperature, and precision.mismatch_slo median, tail_bound and tail_fraction
    assert len(found) == 23


@pytest.mark.parametrize("literal", BAD)
@pytest.mark.parametrize(("path", "pair"), FLOATS, ids=[".".join(p) for p, _ in FLOATS])
def test_every_float_field_refuses_non_finite_json(path: tuple[str, ...], pair: bool, literal: str) -> None:
    # JSON text as a client sends it: Python's json writes NaN/Infinity; 1e309 parses to infinity
    value = f"[{literal}, 0.5]" if pair else literal
    body = json.dumps(_nested(path, "@"))
    body = body.replace('"@"', value)
    with pytest.raises(ValidationError) as info:
        RLJobSpec.model_validate_json(body)
    locs = [".".join(str(p) for p in e["loc"]) for e in info.value.errors()]
    want = ".".join(path) + (".0" if pair else "")
    assert want in locs, locs
    assert any("finite number" in e["msg"] for e in info.value.errors())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_yaml_or_python_spec_refuses_non_finite_numbers_too(value: float) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({"optimizer": {"grad_clip": value}}, "test")
    assert info.value.problems[0].startswith("optimizer.grad_clip:")


@pytest.mark.parametrize(
    ("section", "value", "field"),
    [
        ({"optimizer": {"grad_clip": 1e7}}, None, "optimizer.grad_clip"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, None, "optimizer.betas.1"),
        ({"algorithm": {"importance_sampling": {"high": 1e6}}}, None, "algorithm.importance_sampling.high"),
        ({"task": {"seed": 2**31}}, None, "task.seed"),
        ({"rollout": {"seed": 2**63}}, None, "rollout.seed"),
        ({"checkpoint_interval": 10**12}, None, "checkpoint_interval"),
        ({"precision": {"keep_bf16_layers": [0, 10**9]}}, None, "precision.keep_bf16_layers.1"),
    ],
)
def test_numbers_that_were_unbounded_have_a_bound(section: dict[str, Any], value: None, field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(section, "test")
    assert any(p.startswith(field + ":") for p in info.value.problems), info.value.problems


def test_cluster_deadlines_are_bounded() -> None:
    with pytest.raises(ValidationError) as info:
        RLJobSpec.model_validate({"cluster": {"activeDeadlineSeconds": 10**12}})
    assert info.value.errors()[0]["loc"] == ("cluster", "activeDeadlineSeconds")


def _params_problem(task: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec({"task": task}, "test")
    (problem,) = info.value.problems
    return problem


@pytest.mark.parametrize("path", ["/etc/passwd", "/no/such/file", "../../x.txt", "words.txt", "/dev/zero"])
def test_a_file_in_params_is_refused_alike_whether_it_exists_or_not(path: str) -> None:
    problem = _params_problem({"reasoning_gym": "spell_backward", "params": {"data_file": path}})
    # the same words for every path, whatever the file system holds: no oracle of what exists
    assert problem.split(" (got ")[0] == (
        "task: Value error, task.params.data_file: names a file; task.params never names files "
        "(use task.dataset for a JSONL file)"
    )


def test_params_keys_are_the_generators_own() -> None:
    problem = _params_problem({"reasoning_gym": "basic_arithmetic", "params": {"max_digitz": 2}})
    assert "task.params.max_digitz: not a parameter of 'basic_arithmetic'" in problem
    assert "max_digits" in problem  # it says what the generator takes
    assert "task.params.size" in _params_problem({"params": {"size": 5}})
    unknown = _params_problem({"reasoning_gym": "basic_arithmetik"})
    assert "task.reasoning_gym: unknown reasoning-gym generator 'basic_arithmetik'" in unknown


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        # basic_arithmetic's max_digits defaults to 4 (reasoning-gym's config): its cap is
        # max(100, 10 x 4) = 100, so 4,000-digit sums are refused
        ({"max_digits": 4000}, "task.params.max_digits: 4000 is over 100"),
        ({"max_digits": float("nan")}, "task.params.max_digits: nan is not a finite number"),
        ({"operators": ["+"] * 300}, "a list of 300 items"),
        ({"operators": ["../../etc"]}, "task.params.operators.0: '../../etc' looks like a file path"),
        ({"operators": ["x" * 300]}, "a string of 300 characters"),
        ({"operators": [[[[[["+"]]]]]]}, "nested more than 4 levels deep"),
    ],
)
def test_params_values_are_bounded(params: dict[str, Any], needle: str) -> None:
    assert needle in _params_problem({"params": params})


def test_params_that_a_job_uses_pass() -> None:
    # the examples' addition, with division among the operators: "/" alone is not a path
    spec = parse_spec(
        {"task": {"params": {"max_digits": 100, "operators": ["+", "-", "*", "/"], "allow_negation": False}}},
        "test",
    )
    assert spec.task.params["max_digits"] == 100
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec  # it reads back as stored


def test_composite_datasets_are_checked_against_each_generator() -> None:
    entry = {"name": "spell_backward", "weight": 1, "config": {"data_file": "/etc/passwd"}}
    problem = _params_problem({"reasoning_gym": "composite", "params": {"datasets": [entry]}})
    assert "task.params.datasets.0.config.data_file: names a file" in problem
    bad_name = {"name": "nope", "weight": 1, "config": {}}
    problem = _params_problem({"reasoning_gym": "composite", "params": {"datasets": [bad_name]}})
    assert "task.params.datasets.0.name: unknown reasoning-gym generator 'nope'" in problem
    good = {"name": "basic_arithmetic", "weight": 1.0, "config": {"max_digits": 2}}
    parse_spec({"task": {"reasoning_gym": "composite", "params": {"datasets": [good]}}}, "test")


def test_a_dataset_file_takes_no_params() -> None:
    problem = _params_problem({"dataset": "data.jsonl", "params": {"max_digits": 2}})
    assert "task.params: task.params are a reasoning-gym generator's; a dataset file takes none" in problem
