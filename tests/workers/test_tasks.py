"""Tasks: answers are read from a response in the task's answer format and graded (hand-written
responses, rewards worked out by hand); a chat template formats the prompts; a JSONL dataset is
read row by row and refused with the line that is wrong; sampling is a pure function of the step;
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

from rljob import SpecError, parse_spec
from tests.workers.models.test_tokenizer import CHAT_TEMPLATE, chat_tokenizer_dir
from workers.models.tokenizer import build_tokenizer
from workers.tasks import Grade, Problem, Task, extract_answer

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


def dataset_task(path: Path, size: int, interval: int = 5, **task: object) -> Task:
    spec = parse_spec(
        {"task": {"dataset": str(path), **task}, "validation": {"interval": interval, "size": size}}
    )
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


def test_extract_answer_is_the_first_line_stripped() -> None:
    """The first-line rule for callers that compare texts themselves (bench/step.py): "" for none."""
    assert [
        extract_answer(r) for r in ("7", "  7  ", "7\nbecause 3 + 4", "\n\n 7 \n8", "3 + 4 = 7", " \n ")
    ] == [
        "7",
        "7",
        "7",
        "7",
        "3 + 4 = 7",
        "",
    ]


RESPONSES = ("4", " 4\n", "4\n5", "04", "4.0", "", "5\n4")


def test_a_dataset_answer_scores_by_the_first_line_or_the_last_number(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "2+2", "answer": " 4 "}) + "\n")
    [p] = training(dataset_task(path, 1, interval=0, answer_format="first-line"))
    assert p.answer == " 4 "  # kept as written; compared stripped, and by value as a number
    first = dataset_task(path, 1, interval=0, answer_format="first-line")
    # first lines: 4, 4, 4, 04, 4.0, none, 5
    assert [first.score(r, p) for r in RESPONSES] == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    # auto: the reference is a number, so the last number: 4, 4, 5, 04, 4.0, none, 4
    auto = dataset_task(path, 1, interval=0)
    assert [auto.score(r, p) for r in RESPONSES] == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


GRADED = [
    {"question": "23 + 48", "answer": 71},
    {"question": "capital of France", "answer": "Paris"},
    {"question": "2 + 2", "answer": "4"},
    {"question": "half", "answer": "\\frac{1}{2}"},
]


def graded_task(tmp_path: Path, **task: object) -> tuple[Task, dict[str, Problem]]:
    path = tmp_path / "graded.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GRADED))
    t = dataset_task(path, 1, interval=0, **task)
    return t, {p.answer: p for p in training(t)}


@pytest.mark.parametrize(
    ("answer", "response", "grade"),
    [
        # a number reference (auto: the last number), format reward 0.25
        ("71", "71", Grade(1.25, True, True)),
        ("71", "23 + 48 = 71", Grade(1.25, True, True)),
        ("71", "The answer is 71.", Grade(1.25, True, True)),
        ("71", "The answer is 71.0", Grade(1.25, True, True)),  # the same value
        ("71", "The answer is 72.", Grade(0.25, False, True)),  # read, and wrong
        ("71", "71, no: 17", Grade(0.25, False, True)),  # the last number is 17
        ("71", "I cannot tell", Grade(0.0, False, False)),  # no number: no format reward either
        ("71", "", Grade(0.0, False, False)),
        # a text reference (auto: the first line)
        ("Paris", "Paris\nIt is on the Seine.", Grade(1.25, True, True)),
        ("Paris", "The capital is Paris.", Grade(0.25, False, True)),
        ("Paris", "", Grade(0.0, False, False)),
    ],
)
def test_grades_with_a_format_reward(tmp_path: Path, answer: str, response: str, grade: Grade) -> None:
    task, problems = graded_task(tmp_path, format_reward=0.25)
    assert task.grade(response, problems[answer]) == grade
    assert task.score(response, problems[answer]) == grade.reward


def test_without_a_format_reward_the_reward_is_the_correctness(tmp_path: Path) -> None:
    task, problems = graded_task(tmp_path)
    p = problems["71"]
    assert task.grade("23 + 48 = 71", p) == Grade(1.0, True, True)
    assert task.grade("72", p) == Grade(0.0, False, True)
    assert task.grade("no idea", p) == Grade(0.0, False, False)


@pytest.mark.parametrize(
    ("answer", "response", "grade"),
    [
        ("4", "<answer>4</answer>", Grade(1.5, True, True)),
        ("4", "<answer> 4 </answer> then 5", Grade(1.5, True, True)),
        ("4", "<answer>5</answer>", Grade(0.5, False, True)),
        ("4", "4", Grade(0.0, False, False)),  # right, but not in the tag asked for
        ("71", "<answer>71.0</answer>", Grade(1.5, True, True)),
    ],
)
def test_answer_tag_grades(tmp_path: Path, answer: str, response: str, grade: Grade) -> None:
    task, problems = graded_task(tmp_path, answer_format="answer-tag", format_reward=0.5)
    assert task.grade(response, problems[answer]) == grade


@pytest.mark.parametrize(
    ("answer", "response", "grade"),
    [
        ("\\frac{1}{2}", "So \\boxed{\\frac{1}{2}}.", Grade(1.5, True, True)),
        ("\\frac{1}{2}", "\\boxed{0.5}", Grade(0.5, False, True)),  # no algebra: compared as text
        ("71", "\\boxed{12}", Grade(0.5, False, True)),
        ("71", "\\boxed{71", Grade(0.0, False, False)),  # cut off before the closing brace
    ],
)
def test_boxed_grades(tmp_path: Path, answer: str, response: str, grade: Grade) -> None:
    task, problems = graded_task(tmp_path, answer_format="boxed", format_reward=0.5)
    assert task.grade(response, problems[answer]) == grade


def test_the_warm_up_target_is_the_answer_as_the_format_reads_it(tmp_path: Path) -> None:
    for fmt, target in (
        ("auto", "71"),
        ("last-number", "71"),
        ("first-line", "71"),
        ("answer-tag", "<answer>71</answer>"),
        ("boxed", "\\boxed{71}"),
    ):
        task, problems = graded_task(tmp_path, answer_format=fmt)
        assert task.target(problems["71"]) == target, fmt


def test_a_reasoning_gym_answer_is_read_and_scored_by_the_generator() -> None:
    """basic_arithmetic's score_answer: 1 for the oracle's text, len(oracle) / len(answer) for an
    answer that contains it, else 0."""
    task = addition_task(1, interval=0, format_reward=0.5)
    for p in training(task)[:5]:
        s = p.answer
        assert task.grade(f"{p.question[len('Calculate ') : -1]} = {s}.", p) == Grade(1.5, True, True)
        assert task.grade(f"The answer is {s}", p) == Grade(1.5, True, True)
        # "7.0" holds "7": partial credit 1/3 (1 / 3 characters), not correct
        assert task.grade(f"{s}.0", p) == Grade(len(s) / (len(s) + 2) + 0.5, False, True)
        assert task.grade("I do not know", p) == Grade(0.0, False, False)


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
        (
            '{"question": "a", "answer": "b"}\n\n{"question": "c"}\n',
            r"qa.jsonl:3: answer is null, not a string or a number \(the answer grader",
        ),
        (
            '{"answer": "b"}\n',
            r"qa.jsonl:1: question is null, not a string or a number \(or give chat messages\)",
        ),
        ('["a", "b"]\n', r"qa.jsonl:1: expected a JSON object with question \(or messages\)"),
        ('"a"\n', r"qa.jsonl:1: expected a JSON object with question \(or messages\)"),
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
    # an unknown name is refused where the spec is read (rljob.task_params), before any driver
    with pytest.raises(SpecError, match=r"task\.reasoning_gym: unknown reasoning-gym generator 'nope'"):
        parse_spec({"task": {"reasoning_gym": "nope", "size": 5}})
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


def chat_spec(tmp_path: Path, template: str | None = CHAT_TEMPLATE, **task: object) -> dict[str, object]:
    path = write_jsonl(tmp_path / "qa.jsonl", ["a b"])  # its answer: "A B"
    tok = chat_tokenizer_dir(tmp_path / "tok", template)
    return {
        "tokenizer": {"kind": "huggingface", "name": tok},
        "task": {"dataset": str(path), "prompt_template": "{question} ?", "chat_template": True, **task},
    }


def test_a_chat_prompt_is_the_user_message_of_the_chat_template(tmp_path: Path) -> None:
    """The template (tests/workers/models/test_tokenizer.py): "<|role|> content <|end|> " per message, then
    "<|assistant|> "; it writes the BOS itself."""
    spec = parse_spec(chat_spec(tmp_path))
    tok = build_tokenizer(spec)
    task = Task.for_job(spec, tok)
    [p] = training(task)
    assert task.prompt(p) == "<s><|user|> a b ? <|end|> <|assistant|> "
    assert tok.encode(task.prompt(p)) == [1, 3, 7, 8, 9, 2, 4]
    system = parse_spec(chat_spec(tmp_path, system_prompt="b"))
    assert (
        Task.for_job(system, tok).prompt(p) == "<s><|system|> b <|end|> <|user|> a b ? <|end|> <|assistant|> "
    )
    # without chat_template the same spec prompts with the template's text alone
    plain = parse_spec(chat_spec(tmp_path, chat_template=False))
    assert Task.for_job(plain, tok).prompt(p) == "a b ?"


def test_a_chat_task_without_a_chat_template_is_refused_when_built(tmp_path: Path) -> None:
    spec = parse_spec(chat_spec(tmp_path, template=None))
    with pytest.raises(ValueError, match=r"^task\.chat_template: tokenizer .* has no chat template"):
        Task.for_job(spec, build_tokenizer(spec))
    with pytest.raises(ValueError, match=r"^task\.chat_template needs the job's tokenizer"):
        Task.for_job(spec)


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


def test_the_params_allow_list_is_the_pinned_reasoning_gyms() -> None:
    """rljob's table (read by the control plane, which has no reasoning-gym) equals what the
    installed reasoning-gym's configs give; regenerate it with workers.tasks.params_table."""
    from importlib import metadata, resources

    from workers.tasks import params_table

    committed = json.loads(resources.files("rljob").joinpath("reasoning_gym_params.json").read_text())
    assert committed["reasoning_gym"] == metadata.version("reasoning_gym")
    assert committed["generators"] == params_table()


def test_no_config_field_that_holds_a_file_name_is_allowed() -> None:
    """Independently of the name rule: every config field whose default is a file name (a string
    ending in a file extension, as spell_backward's words3to10.txt) is off the allow-list."""
    import dataclasses

    import reasoning_gym.factory

    from rljob.task_params import table

    file_fields = []
    for name, (_, config) in reasoning_gym.factory.DATASETS.items():
        for f in dataclasses.fields(config):
            if isinstance(f.default, str) and re.search(r"\.(txt|json|jsonl|csv|ya?ml|gz)$", f.default):
                file_fields.append((name, f.name))
    assert ("spell_backward", "data_file") in file_fields
    assert all(field not in table()[name] for name, field in file_fields)
