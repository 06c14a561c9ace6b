"""Mismatch of each recipe on the *same* weights: the controlled comparison behind docs/results.md.

Run means of ``token_mult_prob_error`` compare different training trajectories, and mismatch
depends on how sharp the policy is. Here one checkpoint's master weights go into each recipe's
trainer and generator, the generator samples the same prompts with the same seeds, and the
trainer scores them: only the precision recipe differs.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from rljob import metrics as m
from rljob.algorithms import RECIPES
from rljob.spec import JobSpec
from workers.algo.mismatch import mismatch_metrics
from workers.checkpoint import load_master_weights
from workers.engines.factory import native_pair
from workers.tasks import Task
from workers.tokenizer import build_tokenizer


def probe(spec: JobSpec, checkpoint: Path | None, batches: int = 5) -> dict[str, list[float]]:
    """``token_mult_prob_error`` per recipe, one value per rollout batch of the spec (batch ``b``
    samples step ``b``'s prompts with seed ``b``: the same for every recipe)."""
    tok = build_tokenizer(spec)
    task = Task(spec.task, tok=tok)
    state = None if checkpoint is None else load_master_weights(checkpoint)
    r = spec.rollout
    out: dict[str, list[float]] = {}
    for recipe in RECIPES:
        s = spec.model_copy(deep=True)
        s.precision.recipe = recipe
        trainer, gen = native_pair(s, tok.vocab_size, tok.eos_ids, tok.pad_id, state)
        values = []
        for b in range(batches):
            problems = [p for p in task.sample(b, r.prompts_per_step, r.seed) for _ in range(r.group_size)]
            batch = gen.generate(
                [tok.encode(task.prompt(p)) for p in problems], r.max_new_tokens, r.temperature, r.top_p, b
            )
            row = mismatch_metrics(
                trainer.logprobs(batch, r.temperature), batch.logprobs, batch.response_mask
            )
            values.append(row[m.TOKEN_MULT_PROB_ERROR])
        out[recipe] = values
    return out


def summary(values: dict[str, list[float]]) -> str:
    """One line per recipe: the mean over batches, their spread (sample std) and range."""
    lines = [f"{'recipe':<8} {'token_mult_prob_error':>22} {'std over batches':>17} {'min':>9} {'max':>9}"]
    for recipe, v in values.items():
        mean, std = statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)
        lines.append(f"{recipe:<8} {mean:>22.5f} {std:>17.5f} {min(v):>9.5f} {max(v):>9.5f}")
    return "\n".join(lines)
