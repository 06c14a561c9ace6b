"""Prompts and rewards: reasoning-gym generators or a JSONL file of ``{question, answer}``.

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
- a dataset file: its last ``validation.size`` rows are held out, and training keeps the rows
  before them whose question is not a held-out one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.spec import JobSpec, TaskSpec

# How far past the training set the held-out search looks: at least this many items, or this many
# per held-out problem asked (generation is cheap: ~20 us an item for basic_arithmetic).
HOLDOUT_SCAN_MIN = 1000
HOLDOUT_SCAN_PER_PROBLEM = 20


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer (``entry`` is the generator's record, for scoring)."""

    index: int
    question: str
    answer: str
    entry: dict[str, Any]


def extract_answer(response: str) -> str:
    """The answer a response gives: its first line, stripped (responses end with EOS)."""
    return response.strip().split("\n", 1)[0].strip()


class Task:
    """A finite set of problems, a prompt template and a scoring rule (reward in [0, 1]).

    ``validation_size`` problems (0: none) are held out of training: :meth:`validation_problems`.
    """

    def __init__(self, spec: TaskSpec, validation_size: int = 0) -> None:
        self.spec = spec
        self._problems: list[Problem]
        self._validation: list[Problem] = []
        self._score: Callable[[str, Problem], float]
        if spec.dataset is not None:
            path = Path(spec.dataset)
            self._problems, self._validation = _hold_out_rows(_read_jsonl(path), validation_size, path)
            self._score = lambda text, p: float(extract_answer(text) == p.answer.strip())
        else:
            assert spec.reasoning_gym is not None
            dataset = _reasoning_gym(spec.reasoning_gym, spec.size, spec.seed, spec.params)
            self._problems = [
                Problem(i, str(e["question"]), str(e["answer"]), e) for i, e in enumerate(dataset)
            ]
            # held-out entries are scored by the training dataset: the same generator and config
            self._score = lambda text, p: float(dataset.score_answer(extract_answer(text), p.entry) or 0.0)
            if validation_size:
                self._validation = _held_out_items(spec, self._problems, validation_size)

    @classmethod
    def for_job(cls, spec: JobSpec) -> Task:
        """The job's task, with ``validation.size`` problems held out when validation is on."""
        v = spec.validation
        return cls(spec.task, v.size if v.interval > 0 else 0)

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
        return self.spec.prompt_template.replace("{question}", problem.question)

    def score(self, response: str, problem: Problem) -> float:
        """1.0 for a correct answer, 0.0 otherwise (partial credit where the generator gives it)."""
        return max(0.0, min(1.0, self._score(response, problem)))


def _reasoning_gym(name: str, size: int, seed: int, params: dict[str, Any]) -> Any:
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **params)
    except Exception as err:  # reasoning-gym raises KeyError/TypeError/AssertionError variously
        known = sorted(getattr(reasoning_gym.factory, "DATASETS", {}).keys())
        if known and name not in known:
            raise ValueError(
                f"task.reasoning_gym: unknown generator {name!r}; e.g. {', '.join(known[:12])} "
                f"({len(known)} in all)"
            ) from None
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


def _read_jsonl(path: Path) -> list[Problem]:
    if not path.is_file():
        raise ValueError(f"task.dataset: {path} does not exist")
    problems: list[Problem] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            for key in ("question", "answer"):
                # str() would make null "None" and an object its Python repr: answers no model gives
                if isinstance(row[key], bool) or not isinstance(row[key], str | int | float):
                    raise TypeError(f"{key} is {json.dumps(row[key])}, not a string or a number")
            problems.append(Problem(len(problems), str(row["question"]), str(row["answer"]), row))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(
                f"task.dataset: {path}:{lineno}: expected a JSON object with question and answer ({err})"
            ) from None
    if not problems:
        raise ValueError(f"task.dataset: {path} has no problems")
    return problems
