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
from rljob.spec import JobSpec, Recipe
from workers.algo.mismatch import mismatch_metrics
from workers.engines.factory import native_pair
from workers.models.checkpoint import load_master_weights
from workers.models.tokenizer import build_tokenizer
from workers.rl.step import prompt_batch
from workers.tasks import Task

KV_MODES = {
    "off": "",  # the spec's KV cache off
    "on": "+fp8kv",  # FP8 KV cache, the trainer reading K/V as the cache holds them
    "bf16-attn": "+fp8kv-bf16attn",  # FP8 KV cache, the trainer attending over BF16 K/V
}


def probe(
    spec: JobSpec,
    checkpoint: Path | None,
    batches: int = 5,
    kv_modes: tuple[str, ...] | None = None,
    recipes: tuple[Recipe, ...] = RECIPES,
) -> dict[str, list[float]]:
    """``token_mult_prob_error`` per recipe of ``recipes`` (and FP8 KV-cache mode: ``kv_modes`` from
    :data:`KV_MODES`; default: the spec's own setting), one value per rollout batch of the spec
    (batch ``b`` samples step ``b``'s prompts with seed ``b``: the same for every variant). With an
    FP8 KV cache the trainer calibrates the scales on each batch's prompts and the generator loads
    them, as a job does before its first rollout."""
    tok = build_tokenizer(spec)
    task = Task.for_job(spec, tok)
    state = None if checkpoint is None else load_master_weights(checkpoint)
    r = spec.rollout
    modes = kv_modes or (("on" if spec.precision.fp8_kv_cache else "off"),)
    out: dict[str, list[float]] = {}
    for recipe in recipes:
        for mode in modes:
            s = spec.model_copy(deep=True)
            s.precision.recipe = recipe
            s.precision.fp8_kv_cache = mode != "off"
            s.precision.fp8_kv_cache_in_training = mode == "on"
            trainer, gen = native_pair(s, tok.vocab_size, tok.eos_ids, tok.pad_id, state)
            values = []
            for b in range(batches):
                problems = [
                    p for p in task.sample(b, r.prompts_per_step, r.seed) for _ in range(r.group_size)
                ]
                prompts = [tok.encode(task.prompt(p)) for p in problems]
                if s.precision.fp8_kv_cache:
                    trainer.calibrate_kv(prompt_batch(prompts, tok.pad_id))
                    gen.load_weights(trainer.export_weights(gen.fp8_weight_names()))
                batch = gen.generate(prompts, r.max_new_tokens, r.temperature, r.top_p, b)
                row = mismatch_metrics(
                    trainer.logprobs(batch, r.temperature), batch.logprobs, batch.response_mask
                )
                values.append(row[m.TOKEN_MULT_PROB_ERROR])
            out[recipe + KV_MODES[mode]] = values
    return out


def summary(values: dict[str, list[float]]) -> str:
    """One line per variant: the mean over batches, their median, spread (sample std) and range."""
    w = max(8, *(len(k) for k in values))
    lines = [
        f"{'variant':<{w}} {'token_mult_prob_error':>22} {'median':>9} {'std over batches':>17} "
        f"{'min':>9} {'max':>9}"
    ]
    for recipe, v in values.items():
        mean, std = statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)
        lines.append(
            f"{recipe:<{w}} {mean:>22.5f} {statistics.median(v):>9.5f} {std:>17.5f} "
            f"{min(v):>9.5f} {max(v):>9.5f}"
        )
    return "\n".join(lines)
