"""``fp8rl layer-diff``: where a job's generator and trainer part, module by module.

Builds the job's native trainer (initial weights or a checkpoint's) and a native generator loaded
from it as after a weight sync, samples one batch of the task's prompts, takes the token whose
log-probs differ most between the two engines, and traces that token through both
(:mod:`workers.engines.layer_diff`): the generator's prefill + KV-cache decode against the
trainer's full-sequence forward. The first module whose output differs is where the mismatch that
importance sampling corrects comes from; under ``precision.exact`` no token and no module differs.

With ``--swap`` (:func:`swap_report`) it measures instead what the mismatch SLO's ``bf16-layers``
action would buy: for each decoder layer, the traced tokens' log-prob gap with that layer in BF16 in
both engines (``precision.bf16_layers``), against the gap with the job's own layers.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from rljob.spec import JobSpec
from workers.engines.factory import native_generator, native_pair, native_trainer
from workers.engines.layer_diff import Trace, compare_traces, describe, layer_contributions
from workers.engines.native.generator import NativeGenerator
from workers.engines.native.trainer import NativeTrainer
from workers.engines.protocols import Rollouts
from workers.models.checkpoint import load_master_weights
from workers.models.tokenizer import Tokenizer, build_tokenizer
from workers.rl.attribution import mean_contributions, probes_of, worst_layers
from workers.tasks import Task


def report(
    spec: JobSpec, checkpoint: Path | None = None, prompts: int = 8, seed: int = 0, tokens: int = 1
) -> str:
    """The comparison as text: the batch's differing tokens, the decoder layers that add most to
    the divergence (averaged over the ``tokens`` most-differing tokens, one per response, as the
    job's online attribution does), then one line per module of the most-differing token."""
    trainer, gen, batch, logp = _sampled(spec, build_tokenizer(spec), _state(checkpoint), prompts, seed)
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


def _state(checkpoint: Path | None) -> dict[str, torch.Tensor] | None:
    return None if checkpoint is None else load_master_weights(checkpoint)


def _sampled(
    spec: JobSpec, tok: Tokenizer, state: dict[str, torch.Tensor] | None, prompts: int, seed: int
) -> tuple[NativeTrainer, NativeGenerator, Rollouts, torch.Tensor]:
    """The job's native pair, one sampled batch of ``prompts`` task prompts and the trainer's
    log-probs of it ``[B, L]``."""
    r = spec.rollout
    task = Task.for_job(spec, tok)
    trainer, gen = native_pair(spec, tok.vocab_size, tok.eos_ids, tok.pad_id, state)
    texts = [tok.encode(task.prompt(p)) for p in task.sample(1, prompts, r.seed)]
    batch = gen.generate(texts, r.max_new_tokens, r.temperature, r.top_p, seed)
    return trainer, gen, batch, trainer.logprobs(batch, r.temperature)


def traced_logprob(trace: Trace, token: int, temperature: float) -> float:
    """The log-prob of ``token`` from a trace's logits (``lm_head``'s output at the traced query),
    in float64."""
    logits = trace["lm_head"].double().flatten() / temperature
    return float(torch.log_softmax(logits, dim=-1)[token])


def swap_report(
    spec: JobSpec, checkpoint: Path | None = None, prompts: int = 8, seed: int = 0, tokens: int = 1
) -> str:
    """What moving one decoder layer to BF16 buys, layer by layer: samples a batch as
    :func:`report` does, takes the ``tokens`` most-differing tokens (one per response, the job's
    attribution probes), and traces each through a pair built with that layer added to
    ``precision.bf16_layers`` (both engines, as the ``bf16-layers`` action does). Lists the traced
    tokens, then the layers by how much they lower the tokens' mean ``|trainer - generator|``
    log-prob, largest first, with the mean ``exp|gap|`` (``token_mult_prob_error`` over them)."""
    p = spec.precision
    if p.recipe == "bf16":
        raise ValueError("--swap: recipe bf16 has no FP8 layer to move; use fp8-gen or fp8-e2e")
    state, tok = _state(checkpoint), build_tokenizer(spec)
    trainer, gen, batch, logp = _sampled(spec, tok, state, prompts, seed)
    probes = probes_of(batch, logp, tokens)
    temperature = spec.rollout.temperature

    def logprobs(engine: NativeTrainer | NativeGenerator) -> list[float]:
        traces = (engine.trace_token(q.prompt, q.response) for q in probes)
        return [
            traced_logprob(t, int(q.response[-1]), temperature) for t, q in zip(traces, probes, strict=True)
        ]

    def gaps(trained: list[float], generated: list[float]) -> list[float]:
        return [abs(a - b) for a, b in zip(trained, generated, strict=True)]

    def summary(values: list[float]) -> str:
        mean = sum(values) / len(values)
        mult = sum(math.exp(v) for v in values) / len(values)
        return f"mean |gap| {mean:.3f}, mean exp|gap| {mult:.3f}"

    trained = logprobs(trainer)
    base = gaps(trained, logprobs(gen))
    layers = int(trainer.model.config.num_hidden_layers)
    kept = p.bf16_decoder_layers(layers)
    lines = [
        f"recipe {p.recipe}: {len(probes)} traced token(s), the responses' most-differing "
        f"(|trainer - generator| log-prob in the batch, then traced alone):"
    ]
    for q, gap in zip(probes, base, strict=True):
        text = tok.decode([int(q.response[-1])])
        lines.append(
            f"  response position {q.response.numel() - 1}, token {int(q.response[-1])} {text!r}: "
            f"{q.logprob_diff:.3f} in the batch, {gap:.3f} alone"
        )  # fmt: skip
    lines.append(f"with the job's layers ({sorted(kept) or 'none'} BF16): {summary(base)}")
    rows = []
    for i in sorted(set(range(layers)) - kept):
        moved = spec.model_copy(
            update={"precision": p.model_copy(update={"bf16_layers": (*p.bf16_layers, i)})}
        )
        # only fp8-e2e's trainer computes in FP8; under fp8-gen bf16_layers leaves it as it is, so
        # its traces of the job's pair stand
        t = native_trainer(moved, tok.vocab_size, state) if p.recipe == "fp8-e2e" else trainer
        generated = logprobs(native_generator(moved, t, tok.vocab_size, tok.eos_ids, tok.pad_id))
        swapped = gaps(trained if t is trainer else logprobs(t), generated)
        rows.append((sum(base) / len(base) - sum(swapped) / len(swapped), i, swapped))
    rows.sort(key=lambda row: (-row[0], row[1]))
    lines.append("decoder layer moved to BF16, by how much it lowers the mean |gap| (largest first):")
    lines += [f"  layer {i:>3}: {drop:+.3f}  ({summary(swapped)})" for drop, i, swapped in rows]
    return "\n".join(lines)
