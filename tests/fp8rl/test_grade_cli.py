"""``fp8rl grade``: a spec's graders on one row and one response, printed as a job scores them,
with the sandbox it used on stderr; bad input answered with exit 2 and what was wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp8rl.cli import app
from tests.helm.tools import tool

SPEC = """
task:
  dataset: rows.jsonl
  graders:
    - {type: answer, name: correct}
    - type: python
      name: short
      weight: 0.25
      source: |
        def grade(sample, item):
            return 1.0 if len(sample["output_text"]) <= 10 else 0.0
"""


@pytest.fixture
def spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FP8RL_GRADER_SANDBOX", "bwrap")
    monkeypatch.setenv("FP8RL_BWRAP", str(tool("bwrap")))
    path = tmp_path / "job.yaml"
    path.write_text(SPEC)
    return path


def test_grade_prints_each_graders_score(spec: Path, tmp_path: Path) -> None:
    (tmp_path / "row.json").write_text('{"answer": 71}')
    done = CliRunner().invoke(
        app, ["grade", str(spec), "--item", f"@{tmp_path / 'row.json'}", "--sample", "It is 71."]
    )
    assert done.exit_code == 0, done.output
    assert "graders' code runs in bubblewrap" in done.stderr
    result = json.loads(done.stdout)
    # correct: 71 read and equal (1); short: 9 characters (1); (1 x 1 + 0.25 x 1) / 1.25 = 1
    assert result["reward"] == 1.0
    assert result["graders"]["short"] == {"score": 1.0, "error": None, "timeout": False}
    done = CliRunner().invoke(
        app, ["grade", str(spec), "--item", '{"answer": 70}', "--sample", "It is 71, I think."]
    )
    # correct 0, short 0 (18 characters): 0
    assert json.loads(done.stdout)["reward"] == 0.0
    done = CliRunner().invoke(
        app, ["grade", str(spec), "--item", '{"answer": 71}', "--sample", "71 for sure, yes"]
    )
    # correct 1, short 0: 1 / 1.25 = 0.8
    assert json.loads(done.stdout)["reward"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("[1, 2]", "--item: a JSON object"),
        ("{bad", "--item/--sample:"),
        ("@/no/such/file", "--item/--sample:"),
    ],
)
def test_grade_refuses_a_bad_item(spec: Path, item: str, message: str) -> None:
    done = CliRunner().invoke(app, ["grade", str(spec), "--item", item, "--sample", "x"])
    assert done.exit_code == 2 and message in done.stderr
