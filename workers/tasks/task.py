"""Prompts and rewards: reasoning-gym generators or a data file (:mod:`workers.tasks.data`), and
the task's graders (:mod:`workers.tasks.grading`).

A prompt is ``task.prompt_template`` with the question in it; with ``task.chat_template`` that text
is the user message of the tokenizer's chat template (after ``task.system_prompt``, if set), which
ends with the assistant's generation prompt. A data row with chat ``messages`` is its own
conversation: the prompt is those messages (after ``task.system_prompt`` when they have no system
message) through the chat template. A response is graded (:class:`Grade`) by the task's graders;
the default one reads its answer in ``task.answer_format`` (:mod:`workers.tasks.answers`) and
compares it with the reference: the reasoning-gym generator's ``score_answer`` (partial credit
where it gives it), or for a data file :func:`~workers.tasks.answers.same_answer`. reward =
correctness + ``task.format_reward`` x readable, in [0, 1 + format_reward]; an unreadable response
scores 0.

The problems of step ``s`` are a pure function of (task seed, rollout seed, step), so a resumed
run sees exactly the prompts the interrupted one would have seen.

Validation (``validation.interval > 0``) holds problems out that training never sees:

- reasoning-gym: the training set is items ``0..task.size-1``, as without validation. The held-out
  problems are the generator's next items (``task.size``, ``task.size+1``, ...; reasoning-gym
  derives item ``i`` from ``seed + i``), skipping any whose question text is a training question or
  an earlier held-out one, until ``validation.size`` are found. Small generators run out (2-term
  single-digit addition has ~120 distinct questions): then the job is refused with the number that
  exists, rather than validated on fewer problems than asked, so that ``val/accuracy`` of two runs
  always covers the same number of problems.
- a data file: its last ``validation.size`` rows are held out, or with
  ``task.validation_dataset`` the first ``validation.size`` rows of that file; training keeps the
  rows whose question is not a held-out one.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob import task_params
from rljob.graders import AnswerGrader
from rljob.spec import AnswerFormat, JobSpec, TaskSpec
from workers.models.tokenizer import Tokenizer
from workers.tasks.answers import first_line, resolve_format, same_answer
from workers.tasks.data import DataError, Located, read_rows, row_prompt
from workers.tasks.grading import Grade, GraderReport, Graders

# How far past the training set the held-out search looks: at least this many items, or this many
# per held-out problem asked (generation is cheap: ~20 us an item for basic_arithmetic).
HOLDOUT_SCAN_MIN = 1000
HOLDOUT_SCAN_PER_PROBLEM = 20


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer; ``entry`` is the generator's record or the data row
    (what graders read as ``item``); ``messages``: a chat row's conversation up to the assistant's
    turn (None: the question goes into the prompt template)."""

    index: int
    question: str
    answer: str
    entry: dict[str, Any]
    messages: tuple[dict[str, str], ...] | None = None


def extract_answer(response: str) -> str:
    """The first line of ``response``, stripped ("" when there is none): ``task.answer_format``
    ``first-line``'s reading, for callers that compare texts themselves (bench/step.py)."""
    return first_line(response) or ""


