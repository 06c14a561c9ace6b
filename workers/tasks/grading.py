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

import json
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
    CodeGrader,
    HttpGrader,
    JsonGrader,
    MathGrader,
    ModelGrader,
    MultiGrader,
    NumericGrader,
    PythonGrader,
    StringCheckGrader,
    grader_name,
)
from workers.tasks.answers import parse_number, read_answer, same_answer
from workers.tasks.sandbox import GraderPool, Launcher
from workers.tasks.templates import Sample, parses_as_json, render

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0  # a regex or a JSON Schema in the pool, and math, when the grader sets none
_FENCE_START = "```"


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


def code_program(prompt: str, completion: str) -> str:
    """The program a ``code`` grader runs: the completion's first fenced block (a whole program;
    after the prompt, so the prompt's imports hold and the block's definition wins), else the prompt
    continued by the completion (HumanEval's convention)."""
    start = completion.find(_FENCE_START)
    if start >= 0:
        body_start = completion.find("\n", start)
        end = completion.find(_FENCE_START, body_start + 1) if body_start >= 0 else -1
        if body_start >= 0:
            block = completion[body_start + 1 : end if end >= 0 else len(completion)]
            return f"{prompt}\n{block}"
    return prompt + completion


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
        self._pool: GraderPool | None = None
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
        return any(needs_pool(g) for g in self._all())

    def pool(self) -> GraderPool:
        """The sandbox pool, started on first use."""
        if self._pool is None:
            memory = max((g.memory_mb for g in self._all() if hasattr(g, "memory_mb")), default=512)
            self._pool = GraderPool(self.pool_size, memory, self.launcher)
            log.info("graders run in %d %s", self._pool.size, self._pool.launcher.how)
        return self._pool

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
            tree = formula.parse(g.formula, set(g.graders))
            out = []
            for i in range(len(samples)):
                value = formula.evaluate(tree, {child: s[i].score for child, s in children.items()})
                score = _unit(value) if math.isfinite(value) else 0.0
                out.append(_Scored(score, score >= 1.0, all(s[i].readable for s in children.values())))
        elif isinstance(g, HttpGrader):
            out = self._score_over_http(name, g, samples, rows, report)
        elif isinstance(g, ModelGrader):
            out = self._score_with_model(name, g, samples, rows, report)
        elif needs_pool(g):
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
        raise TypeError(f"no in-process scoring for grader type {g.type!r}")  # _uses_pool routes the rest

    def _score_in_pool(
        self, name: str, g: Any, samples: list[Sample], rows: Sequence[Row], report: GraderReport
    ) -> list[_Scored]:
        timeout = getattr(g, "timeout_s", DEFAULT_TIMEOUT_S)
        requests: list[tuple[dict[str, Any], float] | None] = []
        for sample, row in zip(samples, rows, strict=True):
            requests.append(self._request(g, sample, row.entry, timeout))
        if isinstance(g, PythonGrader):
            error = self._load(g)
            if error is not None:
                raise GraderFailure(f"grader {name}: {error}")
        asked = [r for r in requests if r is not None]
        answers = iter(self.pool().run(asked) if asked else [])
        out = []
        for request in requests:
            if request is None:  # decided without the pool (a json grader's text that does not parse)
                out.append(_Scored(0.0, False, True))
                continue
            answer = next(answers)
            if (
                "score" in answer
                and isinstance(answer["score"], int | float)
                and math.isfinite(answer["score"])
            ):
                score = _unit(float(answer["score"]))
                out.append(_Scored(score, score >= 1.0, True))
                continue
            if answer.get("timeout"):
                report.timeouts += 1
                self._log_once(name, "timeout", f"took longer than {timeout} s")
            else:
                report.errors += 1
                text = str(answer.get("error", answer))
                report.first_error = report.first_error or text
                self._log_once(name, "error", text)
            out.append(_Scored(0.0, False, True))
        return out

    def _score_over_http(
        self, name: str, g: HttpGrader, samples: list[Sample], rows: Sequence[Row], report: GraderReport
    ) -> list[_Scored]:
        from concurrent.futures import ThreadPoolExecutor

        import httpx

        token = self._token(g)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        limits = httpx.Limits(max_connections=g.max_concurrency)
        with httpx.Client(timeout=g.timeout_s, headers=headers, limits=limits) as client:

            def one(pair: tuple[Sample, Row]) -> dict[str, Any]:
                sample, row = pair
                return _post(client, g, {"item": row.entry, "sample": sample.as_dict()})

            with ThreadPoolExecutor(g.max_concurrency) as pool:
                answers = list(pool.map(one, zip(samples, rows, strict=True)))
        out = []
        for answer in answers:
            if "score" in answer:
                score = _unit(answer["score"])
                out.append(_Scored(score, score >= 1.0, True))
                continue
            if answer.get("timeout"):
                report.timeouts += 1
                self._log_once(name, "timeout", f"{g.url} took longer than {g.timeout_s} s")
            else:
                report.errors += 1
                report.first_error = report.first_error or str(answer["error"])
                self._log_once(name, "error", str(answer["error"]))
            out.append(_Scored(0.0, False, True))
        return out

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
            scores: list[float | None] = self._scorer(g).score(texts)
        except Exception as err:  # the model failed on the batch (out of memory, a bad checkpoint)
            text = f"{g.model}: {type(err).__name__}: {err}"
            scores = [None] * len(texts)
            report.first_error = report.first_error or text
            self._log_once(name, "model", text)
        out = []
        for score in scores:
            if score is None:
                report.errors += 1
                report.first_error = report.first_error or f"{g.model}: the judge's answer held no number"
                out.append(_Scored(0.0, False, True))
            else:
                value = _unit(score)
                out.append(_Scored(value, value >= 1.0, True))
        return out

    def _token(self, g: HttpGrader) -> str | None:
        if id(g) not in self._tokens:
            self._tokens[id(g)] = _http_token(g, self._base)
        return self._tokens[id(g)]

    def _request(
        self, g: Any, sample: Sample, item: dict[str, Any], timeout: float
    ) -> tuple[dict[str, Any], float] | None:
        if isinstance(g, PythonGrader):
            return {
                "op": "grade",
                "key": str(id(g)),
                "sample": sample.as_dict(),
                "item": item,
                "cpu_s": timeout,
            }, timeout
        if isinstance(g, MathGrader):
            request: dict[str, Any] = {
                "op": "math",
                "input": render(g.input, item, sample),
                "reference": render(g.reference, item, sample),
            }
            return {**request, "cpu_s": timeout}, timeout
        if isinstance(g, CodeGrader):
            program = code_program(render(g.prompt, item, sample), render(g.input, item, sample))
            request = {
                "op": "code",
                "program": program,
                "test": render(g.test, item, sample),
                "entry_point": render(g.entry_point, item, sample),
                "score": g.score,
                "cpu_s": timeout,
            }
            return request, timeout
        if isinstance(g, StringCheckGrader):  # regex
            pattern, text = render(g.reference, item, sample), render(g.input, item, sample)
            regex = {"op": "regex", "pattern": pattern, "text": text, "ignore_case": g.ignore_case}
            return {**regex, "cpu_s": timeout}, timeout
        if isinstance(g, JsonGrader):  # with a schema
            ok, value = parses_as_json(render(g.input, item, sample))
            if not ok:
                return None
            return {"op": "schema", "schema": g.json_schema, "value": value, "cpu_s": timeout}, timeout
        raise TypeError(f"grader type {g.type!r} does not run in the pool")

    def _log_once(self, name: str, kind: str, text: str) -> None:
        if (name, kind) not in self._logged:
            self._logged.add((name, kind))
            log.warning("grader %s: %s (scored 0; later ones are counted, not logged)", name, text)


