"""HumanEval through the code grader: the rows ``fp8rl data humaneval`` writes, every one of the
164 canonical solutions passing its own tests (HumanEval's construction: each canonical solution is
the reference its tests were written against), and a solution with a bug failing them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8rl.cli import app
from rljob.spec import TaskSpec
from tests.helm.tools import tool
from workers.tasks.grading import Graders
from workers.tasks.sandbox import Launcher


class Row:
    def __init__(self, entry: dict[str, object]) -> None:
        self.entry, self.answer = entry, ""


@pytest.mark.slow  # 164 programs, each in the sandbox: 10.5 s on two busy workers
def test_every_canonical_solution_passes_and_a_bug_fails(tmp_path: Path) -> None:
    out = tmp_path / "he.jsonl"
    done = CliRunner().invoke(app, ["data", "humaneval", str(out)])
    assert done.exit_code == 0, done.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0"
    assert rows[0]["messages"][0]["content"].endswith(rows[0]["prompt"] + "```")
    spec = TaskSpec.model_validate({"dataset": str(out), "grader": {"type": "code", "timeout_s": 10}})
    graders = Graders(
        spec.grader_list(),
        lambda a, r: 0.0,
        pool_size=2,
        launcher=Launcher.choose("bwrap", str(tool("bwrap"))),
    )
    try:
        # as a model would answer in chat: the whole function in a fenced block
        fenced = [f"```python\n{r['prompt']}{r['canonical_solution']}```" for r in rows]
        grades, reports = graders.grade(fenced, [Row(r) for r in rows])
        failed = [r["task_id"] for r, g in zip(rows, grades, strict=True) if g.reward != 1.0]
        assert failed == [] and reports["code"].errors == reports["code"].timeouts == 0
        # HumanEval/0 (has_close_elements) with < turned into >: its first assert expects True
        buggy = rows[0]["canonical_solution"].replace("< threshold", "> threshold")
        assert buggy != rows[0]["canonical_solution"]
        grades, _ = graders.grade([buggy], [Row(rows[0])])  # the prompt continued (HumanEval's convention)
        assert grades[0].reward == 0.0
    finally:
        graders.close()