class Task:
    """A finite set of problems, a prompt template and a grading rule (module docstring).

    ``validation_size`` problems (0: none) are held out of training: :meth:`validation_problems`.
    ``tok``: the job's tokenizer, whose chat template formats the prompts (needed with
    ``task.chat_template`` only; one prompt is rendered here, so a tokenizer without a template
    fails now rather than in the first step).
    """

    def __init__(
        self,
        spec: TaskSpec,
        validation_size: int = 0,
        tok: Tokenizer | None = None,
        grader_workers: int | None = None,
    ) -> None:
        self.spec = spec
        self.tok = tok
        self._problems: list[Problem]
        self._validation: list[Problem] = []
        self._correctness: Callable[[str, Problem], float]  # (the answer read, its problem)
        if spec.dataset is not None:
            self._problems, self._validation = _file_problems(spec, validation_size)
            self._correctness = lambda answer, p: float(same_answer(answer, p.answer))
        else:
            assert spec.reasoning_gym is not None
            dataset = _reasoning_gym(spec.reasoning_gym, spec.size, spec.seed, spec.params)
            self._problems = [
                Problem(i, str(e["question"]), str(e["answer"]), e) for i, e in enumerate(dataset)
            ]
            # held-out entries are scored by the training dataset: the same generator and config
            self._correctness = lambda answer, p: float(dataset.score_answer(answer, p.entry) or 0.0)
            if validation_size:
                self._validation = _held_out_items(spec, self._problems, validation_size)
        chats = any(p.messages is not None for p in self._problems[:1] + self._validation[:1])
        if chats and not spec.chat_template:
            raise ValueError(
                "task.dataset: its rows are chat messages, which only a chat template can make a prompt "
                "of; set task.chat_template: true (with a Hugging Face tokenizer that has one)"
            )
        if spec.chat_template:
            if tok is None:
                raise ValueError("task.chat_template needs the job's tokenizer: Task.for_job(spec, tok)")
            self.prompt(self._problems[0])
        workers = (
            grader_workers or int(os.environ.get("FP8RL_GRADER_WORKERS", "0")) or min(os.cpu_count() or 1, 8)
        )
        self.graders = Graders(
            spec.grader_list(),
            lambda answer, row: self._correctness(answer, row),  # type: ignore[arg-type]
            pool_size=workers,
            max_error_fraction=spec.max_grader_error_fraction,
            base=Path.cwd(),
        )

    @classmethod
    def for_job(cls, spec: JobSpec, tok: Tokenizer | None = None) -> Task:
        """The job's task, with ``validation.size`` problems held out when validation is on;
        ``tok`` is the job's tokenizer (needed with ``task.chat_template``)."""
        v = spec.validation
        return cls(spec.task, v.size if v.interval > 0 else 0, tok)

    def __len__(self) -> int:
        """Training problems."""
        return len(self._problems)

    def problems(self) -> list[Problem]:
        """Every problem the job may prompt with: the training ones, then the held-out ones."""
        return [*self._problems, *self._validation]

    def validation_problems(self) -> list[Problem]:
        """The held-out problems, in a fixed order (empty without validation)."""
        return list(self._validation)

    def sample(self, step: int, n: int, seed: int) -> list[Problem]:
        """``n`` problems for ``step`` (deterministic; without replacement when possible)."""
        rng = random.Random(f"{self.spec.seed}/{seed}/{step}")
        if n <= len(self._problems):
            return rng.sample(self._problems, n)
        return [rng.choice(self._problems) for _ in range(n)]

    def prompt(self, problem: Problem) -> str:
        """The whole prompt text: the template with the question in it, or with
        ``task.chat_template`` the chat it makes the user message of (a chat row: its own
        messages), up to the assistant's turn."""
        if problem.messages is not None:
            messages = list(problem.messages)
        else:
            text = self.spec.prompt_template.replace("{question}", problem.question)
            if not self.spec.chat_template:
                return text
            messages = [{"role": "user", "content": text}]
        assert self.tok is not None  # __init__ checks it
        system = self.spec.system_prompt
        if system is not None and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": system}, *messages]
        return self.tok.apply_chat_template(messages)

    def _answer_grader(self) -> AnswerGrader | None:
        return next((g for g in self.spec.grader_list() if isinstance(g, AnswerGrader)), None)

    def answer_format(self, problem: Problem) -> AnswerFormat:
        """The format ``problem``'s responses are read in (``auto`` decided by its reference
        answer): the first ``answer`` grader's; first-line for a task without one."""
        grader = self._answer_grader()
        return resolve_format(grader.answer_format if grader else "first-line", problem.answer)

    def target(self, problem: Problem) -> str:
        """The reference answer written as a response the task reads (the warm-up's target)."""
        fmt = self.answer_format(problem)
        if fmt == "answer-tag":
            return f"<answer>{problem.answer}</answer>"
        if fmt == "boxed":
            return f"\\boxed{{{problem.answer}}}"
        return problem.answer

    def grade_batch(
        self, responses: list[str], problems: list[Problem]
    ) -> tuple[list[Grade], dict[str, GraderReport]]:
        """Each response's grade, and each grader's report (:meth:`Graders.grade`)."""
        return self.graders.grade(responses, problems)

    def grade(self, response: str, problem: Problem) -> Grade:
        """One response's grade (:meth:`grade_batch` of one)."""
        return self.grade_batch([response], [problem])[0][0]

    def score(self, response: str, problem: Problem) -> float:
        """The reward of ``response`` (:meth:`grade`)."""
        return self.grade(response, problem).reward

    def close(self) -> None:
        """Stop the graders' sandbox pool, if one started."""
        self.graders.close()


def params_table() -> dict[str, dict[str, float | str]]:
    """The allow-list of ``task.params`` (``rljob/reasoning_gym_params.json``, :mod:`rljob.task_params`)
    read from the installed reasoning-gym: each generator's config fields, less ``size``, ``seed``
    and those that name files, each with its magnitude cap (numeric fields) or kind."""
    import dataclasses

    import reasoning_gym.factory

    out: dict[str, dict[str, float | str]] = {}
    for name, (_, config) in sorted(reasoning_gym.factory.DATASETS.items()):
        fields: dict[str, float | str] = {}
        for f in dataclasses.fields(config):
            if f.name in task_params.RESERVED or task_params.names_a_file(f.name):
                continue
            if f.default is not dataclasses.MISSING:
                default: Any = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = None
            if name == "composite" and f.name == "datasets":
                fields[f.name] = task_params.NESTED
            elif isinstance(default, bool) or not (isinstance(default, int | float) or default is None):
                fields[f.name] = task_params.ANY
            elif default is None:
                numeric = any(t in str(f.type) for t in ("int", "float"))
                fields[f.name] = task_params.NONE_DEFAULT_CAP if numeric else task_params.ANY
            else:
                fields[f.name] = max(task_params.PARAM_FLOOR, 10 * abs(default))
        out[name] = fields
    return out


