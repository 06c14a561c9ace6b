"""Graders, as plain data in the job spec (``task.grader`` or ``task.graders``): what turns a sample
(the model's response) and its data row (the *item*) into a reward.

A grader is a ``type`` and its fields; the kinds (docs/job-spec.md, Graders, has an example of each):

- ``answer``: the answer read out of the response in ``answer_format`` and compared with the
  reference (a reasoning-gym generator's own scorer, or equal text/number); ``format_reward`` for a
  readable answer. The default: a task with no grader gets ``answer`` from ``task.answer_format`` and
  ``task.format_reward``, and scores exactly as before graders existed.
- ``string_check``: ``input`` against ``reference`` by ``eq``, ``ne``, ``contains`` or ``regex``
  (``ignore_case``): 1 or 0.
- ``numeric``: the last number of ``input`` within ``tolerance`` of the reference (absolute, or
  relative to the reference with ``relative``): 1 or 0.
- ``math``: math-verify's equivalence of the LaTeX or plain answer in ``input`` with the reference.
- ``json``: ``input`` parses as JSON (the whole text, or a fenced ```json block), and matches
  ``json_schema`` if one is given: 1 or 0.
- ``python``: the tenant's ``grade(sample, item) -> float`` (inline ``source`` or a ``file``), run in
  the job's grader sandbox, never in the control plane or the operator.
- ``code``: the response run against the row's tests (HumanEval's ``prompt``, ``test`` and
  ``entry_point``), in the sandbox: 1 if ``check`` passes (``score: pass``) or the fraction of its
  asserts that hold (``score: fraction``).
- ``model``: a reward model or a judge (a causal LM with a prompt and a score read from its
  answer), on an actor of its own, batched;
- ``http``: a remote grader, ``POST``-ed the row and the sample, with a timeout, retries, bounded
  concurrency and a bearer token read from a file or a Kubernetes Secret (never the spec);
- ``multi``: named sub-graders and a ``formula`` over their scores (:mod:`rljob.formula`).

Templates (``input``, ``reference``, the code fields) read the row and the sample:
``{{item.<field>[.<field>|.<index>]...}}``, ``{{sample.output_text}}`` and
``{{sample.output_json[.<key>...]}}`` (the response parsed as JSON). A template is substituted as
text, never evaluated. Every score is clipped to [0, 1] (``answer``: [0, 1 + format_reward]); a
grader that fails (crashes, times out, returns no number) scores 0 and is counted.
"""

from __future__ import annotations

import ast
import re
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from rljob.formula import FormulaError, parse
from rljob.spec_base import StrictModel

AnswerFormat = Literal["auto", "last-number", "first-line", "answer-tag", "boxed"]
MAX_GRADERS = 16  # in task.graders, and in one multi grader
MAX_TEMPLATE_CHARS = 4096
MAX_SOURCE_BYTES = 64 * 1024  # a python grader's inline source
MAX_SCHEMA_BYTES = 64 * 1024
MAX_REGEX_CHARS = 512
RESERVED_NAMES = ("min", "max", "abs", "clip")  # the formula's functions

GraderName = Annotated[
    str,
    Field(
        pattern=r"^[a-z][a-z0-9_]{0,31}$",
        description="A name for metrics and formulas: lowercase letters, digits and _, at most 32.",
    ),
]

_PLACEHOLDER = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_PATH = r"(?:\.(?:[A-Za-z_][A-Za-z0-9_-]*|\d+))*"
_ALLOWED = re.compile(rf"^\s*(?:item{_PATH}|sample\.output_text|sample\.output_json{_PATH})\s*$")


def template_problems(text: str) -> list[str]:
    """What is wrong with the placeholders of a template (empty: nothing)."""
    out = []
    for found in _PLACEHOLDER.finditer(text):
        inner = found.group(1)
        if not _ALLOWED.match(inner) or re.match(r"^\s*item\s*$", inner):
            out.append(
                f"{{{{{inner}}}}} is not a placeholder: use {{{{item.<field>}}}} (a field of the data row; "
                "nested: {{item.a.b}}, {{item.list.0}}), {{sample.output_text}} or "
                "{{sample.output_json.<key>}}"
            )
    return out


Template = Annotated[str, Field(max_length=MAX_TEMPLATE_CHARS)]


