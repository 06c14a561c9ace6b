"""A task's graders on one row and one response: ``fp8rl grade``, and the control plane's
``/v1/graders/run`` and ``/validate`` (:mod:`service.graders`), each with a sandbox pool of its own.

The control plane never grades in its own process: it runs ``python -m workers.tasks.one_sample``
once per call (:func:`main`), a JSON request on stdin and the answer on stdout:

- ``{"op": "probe"}`` -> ``{"sandboxed", "how"}``: whether the grader sandbox runs here;
- ``{"op": "run", "grader", "item", "output_text"}`` -> :func:`grade_one`'s answer;
- ``{"op": "check", "grader", "load_code"}`` -> ``{"problems": [...]}`` (:func:`check_one`).

``FP8RL_GRADER_SANDBOX`` and ``FP8RL_BWRAP`` in its environment choose the sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.tasks.answers import same_answer
from workers.tasks.grading import Graders
from workers.tasks.sandbox import Launcher


@dataclass(frozen=True)
class _OneRow:
    entry: dict[str, Any]
    answer: str


def _one(
    graders: list[Any], item: dict[str, Any], launcher: Launcher | None, base: Path | None
) -> tuple[Graders, _OneRow]:
    answer = item.get("answer")
    row = _OneRow(item, "" if answer is None else str(answer))
    built = Graders(
        graders,
        lambda text, r: float(same_answer(text, r.answer)),
        pool_size=1,
        launcher=launcher,
        max_error_fraction=1.0,
        base=base,
    )
    return built, row


def grade_one(
    graders: list[Any],
    item: dict[str, Any],
    output_text: str,
    launcher: Launcher | None,
    base: Path | None = None,
) -> dict[str, Any]:
    """``graders`` (a task's: the reward is their weighted mean) on one sample: ``{"reward",
    "graders": {name: {"score", "error", "timeout"}}}`` (a multi grader's children as
    ``<multi>.<child>``). ``launcher``: how a pool starts, for the kinds that need one (None: they
    are refused); the pool is this call's alone. An ``answer`` grader compares with the row's
    ``answer`` as a data file's rows are compared."""
    built, row = _one(graders, item, launcher, base)
    try:
        if launcher is None and built.sandboxed:
            raise ValueError("this grader runs in the grader sandbox, and none is available here")
        [graded], reports = built.grade([output_text], [row])
    finally:
        built.close()
    return {
        "reward": graded.reward,
        "graders": {
            name: {
                "score": r.scores[0] if r.scores else 0.0,
                "error": r.first_error,
                "timeout": r.timeouts > 0,
            }
            for name, r in reports.items()
        },
    }


def check_one(graders: list[Any], launcher: Launcher | None, base: Path | None = None) -> list[str]:
    """What :meth:`Graders.check` finds wrong with ``graders`` (python graders loaded in a pool of
    their own when ``launcher`` is given; without one only JSON Schemas are checked)."""
    built, _ = _one(graders, {}, launcher, base)
    try:
        return built.check(load_code=launcher is not None, read_tokens=False)
    finally:
        built.close()


def main() -> None:
    """The control plane's entry (module docstring)."""
    import json
    import sys

    from pydantic import TypeAdapter

    from rljob.graders import GraderKind

    request = json.loads(sys.stdin.read())
    op = request["op"]
    if op == "probe":
        chosen = Launcher.choose()
        answer: dict[str, Any] = {"sandboxed": chosen.sandboxed, "how": chosen.how}
    else:
        grader = TypeAdapter(GraderKind).validate_python(request["grader"])
        launcher = Launcher.choose() if request.get("sandbox", True) else None
        if op == "run":
            answer = grade_one([grader], request["item"], request["output_text"], launcher)
        else:
            answer = {"problems": check_one([grader], launcher if request.get("load_code") else None)}
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    main()
