"""The GRPO objective of one micro-batch, assembled from the pure pieces of this package.

    loss_t = w_t * ppo_t(logp, logp_old, A) + beta * kl_t(logp, logp_ref)
    loss   = aggregate(loss_t, mask, mode) * units(micro-batch) / units(batch)

``w_t`` is the importance-sampling correction between the trainer (``logp_old``, the weights that
generated) and the generator (``logp_gen``); ``ppo_t`` the clipped surrogate; ``units`` are valid
tokens (``token-mean``) or sequences with a valid token (``seq-mean-token-mean``). Scaling by the
unit share makes the sum of micro-batch gradients equal to the gradient of the whole batch, so
micro-batching and data parallelism never change the update.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rljob.spec import AlgorithmSpec
from workers.algo.importance import importance_weights
from workers.algo.losses import aggregate, clipped_policy_loss, kl_penalty


class GrpoLoss(NamedTuple):
    """``loss``: scalar to backpropagate; the rest are sums over the micro-batch's valid tokens."""

    loss: torch.Tensor
    clipped_tokens: float
    is_weight_sum: float
    is_weight_max: float
    kl_sum: float


def loss_units(mask: torch.Tensor, mode: str) -> int:
    """How many units ``aggregate`` averages over: tokens or non-empty sequences. ``mask [B, L]``."""
    if mode == "token-mean":
        return int(mask.sum().item())
    return int((mask.sum(-1) > 0).sum().item())


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_gen: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmSpec,
    total_units: int,
    logp_ref: torch.Tensor | None = None,
) -> GrpoLoss:
    """GRPO loss of a micro-batch (shapes ``[B, L]``, ``advantages [B]``), see the module docstring."""
    terms = clipped_policy_loss(logp, logp_old, advantages, cfg.clip_low, cfg.clip_high)
    isc = importance_weights(
        logp_old,
        logp_gen,
        mask,
        cfg.importance_sampling.mode,
        cfg.importance_sampling.low,
        cfg.importance_sampling.high,
    )
    per_token = terms.loss * isc.weights  # [B, L]
    kl_sum = 0.0
    if cfg.kl.coef > 0 and logp_ref is not None:
        kl = kl_penalty(logp, logp_ref, cfg.kl.kind)  # [B, L]
        per_token = per_token + cfg.kl.coef * kl
        kl_sum = float(torch.where(mask > 0, kl.detach(), torch.zeros_like(kl)).sum())
    share = loss_units(mask, cfg.loss_aggregation) / max(total_units, 1)
    loss = aggregate(per_token, mask, cfg.loss_aggregation) * share
    valid = mask > 0
    weights = torch.where(valid, isc.weights, torch.zeros_like(isc.weights))
    return GrpoLoss(
        loss=loss,
        clipped_tokens=float(torch.where(valid, terms.clipped, torch.zeros_like(terms.clipped)).sum()),
        is_weight_sum=float(weights.sum()),
        is_weight_max=float(weights.max()) if bool(valid.any()) else 0.0,
        kl_sum=kl_sum,
    )
