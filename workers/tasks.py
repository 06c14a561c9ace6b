"""Prompts and rewards: reasoning-gym generators or a JSONL file of ``{question, answer}``.

The problems of step ``s`` are a pure function of (task seed, rollout seed, step), so a resumed
run sees exactly the prompts the interrupted one would have seen.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.spec import TaskSpec


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
    """A finite set of problems, a prompt template and a scoring rule (reward in [0, 1])."""

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self._problems: list[Problem]
        self._score: Callable[[str, Problem], float]
        if spec.dataset is not None:
            self._problems = _read_jsonl(Path(spec.dataset))
            self._score = lambda text, p: float(extract_answer(text) == p.answer.strip())
        else:
            assert spec.reasoning_gym is not None
            dataset = _reasoning_gym(spec.reasoning_gym, spec.size, spec.seed, spec.params)
            self._problems = [
                Problem(i, str(e["question"]), str(e["answer"]), e) for i, e in enumerate(dataset)
            ]
            self._score = lambda text, p: float(dataset.score_answer(extract_answer(text), p.entry) or 0.0)

    def __len__(self) -> int:
        return len(self._problems)

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


def _read_jsonl(path: Path) -> list[Problem]:
    if not path.is_file():
        raise ValueError(f"task.dataset: {path} does not exist")
    problems: list[Problem] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            problems.append(Problem(len(problems), str(row["question"]), str(row["answer"]), row))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(
                f"task.dataset: {path}:{lineno}: expected a JSON object with question and answer ({err})"
            ) from None
    if not problems:
        raise ValueError(f"task.dataset: {path} has no problems")
    return problems