def needs_pool(g: Any) -> bool:
    """Whether grader ``g`` (not a multi) runs in the sandbox pool (the module docstring)."""
    if isinstance(g, PythonGrader | CodeGrader | MathGrader):
        return True
    if isinstance(g, StringCheckGrader):
        return g.operation == "regex"
    if isinstance(g, JsonGrader):
        return g.json_schema is not None
    return False


@dataclass(frozen=True)
class _OneRow:
    entry: dict[str, Any]
    answer: str


def _one(
    graders: list[Any], item: dict[str, Any], launcher: Launcher | None, base: Path | None
) -> tuple[Graders, _OneRow]:
    answer = item.get("answer")
    row = _OneRow(item, "" if answer is None else str(answer))
    built = Graders(
        graders,
        lambda text, r: float(same_answer(text, r.answer)),
        pool_size=1,
        launcher=launcher,
        max_error_fraction=1.0,
        base=base,
    )
    return built, row


def grade_one(
    graders: list[Any],
    item: dict[str, Any],
    output_text: str,
    launcher: Launcher | None,
    base: Path | None = None,
) -> dict[str, Any]:
    """``graders`` (a task's: the reward is their weighted mean) on one sample: ``{"reward",
    "graders": {name: {"score", "error", "timeout"}}}`` (a multi grader's children as
    ``<multi>.<child>``). ``launcher``: how a pool starts, for the kinds that need one (None: they
    are refused); the pool is this call's alone. An ``answer`` grader compares with the row's
    ``answer`` as a data file's rows are compared."""
    built, row = _one(graders, item, launcher, base)
    try:
        if launcher is None and built.sandboxed:
            raise ValueError("this grader runs in the grader sandbox, and none is available here")
        [graded], reports = built.grade([output_text], [row])
    finally:
        built.close()
    return {
        "reward": graded.reward,
        "graders": {
            name: {
                "score": r.scores[0] if r.scores else 0.0,
                "error": r.first_error,
                "timeout": r.timeouts > 0,
            }
            for name, r in reports.items()
        },
    }


