"""What a grader that runs in the sandbox pool (``python``, ``code``, ``math``, a regex, a JSON
Schema) sends it for one sample (:mod:`workers.tasks.child` answers), and the program a ``code``
grader runs."""

from __future__ import annotations

from typing import Any

from rljob.graders import CodeGrader, JsonGrader, MathGrader, PythonGrader, StringCheckGrader
from workers.tasks.templates import Sample, parses_as_json, render

_FENCE_START = "```"


def code_program(prompt: str, completion: str) -> str:
    """The program a ``code`` grader runs: the completion's first fenced block (a whole program;
    after the prompt, so the prompt's imports hold and the block's definition wins), else the prompt
    continued by the completion (HumanEval's convention)."""
    start = completion.find(_FENCE_START)
    if start >= 0:
        body_start = completion.find("\n", start)
        end = completion.find(_FENCE_START, body_start + 1) if body_start >= 0 else -1
        if body_start >= 0:
            block = completion[body_start + 1 : end if end >= 0 else len(completion)]
            return f"{prompt}\n{block}"
    return prompt + completion


def pool_request(
    g: Any, sample: Sample, item: dict[str, Any], timeout: float
) -> tuple[dict[str, Any], float] | None:
    """The request for ``g`` on one sample, with its wall-clock limit; None when the answer is
    known without the pool (a json grader's text that does not parse: 0)."""
    if isinstance(g, PythonGrader):
        return {
            "op": "grade",
            "key": str(id(g)),
            "sample": sample.as_dict(),
            "item": item,
            "cpu_s": timeout,
        }, timeout
    if isinstance(g, MathGrader):
        request: dict[str, Any] = {
            "op": "math",
            "input": render(g.input, item, sample),
            "reference": render(g.reference, item, sample),
        }
        return {**request, "cpu_s": timeout}, timeout
    if isinstance(g, CodeGrader):
        program = code_program(render(g.prompt, item, sample), render(g.input, item, sample))
        request = {
            "op": "code",
            "program": program,
            "test": render(g.test, item, sample),
            "entry_point": render(g.entry_point, item, sample),
            "score": g.score,
            "cpu_s": timeout,
        }
        return request, timeout
    if isinstance(g, StringCheckGrader):  # regex
        pattern, text = render(g.reference, item, sample), render(g.input, item, sample)
        regex = {"op": "regex", "pattern": pattern, "text": text, "ignore_case": g.ignore_case}
        return {**regex, "cpu_s": timeout}, timeout
    if isinstance(g, JsonGrader):  # with a schema
        ok, value = parses_as_json(render(g.input, item, sample))
        if not ok:
            return None
        return {"op": "schema", "schema": g.json_schema, "value": value, "cpu_s": timeout}, timeout
    raise TypeError(f"grader type {g.type!r} does not run in the pool")
