"""Every grader kind on hand-worked samples, the templates, the code grader's program, the multi
grader's formula, the weighted mean of several graders, and every way a grader fails (scored 0,
counted, logged once; past the error fraction the batch fails with the grader's own error).

The sandboxed kinds run in a real pool under bubblewrap (``make tools`` puts it in .tools/bin).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rljob.spec import TaskSpec
from tests.helm.tools import tool
from workers.tasks.answers import same_answer
from workers.tasks.grading import GraderFailure, Graders
from workers.tasks.pool_requests import code_program
from workers.tasks.sandbox import Launcher
from workers.tasks.templates import Sample, render


@dataclass(frozen=True)
class Row:
    entry: dict[str, Any]
    answer: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def launcher() -> Launcher:
    return Launcher.choose("bwrap", str(tool("bwrap")))


@pytest.fixture
def make(launcher: Launcher) -> Iterator[Any]:
    made: list[Graders] = []

    def build(graders: list[dict[str, Any]], **kw: Any) -> Graders:
        spec = TaskSpec.model_validate({"dataset": "rows.jsonl", "graders": graders})
        g = Graders(
            spec.grader_list(),
            lambda answer, row: float(same_answer(answer, row.answer)),
            pool_size=2,
            launcher=launcher,
            **kw,
        )
        made.append(g)
        return g

    yield build
    for g in made:
        g.close()


def scores(g: Graders, texts: list[str], rows: list[Row]) -> list[float]:
    grades, _ = g.grade(texts, rows)
    return [x.reward for x in grades]


# -- templates ---------------------------------------------------------------------------------------
def test_templates_substitute_text_by_hand() -> None:
    item = {"answer": 7, "meta": {"tags": ["x", "y"]}, "ok": True, "none": None, "obj": {"a": 1}}
    sample = Sample('{"n": 7, "list": [1, 2]}')
    assert render("{{item.answer}}", item, sample) == "7"
    assert render("[{{ item.meta.tags.1 }}]", item, sample) == "[y]"
    assert render("{{item.ok}} {{item.none}}|{{item.nope}}|", item, sample) == "true ||"
    assert render("{{item.obj}}", item, sample) == '{"a":1}'
    assert render("{{sample.output_json.n}} {{sample.output_json.list.0}}", item, sample) == "7 1"
    assert render("{{sample.output_text}}", item, sample) == '{"n": 7, "list": [1, 2]}'
    assert render("{{item.meta.tags.5}}", item, sample) == ""  # past the end of a list
    # a fenced block is JSON too; text that holds none gives an empty placeholder
    assert Sample('Here:\n```json\n{"a": [3]}\n```\nbye').output_json == {"a": [3]}
    assert render("{{sample.output_json.a}}", item, Sample("not json")) == ""


def test_code_program_by_hand() -> None:
    prompt = "def add(a, b):\n"
    assert code_program(prompt, "    return a + b\n") == "def add(a, b):\n    return a + b\n"
    fenced = "Sure:\n```python\ndef add(a, b):\n    return b + a\n```\nDone."
    assert code_program(prompt, fenced) == "def add(a, b):\n\ndef add(a, b):\n    return b + a\n"


# -- each kind ---------------------------------------------------------------------------------------
def test_answer_grader_is_the_old_reward(make: Any) -> None:
    # reward = correctness + format_reward x readable; 71 read from "23 + 48 = 71." (last number)
    g = make([{"type": "answer", "format_reward": 0.25}])
    rows = [Row({"answer": "71"}, "71")] * 3
    grades, _ = g.grade(["23 + 48 = 71.", "I think 70", "no idea"], rows)
    assert [(x.reward, x.correct, x.readable) for x in grades] == [
        (1.25, True, True),
        (0.25, False, True),
        (0.0, False, False),
    ]


PHONE = r"^\d{3}-\d{4}$"
NAMED = {"type": "object", "required": ["name"]}
LENGTH = "def grade(sample, item):\n    return len(sample['output_text']) / 10\n"
SAME_N = "def grade(sample, item):\n    return sample['output_json']['n'] == item['n']\n"


@pytest.mark.parametrize(
    ("grader", "text", "item", "score"),
    [
        ({"type": "string_check"}, " Paris ", {"answer": "Paris"}, 1.0),  # eq: stripped
        ({"type": "string_check"}, "paris", {"answer": "Paris"}, 0.0),
        ({"type": "string_check", "ignore_case": True}, "paris", {"answer": "Paris"}, 1.0),
        ({"type": "string_check", "operation": "ne"}, "Rome", {"answer": "Paris"}, 1.0),
        ({"type": "string_check", "operation": "contains"}, "It is Paris.", {"answer": "Paris"}, 1.0),
        ({"type": "string_check", "operation": "contains"}, "It is Rome.", {"answer": "Paris"}, 0.0),
        ({"type": "string_check", "operation": "regex", "reference": PHONE}, "555-1234", {}, 1.0),
        ({"type": "string_check", "operation": "regex", "reference": PHONE}, "5551234", {}, 0.0),
        ({"type": "string_check", "operation": "regex", "reference": "{{item.pat}}"},
         "abc", {"pat": "B"}, 0.0),
        ({"type": "string_check", "operation": "regex", "reference": "{{item.pat}}", "ignore_case": True},
         "abc", {"pat": "B"}, 1.0),
        ({"type": "numeric"}, "so 3.50", {"answer": 3.5}, 1.0),
        ({"type": "numeric"}, "3.51", {"answer": 3.5}, 0.0),
        ({"type": "numeric", "tolerance": 0.02}, "3.51", {"answer": 3.5}, 1.0),  # |3.51 - 3.5| = 0.01
        ({"type": "numeric", "tolerance": 0.01, "relative": True}, "101.5", {"answer": 100}, 0.0),  # 1.5 > 1
        # 1.5 <= 2
        ({"type": "numeric", "tolerance": 0.02, "relative": True}, "-101.5", {"answer": -100}, 1.0),
        ({"type": "numeric"}, "no number", {"answer": 1}, 0.0),
        ({"type": "math"}, "The answer is $\\frac{1}{2}$", {"answer": "0.5"}, 1.0),
        ({"type": "math"}, "so \\boxed{2\\sqrt{2}}", {"answer": "\\sqrt{8}"}, 1.0),
        ({"type": "math"}, "so \\boxed{3}", {"answer": "\\sqrt{8}"}, 0.0),
        ({"type": "json"}, '{"a": 1}', {}, 1.0),
        ({"type": "json"}, "```json\n[1, 2]\n```", {}, 1.0),
        ({"type": "json"}, "{a: 1}", {}, 0.0),
        ({"type": "json", "json_schema": NAMED}, '{"name": "x"}', {}, 1.0),
        ({"type": "json", "json_schema": NAMED}, '{"nom": "x"}', {}, 0.0),
        ({"type": "json", "json_schema": {"type": "object"}}, "not json", {}, 0.0),
        ({"type": "python", "source": LENGTH},
         "abcd", {}, 0.4),
        ({"type": "python", "source": SAME_N},
         '{"n": 3}', {"n": 3}, 1.0),
        ({"type": "python", "source": "def grade(sample, item):\n    return 7\n"}, "x", {}, 1.0),  # clipped
        ({"type": "python", "source": "def grade(sample, item):\n    return -2\n"}, "x", {}, 0.0),
    ],
)  # fmt: skip
def test_each_kind_scores_by_hand(
    make: Any, grader: dict[str, Any], text: str, item: dict[str, Any], score: float
) -> None:
    g = make([grader])
    assert scores(g, [text], [Row(item, str(item.get("answer", "")))]) == [pytest.approx(score)]


HUMANEVAL_LIKE = {
    "prompt": 'def add(a, b):\n    """Sum of a and b."""\n',
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n"
    "    assert candidate(0, 5) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}


@pytest.mark.parametrize(
    ("completion", "score_kind", "score"),
    [
        ("    return a + b\n", "pass", 1.0),
        ("    return a * b\n", "pass", 0.0),
        # a * b: 1*2=2 (no), 2*2=4 (yes), 0*5=0 (no), -1*1=-1 (no): 1 of 4
        ("    return a * b\n", "fraction", 0.25),
        # max(a, b) + min(a, b) - ... : a + b by another road, in a fenced block
        ("```python\ndef add(a, b):\n    return max(a, b) + min(a, b)\n```", "pass", 1.0),
        ("    return undefined_name\n", "fraction", 0.0),
        # the program's own process ends, loops, or sleeps past its time: it fails (0), and
        # the grader has not failed (no error, no timeout counted)
        ("    import os; os._exit(3)\n", "pass", 0.0),
        ("    while True: pass\n", "pass", 0.0),
        ("    import time; time.sleep(60)\n", "fraction", 0.0),
    ],
)
def test_code_grader_runs_the_rows_tests(make: Any, completion: str, score_kind: str, score: float) -> None:
    g = make([{"type": "code", "score": score_kind, "timeout_s": 2}])
    grades, reports = g.grade([completion], [Row(HUMANEVAL_LIKE)])
    assert [x.reward for x in grades] == [score]
    assert (reports["code"].errors, reports["code"].timeouts) == (0, 0)


def test_multi_grader_applies_its_formula_by_hand(make: Any) -> None:
    g = make(
        [
            {
                "type": "multi",
                "name": "mix",
                "graders": {
                    "valid": {"type": "json"},
                    "right": {"type": "numeric", "input": "{{sample.output_json.n}}"},
                },
                "formula": "0.25 * valid + 0.75 * right",
            }
        ]
    )
    rows = [Row({"answer": 4})] * 3
    grades, reports = g.grade(['{"n": 4}', '{"n": 5}', "four"], rows)
    # 0.25 + 0.75 = 1; 0.25 + 0; 0 + 0 (no JSON, and no number in an empty placeholder)
    assert [x.reward for x in grades] == [1.0, 0.25, 0.0]
    assert [x.correct for x in grades] == [True, False, False]
    assert reports["mix.valid"].scores == [1.0, 1.0, 0.0]
    assert reports["mix.right"].scores == [1.0, 0.0, 0.0]
    assert reports["mix"].mean == pytest.approx(1.25 / 3)


def test_several_graders_give_their_weighted_mean(make: Any) -> None:
    g = make([{"type": "answer", "name": "correct", "weight": 3}, {"type": "json", "name": "valid"}])
    grades, reports = g.grade(["it is 7", '{"x": 7}'], [Row({"answer": "7"}, "7")] * 2)
    # (3 x 1 + 1 x 0) / 4 = 0.75; (3 x 1 + 1 x 1) / 4 = 1 (both end in the number 7; only one is JSON)
    assert [x.reward for x in grades] == [0.75, 1.0]
    assert [x.correct for x in grades] == [False, True]
    assert reports["correct"].mean == 1.0 and reports["valid"].mean == 0.5


# -- failures ----------------------------------------------------------------------------------------
def test_a_failing_grader_scores_0_counts_and_logs_once(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    source = (
        "import time\n"
        "def grade(sample, item):\n"
        "    t = sample['output_text']\n"
        "    if t == 'raise':\n"
        "        raise KeyError('no such field')\n"
        "    if t == 'slow':\n"
        "        time.sleep(30)\n"
        "    if t == 'nan':\n"
        "        return float('nan')\n"
        "    if t == 'text':\n"
        "        return 'high'\n"
        "    if t == 'exit':\n"
        "        raise SystemExit(0)\n"
        "    return 1.0\n"
    )
    g = make([{"type": "python", "source": source, "timeout_s": 1}], max_error_fraction=1.0)
    texts = ["ok", "raise", "raise", "slow", "nan", "text", "exit", "ok"]
    with caplog.at_level(logging.WARNING):
        grades, reports = g.grade(texts, [Row({})] * len(texts))
    assert [x.reward for x in grades] == [1.0, 0, 0, 0, 0, 0, 0, 1.0]
    report = reports["python"]
    assert (report.errors, report.timeouts) == (5, 1)
    assert report.first_error == "line 5: KeyError: 'no such field'"
    logged = [r.getMessage() for r in caplog.records if "grader python" in r.getMessage()]
    assert len(logged) == 2  # one error line and one timeout line, not one per response
    # the timer in the process stopped the sleeper: the same processes grade on
    grades, _ = g.grade(["ok"], [Row({})])
    assert grades[0].reward == 1.0 and g.pool().restarts == 0


def test_past_the_error_fraction_the_batch_fails_with_the_graders_error(make: Any) -> None:
    g = make(
        [
            {
                "type": "python",
                "name": "strict",
                "source": "def grade(sample, item):\n    return item['score']\n",
            }
        ],
        max_error_fraction=0.5,
    )
    rows = [Row({"score": 1}), Row({}), Row({})]  # 2 of 3 fail: more than half
    with pytest.raises(GraderFailure, match=r"grader strict failed on 2 of 3 .* line 2: KeyError: 'score'"):
        g.grade(["a", "b", "c"], rows)
    # 1 of 3 is within the fraction
    grades, reports = g.grade(["a", "b", "c"], [Row({"score": 1}), Row({"score": 0.5}), Row({})])
    assert [x.reward for x in grades] == [1.0, 0.5, 0.0] and reports["strict"].errors == 1


def test_a_grader_that_does_not_load_is_named(make: Any) -> None:
    g = make([{"type": "python", "name": "p", "source": "import no_such_module\n"}])
    assert g.check() == ["p: line 1: ModuleNotFoundError: No module named 'no_such_module'"]
    g = make([{"type": "python", "name": "q", "source": "x = 1\n"}])
    assert g.check() == ["q: NameError: the source defines no function grade(sample, item)"]
    g = make([{"type": "json", "name": "j", "json_schema": {"type": "no-such-type"}}])
    [problem] = g.check()
    assert problem.startswith("j: json_schema is not a JSON Schema:")


def test_a_python_grader_file_is_read_from_the_jobs_directory(launcher: Launcher, tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text(
        "def grade(sample, item):\n    return sample['output_text'].count('!') / 4\n"
    )
    spec = TaskSpec.model_validate({"dataset": "rows.jsonl", "grader": {"type": "python", "file": "mine.py"}})
    g = Graders(spec.grader_list(), lambda a, r: 0.0, pool_size=1, launcher=launcher, base=tmp_path)
    try:
        assert scores(g, ["hi!!"], [Row({})]) == [0.5]
    finally:
        g.close()
    spec = TaskSpec.model_validate({"dataset": "rows.jsonl", "grader": {"type": "python", "file": "gone.py"}})
    with pytest.raises(ValueError, match=r"a python grader's file 'gone\.py' cannot be read"):
        Graders(spec.grader_list(), lambda a, r: 0.0, base=tmp_path)