class _Grader(StrictModel):
    name: GraderName | None = Field(
        None,
        description="Its name in metrics (reward/<name>/mean) and formulas; default: its type. In a "
        "multi grader the key names it.",
    )
    weight: float = Field(
        1.0, gt=0.0, le=1000.0, description="Its weight in task.graders' weighted mean reward."
    )

    @model_validator(mode="after")
    def _templates(self) -> _Grader:
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name in _TEMPLATE_FIELDS and isinstance(value, str):
                problems = template_problems(value)
                if problems:
                    raise ValueError(f"{name}: {'; '.join(problems)}")
        return self


_TEMPLATE_FIELDS = ("input", "reference", "prompt", "test", "entry_point")  # a judge's prompt too


class AnswerGrader(_Grader):
    """The answer read out of the response, compared with the reference (the module docstring)."""

    type: Literal["answer"] = "answer"
    answer_format: AnswerFormat = Field(
        "auto", description="How the answer is read (task.answer_format's values and meaning)."
    )
    format_reward: float = Field(
        0.0, ge=0.0, le=1.0, description="Added for a response whose answer could be read."
    )
    reference: Template = Field(
        "{{item.answer}}",
        description="The reference answer; for a reasoning-gym task the generator scores against its "
        "own entry and this is not read.",
    )


class StringCheckGrader(_Grader):
    """1 when ``input`` and ``reference`` pass ``operation``, else 0."""

    type: Literal["string_check"]
    input: Template = Field("{{sample.output_text}}", description="The text checked (a template).")
    reference: Template = Field("{{item.answer}}", description="What it is checked against (a template).")
    operation: Literal["eq", "ne", "contains", "regex"] = Field(
        "eq",
        description="eq / ne: equal or not after stripping both; contains: reference is in input; "
        "regex: reference (after substitution) is a regular expression found in input.",
    )
    ignore_case: bool = Field(False, description="Compare without regard to case.")

    @model_validator(mode="after")
    def _regex(self) -> StringCheckGrader:
        if self.operation == "regex" and "{{" not in self.reference:
            if len(self.reference) > MAX_REGEX_CHARS:
                raise ValueError(f"reference: a regex of at most {MAX_REGEX_CHARS} characters")
            try:
                re.compile(self.reference)
            except re.error as err:
                raise ValueError(f"reference: not a regular expression: {err}") from None
        return self


class NumericGrader(_Grader):
    """1 when the last number in ``input`` is within ``tolerance`` of the reference, else 0."""

    type: Literal["numeric"]
    input: Template = Field("{{sample.output_text}}", description="Text whose last number is read.")
    reference: Template = Field("{{item.answer}}", description="The reference number (a template).")
    tolerance: float = Field(0.0, ge=0.0, le=1e12, description="Largest accepted difference.")
    relative: bool = Field(False, description="tolerance is relative to |reference| (0.01: 1%).")


class MathGrader(_Grader):
    """math-verify's equivalence of the answer in ``input`` with ``reference``: 1 or 0."""

    type: Literal["math"]
    input: Template = Field(
        "{{sample.output_text}}",
        description="The response; math-verify reads its last \\boxed{}, $...$ or plain expression.",
    )
    reference: Template = Field("{{item.answer}}", description="The reference answer, LaTeX or plain.")
    timeout_s: float = Field(
        5.0, gt=0.0, le=120.0, description="Seconds one sample may take (sympy can be slow); past it, 0."
    )


class JsonGrader(_Grader):
    """1 when ``input`` is JSON (matching ``schema`` if given), else 0."""

    type: Literal["json"]
    input: Template = Field(
        "{{sample.output_text}}",
        description="The text parsed: all of it, or the first fenced ```json block in it.",
    )
    json_schema: dict[str, Any] | None = Field(
        None, description="A JSON Schema (draft 2020-12) the parsed value must match."
    )

    @model_validator(mode="after")
    def _schema_size(self) -> JsonGrader:
        import json

        if self.json_schema is not None and len(json.dumps(self.json_schema)) > MAX_SCHEMA_BYTES:
            raise ValueError(f"json_schema: at most {MAX_SCHEMA_BYTES} bytes of JSON")
        return self


class _Sandboxed(_Grader):
    timeout_s: float = Field(
        5.0, gt=0.0, le=120.0, description="Wall-clock seconds one sample may take; past it, 0 and a timeout."
    )
    memory_mb: int = Field(512, ge=64, le=16384, description="Address space of the grading process, MiB.")


