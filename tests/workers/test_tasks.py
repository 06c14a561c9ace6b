"""Tasks: answers are read from a response's first line and scored; a JSONL dataset is read
row by row and refused with the line that is wrong; sampling is a pure function of the step;
the held-out validation split never meets the training set, is deterministic, has the size
asked, leaves training as it was, and is scored by the same rule.

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
from workers.tasks import Problem, Task, extract_answer

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


def training(task: Task) -> list[Problem]:
    """Every training problem in order: a sample of all of them (without replacement) by index."""
    return sorted(task.sample(0, len(task), 0), key=lambda p: p.index)


def addition_task(size: int, interval: int = 10, **task: object) -> Task:
    spec = parse_spec({"task": {**ADDITION, **task}, "validation": {"interval": interval, "size": size}})
    return Task.for_job(spec)


def test_held_out_problems_are_new_distinct_and_as_many_as_asked() -> None:
    task = addition_task(32)
    held = task.validation_problems()
    trained = {p.question for p in training(task)}
    assert len(held) == 32 and len({p.question for p in held}) == 32
    assert not trained & {p.question for p in held}
    assert {p.question for p in held} <= ALL_QUESTIONS
    assert all(p.index >= 40 for p in held)  # items after the training set's 0..39
    # deterministic: a second build holds out the same problems, in the same order
    assert [(p.index, p.question) for p in addition_task(32).validation_problems()] == [
        (p.index, p.question) for p in held
    ]


def test_all_remaining_questions_can_be_held_out_and_one_more_is_refused() -> None:
    task = addition_task(1)
    available = len(ALL_QUESTIONS - {p.question for p in training(task)})
    every = addition_task(available).validation_problems()
    assert {p.question for p in every} == ALL_QUESTIONS - {p.question for p in training(task)}
    with pytest.raises(ValueError) as info:
        addition_task(available + 1)
    message = str(info.value)
    assert message.startswith(f"validation.size: {available + 1} held-out problems asked")
    assert f"only {available} distinct questions" in message and f"at most {available}" in message


def test_training_is_unchanged_by_validation() -> None:
    plain = Task(parse_spec({"task": ADDITION}).task)
    validated = addition_task(32)
    assert training(validated) == training(plain)
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
    assert [p.question for p in training(task)] == ["a", "b", "c", "d"] and len(task) == 4
    assert [p.question for p in task.validation_problems()] == ["e", "f"]
    assert {p.question for step in range(20) for p in task.sample(step, 3, 0)} <= {"a", "b", "c", "d"}
    e = task.validation_problems()[0]
    assert task.score("E\n", e) == 1.0 and task.score("e", e) == 0.0  # exact match, as in training
    # validation off: every row trains
    assert len(dataset_task(path, 2, interval=0)) == 6


def test_a_training_row_that_repeats_a_held_out_question_is_dropped(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", ["a", "e", "b", "c", "e", "f"])
    task = dataset_task(path, 2)
    assert [p.question for p in training(task)] == ["a", "b", "c"]
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


# --- answers and scores --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("7", "7"),
        ("  7  ", "7"),
        ("7\nbecause 3 + 4", "7"),  # the first line only
        ("\n\n 7 \n8", "7"),  # leading blank lines do not count as the first line
        ("7\r\n8", "7"),
        ("3 + 4 = 7", "3 + 4 = 7"),  # the whole line: no number is picked out of it
        ("", ""),
        (" \n ", ""),
    ],
)
def test_extract_answer_is_the_first_line_stripped(response: str, answer: str) -> None:
    assert extract_answer(response) == answer


def test_a_dataset_answer_scores_by_exact_match_of_the_first_line(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "2+2", "answer": " 4 "}) + "\n")
    task = dataset_task(path, 1, interval=0)
    [p] = training(task)
    assert p.answer == " 4 "  # kept as written; compared stripped
    assert [task.score(r, p) for r in ("4", " 4\n", "4\n5", "04", "4.0", "", "5\n4")] == [
        1.0,
        1.0,
        1.0,
        0.0,
        0.0,
        0.0,
        0.0,
    ]


def test_a_reasoning_gym_score_stays_in_0_1() -> None:
    """Its rule is the generator's (basic_arithmetic gives partial credit for some wrong forms);
    the task clamps whatever it gives to [0, 1]."""
    task = addition_task(1, interval=0)
    for p in training(task)[:5]:
        for response in (p.answer, f"-{p.answer}", f"{p.answer}.0", "x", ""):
            assert 0.0 <= task.score(response, p) <= 1.0
        assert task.score(p.answer, p) == 1.0 and task.score("x", p) == 0.0


# --- a JSONL dataset -----------------------------------------------------------------------------


def read_dataset(path: Path, text: str) -> Task:
    path.write_text(text)
    return dataset_task(path, 1, interval=0)


def test_a_dataset_is_read_row_by_row(tmp_path: Path) -> None:
    text = '{"question": "1+1", "answer": "2"}\n\n   \n{"question": "2+3", "answer": 5, "source": "x"}\n'
    task = read_dataset(tmp_path / "qa.jsonl", text)
    rows = training(task)
    # blank lines are skipped; a number answer reads as its decimal text; other keys are kept
    assert [(p.index, p.question, p.answer) for p in rows] == [(0, "1+1", "2"), (1, "2+3", "5")]
    assert rows[1].entry == {"question": "2+3", "answer": 5, "source": "x"}
    assert task.prompt(rows[0]) == "1+1\nAnswer: "  # the default template


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"question": "a", "answer": "b"}\n{not json\n', r"qa.jsonl:2: expected a JSON object"),
        # the line number counts blank lines: it is the line an editor shows
        ('{"question": "a", "answer": "b"}\n\n{"question": "c"}\n', r"qa.jsonl:3: .*\('answer'\)"),
        ('{"answer": "b"}\n', r"qa.jsonl:1: .*\('question'\)"),
        ('["a", "b"]\n', r"qa.jsonl:1: expected a JSON object with question and answer"),
        ('"a"\n', r"qa.jsonl:1: expected a JSON object with question and answer"),
        # str() would make these "None", "{'x': 1}" and "True": answers no model would give
        ('{"question": "a", "answer": null}\n', r"qa.jsonl:1: .*answer is null, not a string or a number"),
        ('{"question": "a", "answer": {"x": 1}}\n', r"qa.jsonl:1: .*answer is \{\"x\": 1\}, not a string"),
        ('{"question": "a", "answer": true}\n', r"qa.jsonl:1: .*answer is true, not a string"),
        ('{"question": ["a"], "answer": "b"}\n', r"qa.jsonl:1: .*question is \[\"a\"\], not a string"),
        ("", r"qa.jsonl has no problems"),
        ("\n  \n", r"qa.jsonl has no problems"),
    ],
)
def test_a_bad_dataset_is_refused_with_the_line(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ValueError, match=r"^task\.dataset: .*" + error):
        read_dataset(tmp_path / "qa.jsonl", text)


def test_a_missing_dataset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^task\.dataset: .*nope\.jsonl does not exist$"):
        dataset_task(tmp_path / "nope.jsonl", 1, interval=0)


def test_an_unknown_generator_or_bad_params_are_refused() -> None:
    unknown = r"^task\.reasoning_gym: unknown generator 'nope'; e\.g\. .*basic_arithmetic"
    with pytest.raises(ValueError, match=unknown):
        Task(parse_spec({"task": {"reasoning_gym": "nope", "size": 5}}).task)
    bad = {**ADDITION, "params": {"min_terms": 3, "max_terms": 2}}
    with pytest.raises(ValueError, match=r"^task\.params: reasoning-gym 'basic_arithmetic' rejected"):
        Task(parse_spec({"task": bad}).task)


# --- sampling and prompts ------------------------------------------------------------------------


def test_sampling_is_a_function_of_the_seeds_and_the_step(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", ["a", "b", "c", "d", "e", "f"])
    task, again = dataset_task(path, 1, interval=0), dataset_task(path, 1, interval=0)
    for step in range(10):
        picked = task.sample(step, 4, seed=7)
        assert picked == again.sample(step, 4, seed=7)  # a resumed run sees the same prompts
        assert len({p.question for p in picked}) == 4  # without replacement while there are enough
    steps = {tuple(p.question for p in task.sample(s, 4, 7)) for s in range(10)}
    seeds = {tuple(p.question for p in task.sample(1, 4, s)) for s in range(10)}
    # 6*5*4*3 = 360 ordered picks: ten steps (or seeds) drawing one pick each is all but sure
    # to give more than one
    assert len(steps) > 1 and len(seeds) > 1
    more = task.sample(3, 15, seed=7)  # more than there are: drawn with replacement
    assert len(more) == 15 and {p.question for p in more} <= set("abcdef")


def test_the_prompt_template_replaces_only_the_question(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", ["a {b}"])
    spec = parse_spec({"task": {"dataset": str(path), "prompt_template": "Q: {question}\n{answer}? A:"}})
    task = Task(spec.task)
    assert task.prompt(training(task)[0]) == "Q: a {b}\n{answer}? A:"


def test_the_two_digit_example_trains_and_validates_on_disjoint_problems() -> None:
    """examples/addition-cpu.yaml: 4000 training problems, 200 held out, no question in both, and
    far more distinct training questions than a policy memorises in 600 x 32 prompts (19,200)."""
    from rljob.spec import load_spec

    spec = load_spec(Path(__file__).parents[2] / "examples" / "addition-cpu.yaml")
    task = Task.for_job(spec)
    train = task.sample(1, 4000, 0)  # every training problem, in some order
    held = task.validation_problems()
    assert len(train) == 4000 and len(held) == 200
    train_q = {p.question for p in train}
    assert len(train_q) > 3000 and not train_q & {p.question for p in held}
    assert all(re.fullmatch(r"Calculate \d{1,3} \+ \d{1,3}\.", p.question) for p in held)
    assert all(int(p.answer) == sum(int(x) for x in re.findall(r"\d+", p.question)) for p in held[:20])
