"""Per-token policy losses, KL penalties, and their aggregation to a scalar.

Clipped surrogate (PPO / GRPO). With the ratio of the policy being trained to the policy that
was current when the batch was scored,

    ratio_t = pi(y_t) / pi_old(y_t) = exp(logp_t - logp_old_t)

each token's loss is the negated pessimistic surrogate

    loss_t = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A)

For ``A > 0`` the clip caps the gain at ``ratio = 1 + clip_high``; for ``A < 0`` at
``ratio = 1 - clip_low``. Where the clipped term is the smaller one it is a constant in ``logp``,
so the token gives no gradient; elsewhere ``d loss_t / d logp_t = -ratio_t * A``. Asymmetric
bounds (``clip_high > clip_low``, "clip-higher" from DAPO) let low-probability tokens grow faster.
The log-ratio is clamped to +-20 before ``exp``, so a wild token cannot overflow float32.

KL penalty to a frozen reference, per token, with samples ``y_t ~ pi`` (Schulman's estimators of
``KL(pi || ref)``), ``x = logp_ref - logp``:

    k1 = -x                     unbiased, high variance, can be negative
    k2 = x^2 / 2                biased, low variance, >= 0
    k3 = exp(x) - x - 1         unbiased, low variance, >= 0   (x clamped to +-20)

Aggregation is kept apart from the per-token loss (``aggregate``): ``token-mean`` weighs every
valid token of the batch equally; ``seq-mean-token-mean`` averages each sequence over its own
tokens first, then averages the sequences, so long responses do not dominate. Padding may hold
anything (inf, nan): aggregation selects valid tokens with ``torch.where``, never by multiplying
by the mask, so neither the value nor the gradient picks up garbage.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from rljob.algorithms import AGGREGATIONS

KL_KINDS = ("k1", "k2", "k3")

# exp(20) ~ 4.9e8: far beyond any bound used in practice, far below float32 overflow.
_MAX_LOG_RATIO = 20.0


class PolicyLossTerms(NamedTuple):
    """Per-token outputs of ``clipped_policy_loss``.

    Attributes:
        loss: ``[B, L]`` per-token loss, ``-min(ratio * A, clip(ratio) * A)``; aggregate it.
        clipped: ``[B, L]`` float, 1 where the clipped term was the active minimum (no gradient).
    """

    loss: Tensor
    clipped: Tensor


def clipped_policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> PolicyLossTerms:
    """PPO clipped surrogate, per token; the gradient flows through ``logp`` only.

    Args:
        logp: ``[B, L]`` log-probs of the sampled tokens under the policy being trained.
        logp_old: ``[B, L]`` log-probs under the policy that scored the batch (detached here).
        advantages: ``[B]`` one advantage per sequence (detached here).
        clip_low: ratio lower bound is ``1 - clip_low``; in ``[0, 1]``.
        clip_high: ratio upper bound is ``1 + clip_high``; ``>= 0``.
    """
    if logp.shape != logp_old.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and logp_old {tuple(logp_old.shape)} differ in shape")
    if advantages.dim() != 1 or advantages.shape[0] != logp.shape[0]:
        raise ValueError(
            f"advantages must be [B] with B = logp.shape[0] = {logp.shape[0]}, "
            f"got shape {tuple(advantages.shape)}"
        )
    if not 0.0 <= clip_low <= 1.0:
        raise ValueError(f"clip_low must be in [0, 1], got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")

    adv = advantages.detach().to(logp.dtype)[:, None]  # [B, 1]
    log_ratio = (logp - logp_old.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [B, L]
    ratio = torch.exp(log_ratio)  # [B, L]
    unclipped = ratio * adv  # [B, L]
    clipped_obj = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv  # [B, L]
    # Strict "<": on a tie the unclipped term is active and the token keeps its gradient.
    is_clipped = clipped_obj < unclipped  # [B, L]
    # where, not minimum: the gradient goes to exactly one branch (minimum splits it on ties).
    loss = -torch.where(is_clipped, clipped_obj, unclipped)  # [B, L]
    return PolicyLossTerms(loss=loss, clipped=is_clipped.to(logp.dtype))


def kl_penalty(logp: Tensor, logp_ref: Tensor, kind: Literal["k1", "k2", "k3"] = "k3") -> Tensor:
    """Per-token estimate of ``KL(pi || ref)`` from tokens sampled from ``pi``.

    Args:
        logp: ``[B, L]`` log-probs under the policy being trained (gradient flows through it).
        logp_ref: ``[B, L]`` log-probs under the frozen reference (detached here).
        kind: ``"k1"``, ``"k2"`` or ``"k3"``; see the module docstring.

    Returns:
        ``[B, L]`` per-token penalty; aggregate it with ``aggregate``.
    """
    if logp.shape != logp_ref.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and logp_ref {tuple(logp_ref.shape)} differ in shape")
    diff = logp - logp_ref.detach()  # [B, L]  log pi - log ref
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()  # [B, L]
    if kind == "k3":
        x = (-diff).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [B, L]  log ref - log pi
        return torch.exp(x) - x - 1.0  # [B, L]
    raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")


def aggregate(
    loss: Tensor,
    mask: Tensor,
    mode: Literal["token-mean", "seq-mean-token-mean"],
) -> Tensor:
    """Reduce a per-token loss to a scalar over the valid tokens.

    Args:
        loss: ``[B, L]`` per-token loss; masked positions may hold anything, inf and nan included.
        mask: ``[B, L]`` bool or float, nonzero (normally 1) on valid response tokens; a float
            mask also weighs its tokens.
        mode: ``"token-mean"``: ``sum(loss * mask) / max(sum(mask), 1)``.
            ``"seq-mean-token-mean"``: mean over sequences with at least one valid token of the
            sequence's own token mean.

    Returns:
        0-d tensor. With no valid token it is 0, still attached to ``loss``'s graph.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"mode must be one of {AGGREGATIONS}, got {mode!r}")
    if loss.dim() != 2 or loss.shape != mask.shape:
        raise ValueError(
            f"loss and mask must both be [B, L], got loss {tuple(loss.shape)}, mask {tuple(mask.shape)}"
        )
    valid = mask != 0  # [B, L]
    weight = mask.to(loss.dtype)  # [B, L]
    # loss * weight is garbage at padding; where drops it there, and sends it zero gradient.
    weighted = torch.where(valid, loss * weight, torch.zeros_like(loss))  # [B, L]
    tokens = torch.where(valid, weight, torch.zeros_like(weight))  # [B, L]

    if mode == "token-mean":
        return weighted.sum() / tokens.sum().clamp(min=1.0)

    seq_tokens = tokens.sum(dim=-1)  # [B]
    has_tokens = seq_tokens != 0  # [B]
    seq_mean = weighted.sum(dim=-1) / torch.where(has_tokens, seq_tokens, torch.ones_like(seq_tokens))  # [B]
    num_seqs = has_tokens.sum().to(loss.dtype).clamp(min=1.0)
    return torch.where(has_tokens, seq_mean, torch.zeros_like(seq_mean)).sum() / num_seqs
