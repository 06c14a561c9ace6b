"""``fp8rl layer-diff``: where a job's generator and trainer part, module by module.

Builds the job's native trainer (initial weights or a checkpoint's) and a native generator loaded
from it as after a weight sync, samples one batch of the task's prompts, takes the token whose
log-probs differ most between the two engines, and traces that token through both
(:mod:`workers.engines.layer_diff`): the generator's prefill + KV-cache decode against the
trainer's full-sequence forward. The first module whose output differs is where the mismatch that
importance sampling corrects comes from; under ``precision.exact`` no token and no module differs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rljob.spec import JobSpec
from workers.engines.factory import native_pair
from workers.engines.layer_diff import compare_traces, describe, layer_contributions
from workers.models.checkpoint import load_master_weights
from workers.models.tokenizer import build_tokenizer
from workers.rl.attribution import mean_contributions, probes_of, worst_layers
from workers.tasks import Task


def report(
    spec: JobSpec, checkpoint: Path | None = None, prompts: int = 8, seed: int = 0, tokens: int = 1
) -> str:
    """The comparison as text: the batch's differing tokens, the decoder layers that add most to
    the divergence (averaged over the ``tokens`` most-differing tokens, one per response, as the
    job's online attribution does), then one line per module of the most-differing token."""
    tok, r = build_tokenizer(spec), spec.rollout
    task = Task.for_job(spec, tok)
    state = None if checkpoint is None else load_master_weights(checkpoint)
    trainer, gen = native_pair(spec, tok.vocab_size, tok.eos_ids, tok.pad_id, state)
    texts = [tok.encode(task.prompt(p)) for p in task.sample(1, prompts, r.seed)]
    batch = gen.generate(texts, r.max_new_tokens, r.temperature, r.top_p, seed)
    logp = trainer.logprobs(batch, r.temperature)  # [B, L]
    diff = (logp - batch.logprobs).abs() * batch.response_mask  # [B, L]
    valid = int(batch.response_mask.sum())
    differing = int((diff > 0).sum())
    row, pos = divmod(int(diff.argmax()), diff.shape[1])
    prompt = batch.prompt_ids[row][batch.prompt_mask[row] != 0]
    response = batch.response_ids[row, : pos + 1]
    gen_trace, train_trace = gen.trace_token(prompt, response), trainer.trace_token(prompt, response)
    diffs = compare_traces(gen_trace, train_trace)
    per_token = [layer_contributions(gen_trace, train_trace)]
    others = [
        p for p in probes_of(batch, logp, tokens)
        if not (torch.equal(p.prompt, prompt) and torch.equal(p.response, response))
    ]  # fmt: skip
    for probe in others[: tokens - 1]:  # the most-differing token is traced above
        per_token.append(
            layer_contributions(gen.trace_token(probe.prompt, probe.response),
                                trainer.trace_token(probe.prompt, probe.response))
        )  # fmt: skip
    shares = mean_contributions(per_token)
    worst = worst_layers(shares, 3)
    lines = [
        f"recipe {spec.precision.recipe}, exact {str(spec.precision.exact).lower()}: "
        f"{differing} of {valid} sampled tokens have differing log-probs",
        f"largest: row {row}, response position {pos}, |trainer - generator| = {float(diff.max()):.3g}",
        describe(diffs) if differing else f"no sampled token differs; traced: row {row}, position {pos}",
        f"decoder layers that add most to the divergence, over {len(per_token)} token(s) (as the job's "
        "per-layer attribution measures it): "
        + (", ".join(f"{i} ({shares[i]:+.3g})" for i in worst) if shares else "none"),
        f"{'module':<48} {'max |diff|':>11}  equal",
    ]
    lines += [f"{d.name:<48} {d.max_abs_diff:>11.3g}  {'yes' if d.equal else 'NO'}" for d in diffs]
    return "\n".join(lines)
