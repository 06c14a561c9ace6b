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
    """``loss``: scalar to backpropagate; the rest are sums over the micro-batch's valid tokens.

    Every field is a 0-d tensor on the loss's device: reading them is the caller's choice, so a
    training step can add them up on the GPU and read them once.
    """

    loss: torch.Tensor
    clipped_tokens: torch.Tensor
    is_weight_sum: torch.Tensor
    is_weight_max: torch.Tensor
    kl_sum: torch.Tensor


def loss_units(mask: torch.Tensor, mode: str) -> int:
    """How many units ``aggregate`` averages over: tokens or non-empty sequences. ``mask [B, L]``.

    Reads the count back: call it on a host (CPU) mask, :func:`loss_units_tensor` on a device one.
    """
    return int(loss_units_tensor(mask, mode).item())


def loss_units_tensor(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """:func:`loss_units` as a float32 0-d tensor on ``mask``'s device (no host read)."""
    if mode == "token-mean":
        return mask.sum().to(torch.float32)
    return (mask.sum(-1) > 0).sum().to(torch.float32)


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_gen: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmSpec,
    total_units: int | torch.Tensor,
    logp_ref: torch.Tensor | None = None,
) -> GrpoLoss:
    """GRPO loss of a micro-batch (shapes ``[B, L]``, ``advantages [B]``), see the module docstring.

    ``total_units``: units of the whole (mini)batch over every trainer, an int or a 0-d tensor.
    """
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
    valid = mask > 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    kl_sum = zero
    if cfg.kl.coef > 0 and logp_ref is not None:
        kl = kl_penalty(logp, logp_ref, cfg.kl.kind)  # [B, L]
        per_token = per_token + cfg.kl.coef * kl
        kl_sum = torch.where(valid, kl.detach(), zero).sum()
    total = total_units.clamp(min=1.0) if isinstance(total_units, torch.Tensor) else max(total_units, 1)
    share = loss_units_tensor(mask, cfg.loss_aggregation).to(logp.dtype) / total
    loss = aggregate(per_token, mask, cfg.loss_aggregation) * share
    weights = torch.where(valid, isc.weights, zero)  # IS weights are >= 0: max over none is 0
    return GrpoLoss(
        loss=loss,
        clipped_tokens=torch.where(valid, terms.clipped, zero).sum(),
        is_weight_sum=weights.sum(),
        is_weight_max=weights.max() if weights.numel() else zero,
        kl_sum=kl_sum,
    )
