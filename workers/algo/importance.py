"""Importance-sampling correction for the mismatch between generator and trainer.

Responses are sampled by the inference engine (FP8 weights, its own kernels), but the loss is
computed from the trainer's log-probs: the two disagree even for identical weights. The per-token
ratio of the trainer's (old) policy to the distribution that actually produced the token,

    w_t = pi_trainer_old(y_t) / pi_gen(y_t) = exp(logp_trainer_old_t - logp_gen_t)

(log-ratio clamped to +-20, always detached) corrects for it: multiplying the per-token loss by
``w_t`` makes the gradient an expectation under the trainer's policy. Raw ratios have unbounded
variance, so each mode bounds them differently, with ``0 <= low <= high``:

    "none"          weight 1; tokens with w outside [low, high] only counted (diagnostic).
    "tis"           truncated IS, per token: min(w_t, high).
    "icepop"        masked IS (MIS), per token: w_t if low <= w_t <= high, else 0.
    "seq-tis"       sequence ratio s = exp(sum_t log w_t) (sum clamped to +-20); every token of
                    the sequence gets min(s, high).
    "seq-mask-tis"  NeMo RL's: geometric mean g = exp(mean_t log w_t); a sequence with g outside
                    [low, high] gets 0 on every token, the others keep their raw token-level
                    weights w_t (NeMo RL's reference bounds are tight: 0.999 to 1.002).
    "geo-mask"      the same filter on g, but the kept sequences get weight 1: a length-normalised
                    filter, no reweighting.

Sums and means run over valid tokens only; padding may hold anything (inf, nan) and never leaks:
every output is 0 at masked positions. ``out_of_bounds`` marks the tokens a mode truncated or
dropped (for the sequence modes, every valid token of such a sequence).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rljob.algorithms import IS_MODES

_MAX_LOG_RATIO = 20.0


class IsCorrection(NamedTuple):
    """Output of ``importance_weights``; every field is ``[B, L]``, detached, 0 at padding.

    Attributes:
        weights: multiply the per-token loss by these before aggregation.
        out_of_bounds: float 1/0, tokens the mode counts as outside ``[low, high]``.
        raw: the per-token ratio ``w_t`` before any truncation or masking.
    """

    weights: Tensor
    out_of_bounds: Tensor
    raw: Tensor


def importance_weights(
    logp_trainer_old: Tensor,
    logp_gen: Tensor,
    mask: Tensor,
    mode: str,
    low: float = 0.5,
    high: float = 2.0,
) -> IsCorrection:
    """Per-token IS weights correcting for sampling from the generator instead of the trainer.

    Args:
        logp_trainer_old: ``[B, L]`` log-probs of the sampled tokens under the trainer's policy
            before the update.
        logp_gen: ``[B, L]`` log-probs the generator reported for the same tokens.
        mask: ``[B, L]`` bool or float, nonzero on valid response tokens.
        mode: one of ``IS_MODES``; see the module docstring.
        low: lower bound on the ratio (``"icepop"``) or on the geometric mean (``"seq-mask-tis"``,
            ``"geo-mask"``).
        high: upper bound on the ratio (every mode but ``"none"``).
    """
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    if low < 0.0 or low > high:
        raise ValueError(f"IS bounds need 0 <= low <= high, got low={low}, high={high}")
    if not logp_trainer_old.shape == logp_gen.shape == mask.shape:
        raise ValueError(
            f"logp_trainer_old {tuple(logp_trainer_old.shape)}, logp_gen {tuple(logp_gen.shape)} "
            f"and mask {tuple(mask.shape)} must all be [B, L]"
        )

    valid = mask != 0  # [B, L]
    diff = (logp_trainer_old.detach() - logp_gen.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [B, L]
    zero = torch.zeros_like(diff)  # [B, L]
    log_w = torch.where(valid, diff, zero)  # [B, L]  0 at padding, so exp gives 1 there
    w = torch.exp(log_w)  # [B, L]
    raw = torch.where(valid, w, zero)  # [B, L]
    in_bounds = (w >= low) & (w <= high)  # [B, L]

    if mode == "none":
        return _correction(valid.to(zero.dtype), valid & ~in_bounds, raw, valid)
    if mode == "tis":
        return _correction(w.clamp(max=high), w > high, raw, valid)
    if mode == "icepop":
        return _correction(torch.where(in_bounds, w, zero), ~in_bounds, raw, valid)

    seq_log = log_w.sum(dim=-1)  # [B]
    if mode == "seq-tis":
        s = torch.exp(seq_log.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # [B]
        return _correction(s.clamp(max=high)[:, None].expand_as(w), (s > high)[:, None], raw, valid)

    n_tokens = valid.sum(dim=-1).clamp(min=1).to(seq_log.dtype)  # [B]
    g = torch.exp(seq_log / n_tokens)  # [B]  each log w_t is within +-20, so is their mean
    keep = (g >= low) & (g <= high)  # [B]
    if mode == "geo-mask":
        return _correction(keep.to(zero.dtype)[:, None].expand_as(w), ~keep[:, None], raw, valid)
    # seq-mask-tis: token-level weights, whole sequences masked
    return _correction(torch.where(keep[:, None], w, zero), ~keep[:, None], raw, valid)


def _correction(weights: Tensor, out_of_bounds: Tensor, raw: Tensor, valid: Tensor) -> IsCorrection:
    """Zero ``weights`` [B, L] and ``out_of_bounds`` ([B, L] or [B, 1] bool) at padding."""
    zero = torch.zeros_like(raw)  # [B, L]
    return IsCorrection(
        weights=torch.where(valid, weights, zero),  # [B, L]
        out_of_bounds=(valid & out_of_bounds).to(raw.dtype),  # [B, L]
        raw=raw,
    )
