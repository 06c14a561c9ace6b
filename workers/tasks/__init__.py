"""What a job teaches: its problems (reasoning-gym generators, or data files), its prompts, and the
graders that turn a response into a reward, with the sandbox that runs user code.

- ``task``: :class:`Task`, the problems, prompts, hold-out and grading of one job;
- ``data``: data files (JSONL, Parquet, a saved ``datasets`` directory) and chat rows;
- ``answers``: reading an answer out of a response;
- ``templates``: ``{{item.*}}`` / ``{{sample.*}}`` substitution;
- ``grading``: the graders at work on a batch;
- ``sandbox`` and ``child``: the pool of sandboxed processes that run python and code graders.
"""

from workers.tasks.grading import Grade, GraderFailure, GraderReport
from workers.tasks.task import Problem, Task, extract_answer, params_table

__all__ = ["Grade", "GraderFailure", "GraderReport", "Problem", "Task", "extract_answer", "params_table"]
