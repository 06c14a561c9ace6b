"""Validation on held-out problems (``validation``): when it is due, and the ``val/*`` metrics of
one pass, sampled over the generators like a step's rollouts (:mod:`workers.rl.step`)."""

from __future__ import annotations

import time

from rljob import metrics as m
from rljob.metrics import ValidationMetrics
from rljob.spec import JobSpec
from workers.engines.batching import concat_rollouts, even_split
from workers.rl.protocol import StepContext
from workers.rl.step import generate, scores, truncated_fraction, unreadable_fraction
from workers.tasks import Problem


def validation_due(spec: JobSpec, step: int) -> bool:
    """Whether ``step`` ends with a validation: every ``validation.interval`` steps and the last."""
    interval = spec.validation.interval
    return interval > 0 and (step % interval == 0 or step == spec.steps)


def validate(ctx: StepContext, step: int) -> ValidationMetrics:
    """``val/*`` of the held-out problems: one response each, shared out between the generators
    like rollouts, at ``validation.temperature`` (0: greedy) with a seed fixed per step."""
    spec, task, tok, actors = ctx.spec, ctx.task, ctx.tok, ctx.actors
    t0 = time.perf_counter()
    problems = task.validation_problems()
    prompts = [tok.encode(task.prompt(p)) for p in problems]
    sizes = even_split(len(prompts), 1, actors.num_generators)
    # negative steps: seeds no rollout uses
    outs = generate(spec, actors, prompts, sizes, -step, spec.validation.temperature)
    batch = concat_rollouts([o.rollouts for o in outs], tok.pad_id)
    grades, _ = scores(task, tok, batch, problems)
    accuracy = sum(g.correct for g in grades) / len(grades)
    out: ValidationMetrics = {
        m.VAL_ACCURACY: accuracy,
        m.VAL_PASS_AT_1: accuracy,
        m.VAL_REWARD_MEAN: sum(g.reward for g in grades) / len(grades),
        m.VAL_TRUNCATED_FRACTION: truncated_fraction(batch, tok.eos_ids),
        m.VAL_UNREADABLE_FRACTION: unreadable_fraction(grades),
    }
    k = spec.validation.pass_k
    if k:
        out[m.VAL_PASS_AT_K] = pass_at_k(ctx, step, problems, prompts, k)
        out[m.VAL_PASS_K] = float(k)
    out[m.TIMING_VALIDATION_S] = time.perf_counter() - t0
    return out


def pass_at_k(
    ctx: StepContext, step: int, problems: list[Problem], prompts: list[list[int]], k: int
) -> float:
    """The share of ``problems`` with at least one fully correct response among ``k`` sampled at
    ``validation.pass_k_temperature`` (seeds of their own: step ``-step - 1_000_000``). With n = k
    samples, HumanEval's unbiased estimator 1 - C(n - c, k) / C(n, k) is 1 when c >= 1, else 0."""
    spec, task, tok, actors = ctx.spec, ctx.task, ctx.tok, ctx.actors
    repeated = [p for p in prompts for _ in range(k)]  # problem i's k prompts at i*k .. i*k+k-1
    sizes = even_split(len(prompts), k, actors.num_generators)
    outs = generate(spec, actors, repeated, sizes, -step - 1_000_000, spec.validation.pass_k_temperature)
    batch = concat_rollouts([o.rollouts for o in outs], tok.pad_id)
    grades, _ = scores(task, tok, batch, [p for p in problems for _ in range(k)])
    solved = [any(g.correct for g in grades[i * k : (i + 1) * k]) for i in range(len(problems))]
    return sum(solved) / len(problems)
