"""A job's graders at work: a batch of responses and their rows in, a reward per response and a
report per grader out.

Each grader of ``task.graders`` scores every response (:mod:`rljob.graders` says what each kind
does); the reward is their weighted mean (one grader: its score). ``answer`` scores lie in
[0, 1 + format_reward], every other kind's in [0, 1] (a python grader's number is clipped, a
multi grader's formula too). A response is *correct* when every grader gives it full credit
(``answer``: a correct answer, the format bonus aside), and *readable* unless an ``answer`` grader
could read no answer in it.

Where each kind runs: ``answer``, ``string_check`` (but ``regex``), ``numeric``, ``json`` (but its
schema) and the formulas here, in the driver; ``http`` from here too, ``max_concurrency`` requests
at once, each retried ``retries`` times after a connection error, timeout, 429 or 5xx;
``model`` on the job's actor for it (or here, outside a job), a batch at a time;
``python``, ``code``, ``math``, a regex and a JSON Schema in the grader sandbox's pool
(:mod:`workers.tasks.sandbox`), with a wall-clock limit (``timeout_s``, 5 s for the kinds that
have none). A grader that fails on a response (raises,
times out, returns no finite number) scores it 0; it is counted (``errors``, ``timeouts``), and
logged once per grader and kind of failure. When more than ``max_error_fraction`` of a batch's
responses fail one grader, :class:`GraderFailure` stops the job with that grader's first error.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from rljob import formula
from rljob.graders import (
    AnswerGrader,
    HttpGrader,
    JsonGrader,
    ModelGrader,
    MultiGrader,
    NumericGrader,
    PythonGrader,
    StringCheckGrader,
    grader_name,
    runs_in_pool,
)
from workers.tasks.answers import parse_number, read_answer
from workers.tasks.pool_requests import pool_request
from workers.tasks.remote import http_token, post_all
from workers.tasks.sandbox import GraderPool, Launcher
from workers.tasks.templates import Sample, parses_as_json, render

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0  # a regex or a JSON Schema in the pool, and math, when the grader sets none


class GraderFailure(RuntimeError):
    """One grader failed on more of a batch than ``task.max_grader_error_fraction`` allows."""


class Row(Protocol):
    """What a grader reads of a problem: its data row, and its reference answer as text."""

    @property
    def entry(self) -> dict[str, Any]: ...

    @property
    def answer(self) -> str: ...


class Grade(NamedTuple):
    """How a response did: its ``reward``; ``correct``: full credit from every grader;
    ``readable``: every ``answer`` grader could read an answer in it."""

    reward: float
    correct: bool
    readable: bool


class Scorer(Protocol):
    """A model grader's model, wherever it runs (:mod:`workers.tasks.model_scorer`): one score, or
    None (a judge's answer without a number), per text."""

    def score(self, texts: list[str]) -> list[float | None]: ...


class SandboxPool(Protocol):
    """Where the sandboxed kinds run: a :class:`~workers.tasks.sandbox.GraderPool` of this
    process's, or a job's pool of Ray actors (:mod:`workers.job.grader_actors`), each holding one.
    ``restarts``: processes (or actors) replaced after they died or stopped answering."""

    restarts: int

    def where(self) -> str: ...

    def load(self, key: str, source: str, timeout_s: float) -> str | None: ...

    def run(self, requests: list[tuple[dict[str, Any], float]]) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


@dataclass
class GraderReport:
    """One grader over one batch: its scores, and how often and how it failed."""

    name: str
    scores: list[float] = field(default_factory=list)
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0
    first_error: str | None = None

    @property
    def mean(self) -> float:
        return sum(self.scores) / len(self.scores) if self.scores else 0.0


class _Scored(NamedTuple):
    score: float
    correct: bool
    readable: bool


def _unit(x: float) -> float:
    return min(1.0, max(0.0, x))


class Graders:
    """The graders of one task (``graders``: :meth:`rljob.spec.TaskSpec.grader_list`).

    ``answer_correctness(answer, row)``: how an ``answer`` grader scores an answer it read (the
    task's: a reasoning-gym generator's scorer, or equal text or number). ``pool_size``: processes
    of the sandbox pool, started on first use by a kind that needs it; ``launcher``: how they
    start (default: ``FP8RL_GRADER_SANDBOX``). ``base``: where a python grader's relative
    ``file`` is read from (the job's working directory).
    """

    def __init__(
        self,
        graders: Sequence[Any],
        answer_correctness: Callable[[str, Row], float],
        *,
        pool_size: int = 1,
        launcher: Launcher | None = None,
        max_error_fraction: float = 0.5,
        base: Path | None = None,
        scorer_factory: Callable[[ModelGrader], Scorer] | None = None,
    ) -> None:
        self.graders = list(graders)
        self.answer_correctness = answer_correctness
        self.pool_size = pool_size
        self.launcher = launcher
        self.max_error_fraction = max_error_fraction
        self._pool: SandboxPool | None = None
        self.pool_factory: Callable[[int], SandboxPool] | None = None  # see use_pool
        self._sources: dict[int, str] = {}  # id(python grader) -> its source
        for g in self._all():
            if isinstance(g, PythonGrader):
                if g.source is not None:
                    self._sources[id(g)] = g.source
                else:
                    assert g.file is not None
                    path = Path(g.file) if base is None or Path(g.file).is_absolute() else base / g.file
                    try:
                        self._sources[id(g)] = path.read_text()
                    except (OSError, UnicodeDecodeError) as err:
                        raise ValueError(f"a python grader's file {g.file!r} cannot be read: {err}") from None
        self._base = base
        # a model grader's model: in this process unless the job puts it on an actor of its own
        self.scorer_factory = scorer_factory
        self._scorers: dict[int, Scorer] = {}
        self._formulas: dict[int, Any] = {}
        self._tokens: dict[int, str | None] = {}  # id(http grader) -> its bearer token, once read
        self._loaded: set[int] = set()
        self._logged: set[tuple[str, str]] = set()

    def _all(self) -> list[Any]:
        out = []
        for g in self.graders:
            out.append(g)
            if isinstance(g, MultiGrader):
                out += list(g.graders.values())
        return out

    @property
    def sandboxed(self) -> bool:
        """Whether any grader runs in the sandbox pool."""
        return any(runs_in_pool(g) for g in self._all())

    def pool(self) -> SandboxPool:
        """The sandbox pool, started on first use: ``pool_factory(memory_mb)``'s (:meth:`use_pool`),
        or ``pool_size`` processes of this one's."""
        if self._pool is None:
            memory = max((g.memory_mb for g in self._all() if hasattr(g, "memory_mb")), default=512)
            if self.pool_factory is not None:
                self._pool = self.pool_factory(memory)
            else:
                self._pool = GraderPool(self.pool_size, memory, self.launcher)
            log.info("graders' code runs in %s", self._pool.where())
        return self._pool

    def use_pool(self, factory: Callable[[int], SandboxPool]) -> None:
        """From now on the sandboxed kinds run in the pool ``factory(memory_mb)`` makes (a job's
        Ray actors): the pool so far is closed, and python graders load into the new one on
        first use."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._loaded.clear()
        self.pool_factory = factory

    def check(self, load_code: bool = True, read_tokens: bool = True) -> list[str]:
        """Load every python grader into the sandbox (compiling it there; not with ``load_code``
        False), read every http grader's token (not with ``read_tokens`` False) and check JSON
        Schemas; the problems, each naming its grader (empty: all ready)."""
        problems = []
        for name, g in self._named():
            if isinstance(g, HttpGrader) and read_tokens:
                try:
                    self._token(g)
                except ValueError as err:
                    problems.append(f"{name}: {err}")
            if isinstance(g, PythonGrader) and load_code:
                error = self._load(g)
                if error is not None:
                    problems.append(f"{name}: {error}")
            if isinstance(g, JsonGrader) and g.json_schema is not None:
                try:
                    import jsonschema

                    jsonschema.Draft202012Validator.check_schema(g.json_schema)
                except Exception as err:  # jsonschema.SchemaError, and anything a bad schema raises
                    problems.append(f"{name}: json_schema is not a JSON Schema: {str(err).splitlines()[0]}")
        return problems

    def _named(self) -> list[tuple[str, Any]]:
        out = []
        for g in self.graders:
            out.append((grader_name(g), g))
            if isinstance(g, MultiGrader):
                out += [(f"{grader_name(g)}.{n}", c) for n, c in g.graders.items()]
        return out

    def _load(self, g: PythonGrader) -> str | None:
        if id(g) in self._loaded:
            return None
        error = self.pool().load(str(id(g)), self._sources[id(g)], g.timeout_s)
        if error is None:
            self._loaded.add(id(g))
        return error

    def close(self) -> None:
        for scorer in self._scorers.values():
            stop = getattr(scorer, "close", None)
            if stop is not None:
                stop()
        self._scorers = {}
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._loaded.clear()  # a pool started later loads them again

    # -- grading -------------------------------------------------------------------------------
    def grade(self, texts: Sequence[str], rows: Sequence[Row]) -> tuple[list[Grade], dict[str, GraderReport]]:
        """Each response's :class:`Grade` and each grader's report (multi graders' children as
        ``<multi>.<child>``). Raises :class:`GraderFailure` (module docstring)."""
        samples = [Sample(t) for t in texts]
        reports: dict[str, GraderReport] = {}
        per_grader: list[list[_Scored]] = []
        weights = []
        for g in self.graders:
            per_grader.append(self._score(grader_name(g), g, samples, rows, reports))
            weights.append(g.weight)
        total = sum(weights)
        grades = []
        for i in range(len(samples)):
            scored = [s[i] for s in per_grader]
            reward = sum(w * s.score for w, s in zip(weights, scored, strict=True)) / total
            grades.append(Grade(reward, all(s.correct for s in scored), all(s.readable for s in scored)))
        for report in reports.values():
            failed = report.errors + report.timeouts
            if samples and failed > self.max_error_fraction * len(samples):
                raise GraderFailure(
                    f"grader {report.name} failed on {failed} of {len(samples)} responses (errors "
                    f"{report.errors}, timeouts {report.timeouts}; task.max_grader_error_fraction "
                    f"{self.max_error_fraction}): {report.first_error or 'timed out'}"
                )
        return grades, reports

    def _score(
        self, name: str, g: Any, samples: list[Sample], rows: Sequence[Row], reports: dict[str, GraderReport]
    ) -> list[_Scored]:
        t0 = time.perf_counter()
        report = reports.setdefault(name, GraderReport(name))
        if isinstance(g, MultiGrader):
            children = {
                child: self._score(f"{name}.{child}", c, samples, rows, reports)
                for child, c in g.graders.items()
            }
            t0 = time.perf_counter()  # the children's time is their own: this report counts the formula
            tree = self._formula(g)
            out = []
            for i in range(len(samples)):
                value = formula.evaluate(tree, {child: s[i].score for child, s in children.items()})
                score = _unit(value) if math.isfinite(value) else 0.0
                out.append(_Scored(score, score >= 1.0, all(s[i].readable for s in children.values())))
        elif isinstance(g, HttpGrader):
            out = self._score_over_http(name, g, samples, rows, report)
        elif isinstance(g, ModelGrader):
            out = self._score_with_model(name, g, samples, rows, report)
        elif runs_in_pool(g):
            out = self._score_in_pool(name, g, samples, rows, report)
        else:
            out = [self._score_here(g, s, r) for s, r in zip(samples, rows, strict=True)]
        report.scores = [s.score for s in out]
        report.seconds += time.perf_counter() - t0
        return out

    def _score_here(self, g: Any, sample: Sample, row: Row) -> _Scored:
        item = row.entry
        if isinstance(g, AnswerGrader):
            reference = row.answer if g.reference == "{{item.answer}}" else render(g.reference, item, sample)
            answer = read_answer(sample.output_text, g.answer_format, reference)
            if answer is None:
                return _Scored(0.0, False, False)
            correctness = _unit(self.answer_correctness(answer, row))
            return _Scored(correctness + g.format_reward, correctness >= 1.0, True)
        if isinstance(g, StringCheckGrader):
            text, ref = render(g.input, item, sample), render(g.reference, item, sample)
            if g.ignore_case:
                text, ref = text.casefold(), ref.casefold()
            hit = {
                "eq": lambda: text.strip() == ref.strip(),
                "ne": lambda: text.strip() != ref.strip(),
                "contains": lambda: ref in text,
            }[g.operation]()
            return _Scored(float(hit), hit, True)
        if isinstance(g, NumericGrader):
            from workers.tasks.answers import last_number

            got = last_number(render(g.input, item, sample))
            want = parse_number(render(g.reference, item, sample))
            if got is None or want is None:
                return _Scored(0.0, False, True)
            bound = g.tolerance * (abs(float(want)) if g.relative else 1.0)
            hit = abs(float(got) - float(want)) <= bound
            return _Scored(float(hit), hit, True)
        if isinstance(g, JsonGrader):
            ok, _ = parses_as_json(render(g.input, item, sample))
            return _Scored(float(ok), ok, True)
        raise TypeError(f"no in-process scoring for grader type {g.type!r}")  # runs_in_pool routes the rest

    def _score_in_pool(
        self, name: str, g: Any, samples: list[Sample], rows: Sequence[Row], report: GraderReport
    ) -> list[_Scored]:
        timeout = getattr(g, "timeout_s", DEFAULT_TIMEOUT_S)
        requests: list[tuple[dict[str, Any], float] | None] = []
        for sample, row in zip(samples, rows, strict=True):
            requests.append(pool_request(g, sample, row.entry, timeout))
        if isinstance(g, PythonGrader):
            error = self._load(g)
            if error is not None:
                raise GraderFailure(f"grader {name}: {error}")
        asked = [r for r in requests if r is not None]
        answers = iter(self.pool().run(asked) if asked else [])
        # a request decided without the pool (a json grader's text that does not parse) scores 0
        decided = [next(answers) if r is not None else {"score": 0.0} for r in requests]
        return self._tally(name, decided, report, f"took longer than {timeout} s")

    def _score_over_http(
        self, name: str, g: HttpGrader, samples: list[Sample], rows: Sequence[Row], report: GraderReport
    ) -> list[_Scored]:
        bodies = [
            {"item": row.entry, "sample": sample.as_dict()} for sample, row in zip(samples, rows, strict=True)
        ]
        answers = post_all(g, self._token(g), bodies)
        return self._tally(name, answers, report, f"{g.url} took longer than {g.timeout_s} s")

    def _formula(self, g: MultiGrader) -> Any:
        if id(g) not in self._formulas:  # parsed once (the spec checked it), walked every batch
            self._formulas[id(g)] = formula.parse(g.formula, set(g.graders))
        return self._formulas[id(g)]

    def _scorer(self, g: ModelGrader) -> Scorer:
        if id(g) not in self._scorers:
            if self.scorer_factory is not None:
                self._scorers[id(g)] = self.scorer_factory(g)
            else:
                from workers.tasks.model_scorer import ModelScorer

                self._scorers[id(g)] = ModelScorer(g)
        return self._scorers[id(g)]

    def _score_with_model(
        self, name: str, g: ModelGrader, samples: list[Sample], rows: Sequence[Row], report: GraderReport
    ) -> list[_Scored]:
        template = g.input if g.kind == "reward_model" else g.prompt
        texts = [render(template, row.entry, sample) for sample, row in zip(samples, rows, strict=True)]
        try:
            scores = self._scorer(g).score(texts)
        except Exception as err:  # the model failed on the batch (out of memory, a bad checkpoint)
            failed = {"error": f"{g.model}: {type(err).__name__}: {err}"}
            return self._tally(name, [failed] * len(texts), report, "")
        no_number = {"error": f"{g.model}: the judge's answer held no number"}
        answers = [no_number if x is None else {"score": x} for x in scores]
        return self._tally(name, answers, report, "")

    def _tally(
        self, name: str, answers: list[dict[str, Any]], report: GraderReport, timed_out: str
    ) -> list[_Scored]:
        """Answers of the kinds that grade elsewhere (the pool, an http grader, a model), each
        ``{"score"}``, ``{"timeout"}`` or ``{"error"}``, as scores: a finite score clipped to [0, 1];
        anything else 0, counted in ``report`` and logged once per kind (``timed_out`` says how
        long was too long)."""
        out = []
        for answer in answers:
            score = answer.get("score")
            if isinstance(score, int | float) and not isinstance(score, bool) and math.isfinite(score):
                value = _unit(float(score))
                out.append(_Scored(value, value >= 1.0, True))
                continue
            if answer.get("timeout"):
                report.timeouts += 1
                self._log_once(name, "timeout", timed_out)
            else:
                report.errors += 1
                text = str(answer.get("error", answer))
                report.first_error = report.first_error or text
                self._log_once(name, "error", text)
            out.append(_Scored(0.0, False, True))
        return out

    def _token(self, g: HttpGrader) -> str | None:
        if id(g) not in self._tokens:
            self._tokens[id(g)] = http_token(g, self._base)
        return self._tokens[id(g)]

    def _log_once(self, name: str, kind: str, text: str) -> None:
        if (name, kind) not in self._logged:
            self._logged.add((name, kind))
            log.warning("grader %s: %s (scored 0; later ones are counted, not logged)", name, text)