class PythonGrader(_Sandboxed):
    """The tenant's ``grade(sample, item) -> float``, run in the grader sandbox."""

    type: Literal["python"]
    source: str | None = Field(
        None,
        max_length=MAX_SOURCE_BYTES,
        description="Python source defining grade(sample, item) -> float (sample: {output_text, "
        "output_json}; item: the data row). Set this or file.",
    )
    file: str | None = Field(
        None, max_length=4096, description="A .py file defining grade(), under the tenant's files."
    )

    @model_validator(mode="after")
    def _one_source(self) -> PythonGrader:
        if (self.source is None) == (self.file is None):
            raise ValueError("set exactly one of source (the code) and file (a .py path)")
        if self.source is not None:
            try:
                ast.parse(self.source)  # parsed, not run: it runs only in the job's sandbox
            except SyntaxError as err:
                raise ValueError(f"source: line {err.lineno}: {err.msg}") from None
        return self


class CodeGrader(_Sandboxed):
    """The response run against the row's tests (HumanEval's shape), in the grader sandbox."""

    type: Literal["code"]
    input: Template = Field(
        "{{sample.output_text}}",
        description="The completion: a fenced ```python block in it is the program's code, else the "
        "text continues the prompt.",
    )
    prompt: Template = Field("{{item.prompt}}", description="The code the completion continues.")
    test: Template = Field("{{item.test}}", description="Code defining check(candidate).")
    entry_point: Template = Field("{{item.entry_point}}", description="The function check() is given.")
    score: Literal["pass", "fraction"] = Field(
        "pass", description="pass: 1 when check() passes; fraction: the share of its asserts that hold."
    )


JUDGE_PROMPT = (
    "Rate how well the response answers the task, from 0 (wrong) to 10 (perfect).\n\n"
    "Task: {{item.question}}\n\nResponse: {{sample.output_text}}\n\nAnswer with the number only."
)


class ModelGrader(_Grader):
    """A model scores the response: a reward model (sequence classification) or a judge (a
    causal LM prompted to rate it), on an actor of its own, a batch at a time."""

    type: Literal["model"]
    model: str = Field(
        ...,
        max_length=4096,
        description="A Hugging Face model directory (or hub id), under the tenant's files.",
    )
    kind: Literal["reward_model", "judge"] = Field(
        "reward_model",
        description="reward_model: the score is sigmoid(logit) of a one-label model (a two-label one: "
        "the second label's probability) on `input`; judge: the model answers `prompt` greedily and "
        "the first number of its answer, mapped from [score_min, score_max] to [0, 1], is the score.",
    )
    input: Template = Field("{{sample.output_text}}", description="What a reward model scores.")
    prompt: Template = Field(JUDGE_PROMPT, description="What a judge is asked (through its chat template).")
    score_min: float = Field(0.0, ge=-1e6, le=1e6, description="A judge's lowest rating.")
    score_max: float = Field(10.0, ge=-1e6, le=1e6, description="A judge's highest rating.")
    max_new_tokens: int = Field(8, ge=1, le=256, description="Tokens a judge may answer with.")
    batch_size: int = Field(16, ge=1, le=1024, description="Samples per forward pass.")
    gpus: int = Field(0, ge=0, le=1, description="GPUs of the grader's actor (0: CPU).")

    @model_validator(mode="after")
    def _range(self) -> ModelGrader:
        if self.score_max <= self.score_min:
            raise ValueError("score_max must be above score_min")
        return self


GRADER_SECRETS_DIR = "/var/run/fp8rl/grader-secrets"  # where the operator mounts token_secret


class SecretRef(StrictModel):
    """A key of a Kubernetes Secret in the job's namespace."""

    name: str = Field(
        ..., pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", description="The Secret's name."
    )
    key: str = Field("token", pattern=r"^[-._a-zA-Z0-9]{1,253}$", description="Its key holding the token.")

    def path(self) -> str:
        """Where the operator mounts it in the job's head pod."""
        return f"{GRADER_SECRETS_DIR}/{self.name}/{self.key}"


