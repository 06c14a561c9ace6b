"""Graders in the spec (rljob.graders, rljob.formula): what is accepted, what is refused and how the
refusal names the field; formulas worked by hand."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rljob import formula
from rljob.graders import MAX_GRADERS, needs_sandbox, template_problems
from rljob.spec import JobSpec, TaskSpec


def task(**fields: Any) -> TaskSpec:
    return TaskSpec.model_validate({"dataset": "rows.jsonl", **fields})


def refused(fields: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as err:
        task(**fields)
    return str(err.value)


def test_no_grader_is_the_answer_grader_of_answer_format_and_format_reward() -> None:
    [g] = task(answer_format="boxed", format_reward=0.2).grader_list()
    assert (g.type, g.answer_format, g.format_reward, g.reference) == (
        "answer",
        "boxed",
        0.2,
        "{{item.answer}}",
    )


def test_one_grader_or_a_list_each_named_by_name_or_type() -> None:
    one = task(grader={"type": "json"}).grader_list()
    assert [g.type for g in one] == ["json"]
    listed = task(
        graders=[{"type": "answer", "name": "correct"}, {"type": "json", "weight": 0.5}]
    ).grader_list()
    assert [(g.name or g.type, g.weight) for g in listed] == [("correct", 1.0), ("json", 0.5)]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"grader": {"type": "json"}, "graders": [{"type": "json"}]},
         "set task.grader (one) or task.graders"),
        ({"graders": []}, "task.graders is empty"),
        ({"graders": [{"type": "json"}, {"type": "json"}]}, "two graders named json"),
        ({"grader": {"type": "json"}, "format_reward": 0.1},
         "task.format_reward: the default grader's settings"),
        ({"grader": {"type": "nope"}}, "does not match any of the expected tags"),
        ({"grader": {"type": "json", "name": "Bad-Name"}}, "should match pattern"),
        ({"grader": {"type": "string_check", "operation": "like"}}, "operation"),
        ({"grader": {"type": "string_check", "input": "{{ os.environ }}"}},
         "{{ os.environ }} is not a placeholder"),
        ({"grader": {"type": "string_check", "reference": "{{item}}"}}, "{{item}} is not a placeholder"),
        ({"grader": {"type": "string_check", "operation": "regex", "reference": "(a"}},
         "not a regular expression"),
        ({"grader": {"type": "string_check", "operation": "regex", "reference": "a" * 513}}, "at most 512"),
        ({"grader": {"type": "python"}}, "set exactly one of source (the code) and file"),
        ({"grader": {"type": "python", "source": "x", "file": "g.py"}}, "set exactly one of source"),
        ({"grader": {"type": "python", "source": "def grade(s, i):\n  return (\n"}},
         "source: line"),
        ({"grader": {"type": "python", "source": "x" * (64 * 1024 + 1)}},
         "at most 65536 characters"),
        ({"grader": {"type": "python", "source": "x = 1", "timeout_s": 0}}, "timeout_s"),
        ({"grader": {"type": "code", "timeout_s": 121}}, "less than or equal to 120"),
        ({"grader": {"type": "code", "memory_mb": 32}}, "greater than or equal to 64"),
        ({"grader": {"type": "numeric", "tolerance": -1}}, "tolerance"),
        ({"grader": {"type": "json", "json_schema": {"enum": ["x" * 70_000]}}},
         "json_schema: at most 65536 bytes"),
        ({"grader": {"type": "multi", "graders": {}, "formula": "1"}}, "at least 1 item"),
        ({"grader": {"type": "multi", "graders": {"a": {"type": "json"}}, "formula": "b"}},
         "'b' is not a grader"),
        ({"grader": {"type": "multi", "graders": {"a": {"type": "json"}}, "formula": "a.x"}},
         "not allowed"),
        ({"grader": {"type": "multi", "graders": {"min": {"type": "json"}}, "formula": "1"}},
         "name functions"),
        ({"grader": {"type": "multi", "graders": {"a": {"type": "json", "name": "b"}}, "formula": "a"}},
         "key names"),
        ({"grader": {"type": "multi", "graders": {"a": {"type": "multi"}}, "formula": "a"}},
         "does not match any"),
        ({"grader": {"type": "http", "url": "file:///etc/passwd"}}, "should match pattern"),
        ({"grader": {"type": "http", "url": "https://j.example", "token_file": "t",
                     "token_secret": {"name": "s"}}}, "set token_file or token_secret, not both"),
        ({"grader": {"type": "http", "url": "https://j.example", "token_secret": {"name": "Bad_Name"}}},
         "should match pattern"),
        ({"grader": {"type": "http", "url": "https://j.example", "max_concurrency": 65}}, "max_concurrency"),
        ({"grader": {"type": "http", "url": "https://j.example", "token": "abc"}},
         "Extra inputs are not permitted"),
        ({"validation_dataset": "held.jsonl", "dataset": None, "reasoning_gym": "basic_arithmetic"},
         "task.validation_dataset needs task.dataset"),
    ],
)  # fmt: skip
def test_a_bad_grader_is_refused_naming_the_field(fields: dict[str, Any], message: str) -> None:
    assert message in refused(fields)


def test_too_many_graders_are_refused() -> None:
    graders = [{"type": "json", "name": f"g{i}"} for i in range(MAX_GRADERS + 1)]
    assert "at most 16 items" in refused({"graders": graders})
    subs = {f"g{i}": {"type": "json"} for i in range(MAX_GRADERS + 1)}
    assert "at most 16 items" in refused({"grader": {"type": "multi", "graders": subs, "formula": "g0"}})


# every float a grader has, with a grader that has it: JSON's NaN, Infinity and 1e309 are refused
GRADER_FLOATS = [
    ({"type": "json"}, "weight"),
    ({"type": "answer"}, "format_reward"),
    ({"type": "numeric"}, "tolerance"),
    ({"type": "python", "source": "x = 1"}, "timeout_s"),
    ({"type": "code"}, "timeout_s"),
    ({"type": "math"}, "timeout_s"),
    ({"type": "http", "url": "https://judge.example"}, "timeout_s"),
]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e309"])
@pytest.mark.parametrize(("grader", "field"), GRADER_FLOATS)
def test_a_grader_number_that_is_not_finite_is_refused(
    grader: dict[str, Any], field: str, literal: str
) -> None:
    text = json.dumps({"dataset": "rows.jsonl", "grader": grader})[:-2] + f', "{field}": {literal}}}}}'
    with pytest.raises(ValidationError) as err:
        TaskSpec.model_validate_json(text)
    assert field in str(err.value)


def test_max_grader_error_fraction_is_a_fraction() -> None:
    assert task(max_grader_error_fraction=0.0).max_grader_error_fraction == 0.0
    assert "max_grader_error_fraction" in refused({"max_grader_error_fraction": 1.5})


def test_a_stored_spec_with_graders_reads_back() -> None:
    spec = JobSpec.model_validate(
        {
            "task": {
                "dataset": "rows.jsonl",
                "graders": [
                    {"type": "json", "json_schema": {"type": "object"}},
                    {"type": "multi", "name": "m", "graders": {"a": {"type": "numeric"}}, "formula": "a"},
                ],
            }
        }
    )
    assert JobSpec.model_validate(json.loads(json.dumps(spec.model_dump(mode="json")))) == spec


def test_needs_sandbox_names_user_code_graders_with_their_multi() -> None:
    graders = task(
        graders=[
            {"type": "python", "name": "p", "source": "x = 1"},
            {"type": "json"},
            {
                "type": "multi",
                "name": "m",
                "graders": {"c": {"type": "code"}, "s": {"type": "json"}},
                "formula": "c",
            },
        ]
    ).grader_list()
    assert needs_sandbox(graders) == ["p", "m.c"]


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("{{item.answer}}", True),
        ("a {{ item.meta.tags.0 }} b", True),
        ("{{sample.output_text}}", True),
        ("{{sample.output_json.n.1}}", True),
        ("{{sample.output_json}}", True),
        ("{{item}}", False),
        ("{{sample.text}}", False),
        (
            "{{item.__class__.__mro__}}",
            True,
        ),  # a key like any other: looked up in the row, never an attribute
        ("{{ item['x'] }}", False),
        ("{{ 7*7 }}", False),
        ("plain {single} braces", True),
    ],
)
def test_template_placeholders(text: str, ok: bool) -> None:
    assert (template_problems(text) == []) == ok


# -- formulas, by hand -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "scores", "value"),
    [
        ("0.7 * correct + 0.3 * min(fmt, 1)", {"correct": 1.0, "fmt": 0.5}, 0.85),  # 0.7 + 0.15
        ("(a + b) / 2", {"a": 1.0, "b": 0.0}, 0.5),
        ("a / b", {"a": 1.0, "b": 0.0}, 0.0),  # a division by 0 is 0
        ("-a + 1", {"a": 0.25}, 0.75),
        ("max(a, b, 0.1)", {"a": 0.0, "b": 0.05}, 0.1),
        ("abs(a - b)", {"a": 0.2, "b": 0.5}, 0.3),
        ("clip(a * 3, 0, 1)", {"a": 0.5}, 1.0),
        ("a >= 0.5", {"a": 0.5}, 1.0),
        ("0 < a < 1", {"a": 1.0}, 0.0),  # chained: 0 < 1 holds, 1 < 1 does not
        ("a if b > 0 else 0.25", {"a": 0.9, "b": 0.0}, 0.25),
    ],
)
def test_formula_values_worked_by_hand(text: str, scores: dict[str, float], value: float) -> None:
    tree = formula.parse(text, set(scores))
    assert formula.evaluate(tree, scores) == pytest.approx(value)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "a.__class__",
        "a[0]",
        "a ** 2",
        "'x'",
        "lambda: 1",
        "[a for a in b]",
        "open('f')",
        "min",
        "min(a, key=b)",
        "abs(a, b)",
        "True",
        "a; b",
        "a and b",
    ],
)
def test_formula_refuses_everything_else(text: str) -> None:
    with pytest.raises(formula.FormulaError):
        formula.parse(text, {"a", "b"})


def test_formula_bounds() -> None:
    with pytest.raises(formula.FormulaError, match="at most 1024"):
        formula.parse("a+" * 600 + "a", {"a"})


def test_every_grader_docs_job_spec_shows_is_a_valid_one() -> None:
    """docs/job-spec.md's "one of each kind" list: each entry is a grader the spec accepts, and
    every kind is there."""
    import yaml

    from rljob.graders import GraderKind

    text = (Path(__file__).resolve().parents[2] / "docs" / "job-spec.md").read_text()
    block = text[text.index("One of each kind") :]
    start = block.index("```yaml") + len("```yaml")
    graders = yaml.safe_load(block[start : block.index("```", start)])["graders"]
    union = typing.get_args(GraderKind)[0]  # Annotated[A | B | ..., discriminator]
    every = {typing.get_args(m.model_fields["type"].annotation)[0] for m in typing.get_args(union)}
    assert {g["type"] for g in graders} == every and len(every) == 10
    for i, grader in enumerate(graders):
        task(grader={"name": f"g{i}", **grader})