def check_one(graders: list[Any], launcher: Launcher | None, base: Path | None = None) -> list[str]:
    """What :meth:`Graders.check` finds wrong with ``graders`` (python graders loaded in a pool of
    their own when ``launcher`` is given; without one only JSON Schemas are checked)."""
    built, _ = _one(graders, {}, launcher, base)
    try:
        return built.check(load_code=launcher is not None, read_tokens=False)
    finally:
        built.close()


def _http_token(g: HttpGrader, base: Path | None) -> str | None:
    """An http grader's bearer token: its ``token_file``, or the file the operator mounts for its
    ``token_secret``; None without either."""
    if g.token_secret is not None:
        path = Path(g.token_secret.path())
        if not path.is_file():
            raise ValueError(
                f"an http grader's token_secret {g.token_secret.name}/{g.token_secret.key} is mounted by "
                f"the operator on Kubernetes ({path}), and is not here; outside Kubernetes give token_file"
            )
    elif g.token_file is not None:
        path = Path(g.token_file) if base is None or Path(g.token_file).is_absolute() else base / g.token_file
    else:
        return None
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"an http grader's token file cannot be read: {err}") from None
    if not token or any(c in token for c in "\r\n"):
        raise ValueError(f"an http grader's token file {path} holds no token on one line")
    return token


RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


def _post(client: Any, g: HttpGrader, body: dict[str, Any]) -> dict[str, Any]:
    """One sample to an http grader, with its retries (after 0.1, 0.2, 0.4 ... s): ``{"score"}``,
    ``{"error"}`` or ``{"timeout"}``."""
    import httpx

    last: dict[str, Any] = {"error": "no answer"}
    for attempt in range(g.retries + 1):
        if attempt:
            time.sleep(0.1 * 2 ** (attempt - 1))
        try:
            r = client.post(g.url, json=body)
        except httpx.TimeoutException:
            last = {"timeout": True}
            continue
        except httpx.HTTPError as err:
            last = {"error": f"{g.url}: {type(err).__name__}: {err}"}
            continue
        if r.status_code in RETRY_STATUS:
            last = {"error": f"{g.url} answered {r.status_code}"}
            continue
        if r.status_code >= 400:
            return {"error": f"{g.url} answered {r.status_code}: {r.text[:200]}"}
        try:
            value = r.json()
        except ValueError:
            return {"error": f"{g.url} answered {r.text[:200]!r}, not JSON"}
        score = value.get("score") if isinstance(value, dict) else value
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
            shown = json.dumps(value)[:200]
            return {"error": f'{g.url} answered {shown}: expected {{"score": <number>}}'}
        return {"score": float(score)}
    return last
