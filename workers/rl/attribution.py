"""Per-layer attribution of the train/generation mismatch, online (``precision.mismatch_slo``).

Every ``attribution_interval`` RL steps, and at once in the step where the SLO is breached, the
job traces a few of the step's sequences both ways, as ``fp8rl layer-diff`` does offline
(:mod:`workers.engines.layer_diff`): generator 0 decodes the response over its KV cache, the
trainer runs one forward, and each keeps every module's output at the traced token. A decoder
layer's contribution is how much it grows the relative divergence of the two hidden states
(:func:`~workers.engines.layer_diff.layer_contributions`); the contributions of the traced tokens
are averaged.

Which tokens: the sequences whose largest per-token log-prob difference (trainer before the
update against generator) is largest, one per sequence, traced at that token. Both engines hold
the weights after the step's sync when they are traced: the attribution is that of the policy
the next batch is generated with.

Only the native engines can be traced (vLLM runs its model in worker processes, Megatron-Core's
modules are not Hugging Face's): :func:`traceable` says whether a job's engines can.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rljob.spec import JobSpec
from workers.engines.layer_diff import layer_contributions
from workers.engines.protocols import Rollouts
from workers.rl.protocol import StepActors


class Probe(NamedTuple):
    """One token to trace: the unpadded ``prompt`` and the response up to and including it."""

    prompt: torch.Tensor  # [P] token ids
    response: torch.Tensor  # [j + 1] token ids, the traced token last
    logprob_diff: float  # |trainer - generator| log-prob of that token when the batch was trained


def traceable(spec: JobSpec) -> bool:
    """Whether both engines can be traced (the native generator and the native trainer)."""
    r = spec.resources
    return r.generator_engine == "native" and r.trainer_engine == "native"


def probes_of(batch: Rollouts, logp_train: torch.Tensor, count: int) -> tuple[Probe, ...]:
    """The ``count`` sequences of ``batch`` whose largest |log-prob difference| is largest, each at
    that token (ties: the earlier row, the earlier position). ``logp_train`` [B, L]: the trainer's
    log-probs of the batch's tokens before the update."""
    mask = batch.response_mask != 0  # [B, L]
    diff = torch.where(mask, (logp_train.double() - batch.logprobs.double()).abs(), -1.0)  # [B, L]
    best, position = diff.max(dim=1)  # [B] first maximum of each row
    order = sorted(range(best.numel()), key=lambda row: (-float(best[row]), row))
    probes = []
    for row in order[:count]:
        if float(best[row]) < 0:  # no response token in this row
            continue
        j = int(position[row])
        prompt = batch.prompt_ids[row][batch.prompt_mask[row] != 0]
        probes.append(Probe(prompt, batch.response_ids[row, : j + 1], float(best[row])))
    return tuple(probes)


def attribute(actors: StepActors, probes: tuple[Probe, ...]) -> list[float]:
    """Each decoder layer's contribution to the mismatch, the mean over ``probes`` (trainer 0 and
    generator 0; an empty list without probes)."""
    return mean_contributions(
        [layer_contributions(*actors.trace_token(0, p.prompt, p.response)) for p in probes]
    )


def mean_contributions(per_token: list[list[float]]) -> list[float]:
    """Each layer's contribution averaged over the traced tokens (those whose trace held no
    decoder layer left out; the layers all of them hold); an empty list without any."""
    per_token = [c for c in per_token if c]
    if not per_token:
        return []
    layers = min(len(c) for c in per_token)
    return [sum(c[i] for c in per_token) / len(per_token) for i in range(layers)]


def worst_layers(contributions: list[float], count: int) -> list[int]:
    """The ``count`` layers with the largest contributions, largest first."""
    return sorted(range(len(contributions)), key=lambda i: (-contributions[i], i))[:count]