class HttpGrader(_Grader):
    """A remote grader: ``POST {"item": row, "sample": {"output_text", "output_json"}}`` to ``url``;
    the answer is ``{"score": x}`` (or a bare number)."""

    type: Literal["http"]
    url: str = Field(
        ...,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description="The grader's endpoint (http or https).",
    )
    timeout_s: float = Field(10.0, gt=0.0, le=120.0, description="Seconds one request may take.")
    retries: int = Field(
        2, ge=0, le=10, description="Further tries after a connection error, a timeout or a 5xx/429 answer."
    )
    max_concurrency: int = Field(8, ge=1, le=64, description="Requests in flight at once, per job.")
    token_file: str | None = Field(
        None, max_length=4096, description="A file holding a bearer token, under the tenant's files."
    )
    token_secret: SecretRef | None = Field(
        None,
        description="On Kubernetes: a Secret in the job's namespace holding the bearer token (the "
        "operator mounts it in the job's head pod). Tokens never go in the spec.",
    )

    @model_validator(mode="after")
    def _one_token(self) -> HttpGrader:
        if self.token_file is not None and self.token_secret is not None:
            raise ValueError("set token_file or token_secret, not both")
        return self


# every kind but multi: what a multi grader's children may be
_LeafGrader = (
    AnswerGrader
    | StringCheckGrader
    | NumericGrader
    | MathGrader
    | JsonGrader
    | PythonGrader
    | CodeGrader
    | HttpGrader
    | ModelGrader
)
SubGrader = Annotated[_LeafGrader, Field(discriminator="type")]


class MultiGrader(_Grader):
    """Named sub-graders and a formula over their scores."""

    type: Literal["multi"]
    graders: dict[GraderName, SubGrader] = Field(
        ..., min_length=1, max_length=MAX_GRADERS, description="The sub-graders, by name."
    )
    formula: str = Field(
        ...,
        max_length=1024,
        description="Arithmetic over the sub-graders' names (+ - * /, comparisons, a if c else b, "
        "min, max, abs, clip), e.g. 0.8 * correct + 0.2 * fmt; clipped to [0, 1].",
    )

    @model_validator(mode="after")
    def _formula(self) -> MultiGrader:
        named = [f"{key} (name: {g.name})" for key, g in self.graders.items() if g.name not in (None, key)]
        if named:
            raise ValueError(f"graders: the key names a sub-grader; drop its name or match it: {named}")
        reserved = sorted(set(self.graders) & set(RESERVED_NAMES))
        if reserved:
            raise ValueError(f"graders: {', '.join(reserved)} name functions of the formula; rename them")
        try:
            parse(self.formula, set(self.graders))
        except FormulaError as err:
            raise ValueError(f"formula: {err}") from None
        return self


GraderKind = Annotated[_LeafGrader | MultiGrader, Field(discriminator="type")]


SANDBOXED_TYPES = ("python", "code")


def walk(grader: Any) -> list[tuple[str, Any]]:
    """Every grader inside ``grader`` (itself first), as (type, grader), multi graders' children too."""
    out = [(grader.type, grader)]
    if isinstance(grader, MultiGrader):
        for child in grader.graders.values():
            out += walk(child)
    return out


def grader_name(grader: Any) -> str:
    """The name a grader is known by: its ``name``, or its type."""
    return str(grader.name or grader.type)


def needs_sandbox(graders: list[Any]) -> list[str]:
    """The graders that run user code (``python``, ``code``), named as in metrics (a multi's
    children as ``<multi>.<child>``)."""
    out = []
    for g in graders:
        if isinstance(g, MultiGrader):
            out += [f"{grader_name(g)}.{n}" for n, c in g.graders.items() if c.type in SANDBOXED_TYPES]
        elif g.type in SANDBOXED_TYPES:
            out.append(grader_name(g))
    return out


def grader_secrets(graders: list[Any]) -> list[SecretRef]:
    """The Secrets the ``http`` graders among ``graders`` read their tokens from (each once)."""
    out: list[SecretRef] = []
    for g in graders:
        for _, child in walk(g):
            if (
                isinstance(child, HttpGrader)
                and child.token_secret is not None
                and child.token_secret not in out
            ):
                out.append(child.token_secret)
    return out


def runs_in_pool(grader: Any) -> bool:
    """Whether ``grader`` (not a multi) runs in the grader sandbox's pool: tenants' code
    (``python``, ``code``), math-verify, and matching that can backtrack without end (a
    ``string_check`` regex, a ``json`` grader's schema)."""
    if isinstance(grader, PythonGrader | CodeGrader | MathGrader):
        return True
    if isinstance(grader, StringCheckGrader):
        return grader.operation == "regex"
    if isinstance(grader, JsonGrader):
        return grader.json_schema is not None
    return False