def _reasoning_gym(name: str, size: int, seed: int, params: dict[str, Any]) -> Any:
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **params)
    except Exception as err:  # reasoning-gym raises KeyError/TypeError/AssertionError variously
        # (an unknown generator never gets here: the spec refuses it, rljob.task_params)
        raise ValueError(f"task.params: reasoning-gym {name!r} rejected {params}: {err}") from None


def _held_out_items(spec: TaskSpec, training: list[Problem], n: int) -> list[Problem]:
    """The first ``n`` items after the training set whose question is new (see the module docstring)."""
    assert spec.reasoning_gym is not None
    scan = max(HOLDOUT_SCAN_MIN, HOLDOUT_SCAN_PER_PROBLEM * n)
    # one dataset that also spans the training indices, for generators that build all their items
    # up front from `size`; only the items after the training set are read
    dataset = _reasoning_gym(spec.reasoning_gym, spec.size + scan, spec.seed, spec.params)
    seen = {p.question for p in training}
    held: list[Problem] = []
    for i in range(spec.size, spec.size + scan):
        entry = dataset[i]
        question = str(entry["question"])
        if question in seen:
            continue
        seen.add(question)
        held.append(Problem(i, question, str(entry["answer"]), entry))
        if len(held) == n:
            return held
    raise ValueError(
        f"validation.size: {n} held-out problems asked, but {spec.reasoning_gym!r} with these "
        f"task.params has only {len(held)} distinct questions outside the training set in the "
        f"{scan} items after it (the {spec.size} training items hold {len({p.question for p in training})} "
        f"distinct questions). Set validation.size to at most {len(held)}, lower task.size (fewer "
        "training questions), or widen task.params (e.g. more digits or terms)."
    )


def _file_problems(spec: TaskSpec, n: int) -> tuple[list[Problem], list[Problem]]:
    """(training, held-out) problems of ``task.dataset`` (and ``task.validation_dataset``)."""
    assert spec.dataset is not None
    path = Path(spec.dataset)
    rows = _problems(read_rows(path), spec)
    if spec.validation_dataset is not None and n:
        vpath = Path(spec.validation_dataset)
        held = _problems(read_rows(vpath, "task.validation_dataset"), spec, "task.validation_dataset")
        if len(held) < n:
            raise ValueError(
                f"validation.size: {n} held-out rows asked, but task.validation_dataset {vpath} has "
                f"{len(held)}; set validation.size to at most {len(held)}"
            )
        held = held[:n]
        questions = {p.question for p in held}
        training = [p for p in rows if p.question not in questions]
        if not training:
            raise ValueError(
                f"task.dataset: every row of {path} repeats a question of task.validation_dataset"
            )
        return training, held
    return _hold_out_rows(rows, n, path)


def _problems(rows: Located, spec: TaskSpec, field: str = "task.dataset") -> list[Problem]:
    """The rows as problems; an ``answer`` grader reading ``{{item.answer}}`` needs every row's
    ``answer`` (a string or number)."""
    needs_answer = any(
        isinstance(g, AnswerGrader) and g.reference == "{{item.answer}}" for g in spec.grader_list()
    )
    out: list[Problem] = []
    for located, row in rows:
        where = f"{field}: {located}"
        question, messages = row_prompt(row, where)
        answer = row.get("answer")
        if needs_answer and (isinstance(answer, bool) or not isinstance(answer, str | int | float)):
            raise DataError(
                f"{where}: answer is {json.dumps(answer)}, not a string or a number (the answer "
                "grader, the default, reads it): add answer to every row, or choose task.grader(s) that "
                "read other fields"
            )
        text = (
            ""
            if answer is None
            else str(answer)
            if not isinstance(answer, list | dict)
            else json.dumps(answer)
        )
        out.append(Problem(len(out), question, text, row, tuple(messages) if messages is not None else None))
    return out


def _hold_out_rows(rows: list[Problem], n: int, path: Path) -> tuple[list[Problem], list[Problem]]:
    """(training, held-out): the last ``n`` rows held out, training without their questions."""
    if n == 0:
        return rows, []
    if n >= len(rows):
        raise ValueError(
            f"validation.size: {n} held-out rows leave no training rows in task.dataset {path} "
            f"({len(rows)} rows); set validation.size to at most {len(rows) - 1}"
        )
    held = rows[-n:]
    questions = {p.question for p in held}
    training = [p for p in rows[:-n] if p.question not in questions]
    if not training:
        raise ValueError(
            f"validation.size: every training row of task.dataset {path} repeats the question of a "
            f"held-out row (the last {n}); lower validation.size"
        )
    return training, held
