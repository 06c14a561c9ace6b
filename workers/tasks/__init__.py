"""What a job teaches: its problems (reasoning-gym generators, or data files), its prompts, and the
graders that turn a response into a reward, with the sandbox that runs user code.

- ``task``: :class:`Task`, the problems, prompts, hold-out and grading of one job;
- ``data``: data files (JSONL, Parquet, a saved ``datasets`` directory) and chat rows;
- ``answers``: reading an answer out of a response;
- ``templates``: ``{{item.*}}`` / ``{{sample.*}}`` substitution;
- ``grading``: the graders at work on a batch; ``pool_requests`` what the sandboxed kinds send the
  pool, ``remote`` the http grader's requests, ``model_scorer`` a model grader's model,
  ``one_sample`` one row and response (``fp8rl grade``, the control plane's ``/v1/graders/run``);
- ``sandbox`` and ``child``: the pool of sandboxed processes that run python and code graders;
- ``humaneval``: HumanEval's problems as a data file.

The names below are loaded when first used: the control plane imports ``grading`` without the
tokenizers and models that ``task`` brings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.tasks.grading import Grade, GraderFailure, GraderReport
    from workers.tasks.task import Problem, Task, extract_answer, params_table

__all__ = ["Grade", "GraderFailure", "GraderReport", "Problem", "Task", "extract_answer", "params_table"]
_WHERE = {"Grade": "grading", "GraderFailure": "grading", "GraderReport": "grading"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'workers.tasks' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"workers.tasks.{_WHERE.get(name, 'task')}"), name)
