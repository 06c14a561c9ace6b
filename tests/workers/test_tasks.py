"""Tasks: the held-out validation split never meets the training set, is deterministic, has the
size asked, leaves training as it was, and is scored by the same rule.

Worked by hand for the example's task (2-term single-digit addition, reasoning-gym
``basic_arithmetic``): its numbers are drawn from 0..10 (``randint(0, 10**digits)``), so the
generator knows exactly 11 x 11 = 121 questions, ``"Calculate a + b."``. Whatever the 40 training
items hold, the held-out problems are the rest of those 121 and no others.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rljob import parse_spec
from workers.tasks import Task

ADDITION = {
    "reasoning_gym": "basic_arithmetic",
    "params": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "size": 40,
    "seed": 0,
}
ALL_QUESTIONS = {f"Calculate {a} + {b}." for a in range(11) for b in range(11)}


def addition_task(size: int, interval: int = 10, **task: object) -> Task:
    spec = parse_spec({"task": {**ADDITION, **task}, "validation": {"interval": interval, "size": size}})
    return Task.for_job(spec)


def test_held_out_problems_are_new_distinct_and_as_many_as_asked() -> None:
    task = addition_task(32)
    held = task.validation_problems()
    training = {p.question for p in task._problems}
    assert len(held) == 32 and len({p.question for p in held}) == 32
    assert not training & {p.question for p in held}
    assert {p.question for p in held} <= ALL_QUESTIONS
    assert all(p.index >= 40 for p in held)  # items after the training set's 0..39
    # deterministic: a second build holds out the same problems, in the same order
    assert [(p.index, p.question) for p in addition_task(32).validation_problems()] == [
        (p.index, p.question) for p in held
    ]


def test_all_remaining_questions_can_be_held_out_and_one_more_is_refused() -> None:
    task = addition_task(1)
    available = len(ALL_QUESTIONS - {p.question for p in task._problems})
    every = addition_task(available).validation_problems()
    assert {p.question for p in every} == ALL_QUESTIONS - {p.question for p in task._problems}
    with pytest.raises(ValueError) as info:
        addition_task(available + 1)
    message = str(info.value)
    assert message.startswith(f"validation.size: {available + 1} held-out problems asked")
    assert f"only {available} distinct questions" in message and f"at most {available}" in message


def test_training_is_unchanged_by_validation() -> None:
    plain = Task(parse_spec({"task": ADDITION}).task)
    validated = addition_task(32)
    assert validated._problems == plain._problems
    for step in range(1, 6):
        assert validated.sample(step, 8, 0) == plain.sample(step, 8, 0)
    # validation off (interval 0): nothing is held out, whatever the size says
    assert addition_task(500, interval=0).validation_problems() == []


def test_held_out_problems_are_scored_by_the_tasks_rule() -> None:
    task = addition_task(16)
    for p in task.validation_problems():
        a, b = map(int, re.fullmatch(r"Calculate (\d+) \+ (\d+)\.", p.question).groups())  # type: ignore[union-attr]
        assert p.answer == str(a + b)
        assert task.score(f"{a + b}\n", p) == 1.0
        assert task.score(f"{a + b + 1}", p) == 0.0


def write_jsonl(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": q.upper()}) + "\n" for q in questions))
    return path


def dataset_task(path: Path, size: int, interval: int = 5) -> Task:
    spec = parse_spec({"task": {"dataset": str(path)}, "validation": {"interval": interval, "size": size}})
    return Task.for_job(spec)


def test_a_dataset_holds_out_its_last_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", ["a", "b", "c", "d", "e", "f"])
    task = dataset_task(path, 2)
    assert [p.question for p in task._problems] == ["a", "b", "c", "d"] and len(task) == 4
    assert [p.question for p in task.validation_problems()] == ["e", "f"]
    assert {p.question for step in range(20) for p in task.sample(step, 3, 0)} <= {"a", "b", "c", "d"}
    e = task.validation_problems()[0]
    assert task.score("E\n", e) == 1.0 and task.score("e", e) == 0.0  # exact match, as in training
    # validation off: every row trains
    assert len(dataset_task(path, 2, interval=0)) == 6


def test_a_training_row_that_repeats_a_held_out_question_is_dropped(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", ["a", "e", "b", "c", "e", "f"])
    task = dataset_task(path, 2)
    assert [p.question for p in task._problems] == ["a", "b", "c"]
    assert [p.question for p in task.validation_problems()] == ["e", "f"]


def test_a_dataset_too_small_to_hold_out_is_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", ["a", "b", "c"])
    with pytest.raises(
        ValueError, match=r"validation.size: 3 held-out rows leave no training rows.*at most 2"
    ):
        dataset_task(path, 3)
    dup = write_jsonl(tmp_path / "dup.jsonl", ["x", "x"])
    with pytest.raises(ValueError, match=r"validation.size: every training row .* repeats"):
        dataset_task(dup, 1)
