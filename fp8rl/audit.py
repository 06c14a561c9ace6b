"""``fp8rl audit``: a job's quantization audit with the input statistics of every linear layer.

Builds the job's policy as its generator (or trainer) converts it, takes ``prompts`` of the task's
prompts (right-padded, so pads change no real token's activations), runs one forward with hooks
(:func:`workers.fp8.input_stats.measure_inputs`) and prints the audit table: per layer its
precision, kernels, max |W|, max |x| and outlier ratio (max over input channels of
max|x| / p99.9|x|, nearest rank), then the layers with the largest ratios.
"""

from __future__ import annotations

import torch

from rljob.spec import JobSpec
from workers.engines.models import DTYPES, apply_recipe, build_policy
from workers.fp8.convert import Fp8Audit
from workers.fp8.input_stats import MIN_TOKENS, measure_inputs
from workers.models.tokenizer import build_tokenizer
from workers.tasks import Task


def calibrated_audit(spec: JobSpec, prompts: int = 32, seed: int = 0, role: str = "generator") -> Fp8Audit:
    """The audit of the job's ``role`` model with input statistics on ``prompts`` task prompts."""
    tok = build_tokenizer(spec)
    task = Task.for_job(spec, tok)
    model = build_policy(spec, tok.vocab_size, DTYPES[spec.precision.master_dtype], "cpu")
    audit = apply_recipe(model, spec.precision, role)
    texts = [tok.encode(task.prompt(p)) for p in task.sample(0, prompts, seed)]
    length = max(len(t) for t in texts)
    ids = torch.full((len(texts), length), tok.pad_id, dtype=torch.long)  # [B, L]
    mask = torch.zeros(len(texts), length, dtype=torch.long)  # [B, L]
    for i, t in enumerate(texts):
        ids[i, : len(t)] = torch.tensor(t)
        mask[i, : len(t)] = 1
    stats = measure_inputs(model, ids, mask)
    tokens = int(mask.sum())
    note = "" if tokens >= MIN_TOKENS else f" (under {MIN_TOKENS} tokens every ratio is 1: more --prompts)"
    return audit.with_inputs(stats, f"{prompts} task prompts, {tokens} tokens{note}")


def report(spec: JobSpec, prompts: int = 32, seed: int = 0, role: str = "generator", top: int = 10) -> str:
    audit = calibrated_audit(spec, prompts, seed, role)
    lines = [audit.format(), "", f"top {top} outlier ratios:"]
    lines += [
        f"  {r.name:<44} {r.outlier_ratio:>8.3g}  channel {r.outlier_channel:<5} "
        f"max|x| {r.input_amax:.3g}  max|W| {r.weight_amax:.3g}"
        for r in audit.top_outliers(top)
    ]
    return "\n".join(lines)
