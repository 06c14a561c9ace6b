"""Train/generation mismatch metrics, logged every step, with NeMo RL's names and definitions.

The generator and the trainer assign different log-probs to the same sampled token. Over the
valid tokens, with ``prev_t`` the trainer's log-prob (before the update) and ``gen_t`` the
generator's, the metrics (keys ``mismatch/<name>``) are masked means over tokens of:

    token_mult_prob_error      exp(|prev_t - gen_t|): multiplicative error of the token's
                               probability, >= 1.
    gen_kl_error               k3(gen, prev) = exp(prev - gen) - (prev - gen) - 1, >= 0
                               (NeMo RL: "kl(P_gen || P_train)").
    policy_kl_error            k3(prev, gen) = exp(gen - prev) - (gen - prev) - 1, >= 0
                               (NeMo RL: "kl(P_train || P_gen)").
    js_divergence_error        0.5 k3-term(prev, m) + 0.5 k3-term(gen, m), with
                               m = log(0.5 exp(prev) + 0.5 exp(gen)) and
                               k3-term(a, m) = exp(a - m) - (a - m) - 1, >= 0.
    sampling_importance_ratio  the importance weights as the active IS mode applies them (after
                               truncation or masking; ``none``: the raw ratio, which NeMo RL
                               reports when its correction is off).
    is_oob_ratio               the share the active mode truncated or filtered: tokens for
                               ``tis`` (w > high) and ``icepop`` (w outside [low, high]);
                               sequences for ``seq-mask-tis`` and ``geo-mask`` (geometric mean
                               outside [low, high]) and ``seq-tis`` (sequence ratio > high);
                               0 for ``none``, which filters nothing.

These are exactly NeMo RL's ``ClippedPGLoss`` metrics (same formulas, same masks), so a
dashboard of ours compares with one of theirs. Ours, under names NeMo RL does not use:

    chi2_token                 (w_t - 1)^2 with w_t = exp(prev_t - gen_t): estimates
                               chi^2(trainer || gen), the variance of the raw IS weights.
    num_tokens                 the number of valid tokens.

Computed in float64 without gradient, without clamping (float64's exp is finite up to a log-ratio
of 709, far beyond any two real engines' disagreement); padding may hold anything (inf, nan) and
never leaks. With no valid token every metric takes its value for identical policies: 1 for the
multiplicative error and the ratio, 0 for the rest.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rljob import metrics as m
from rljob.algorithms import IS_MODES
from workers.algo.importance import importance_weights

_SEQUENCE_MODES = ("seq-tis", "seq-mask-tis", "geo-mask")


def k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """``exp(logp_ref - logp) - (logp_ref - logp) - 1`` elementwise: NeMo RL's ``calculate_kl``
    with ``kl_type="k3"``, ``k3(gen, prev)`` being ``gen_kl_error``'s term."""
    r = logp_ref - logp
    return torch.exp(r) - r - 1.0


@torch.no_grad()
def mismatch_metrics(
    logp_trainer: Tensor,
    logp_gen: Tensor,
    mask: Tensor,
    low: float = 0.5,
    high: float = 2.0,
    mode: str = "none",
) -> m.MismatchMetrics:
    """Mismatch metrics between trainer and generator log-probs of the same sampled tokens.

    Args:
        logp_trainer: ``[B, L]`` log-probs of the sampled tokens under the trainer (``prev``).
        logp_gen: ``[B, L]`` log-probs the generator reported for them (``gen``).
        mask: ``[B, L]`` bool or float, nonzero on valid response tokens.
        low, high: the IS bounds (as in :mod:`workers.algo.importance`).
        mode: the job's IS mode, which defines ``sampling_importance_ratio`` and ``is_oob_ratio``.

    Returns:
        ``{"mismatch/<name>": value}`` python floats; names as in the module docstring.
    """
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    if low < 0.0 or low > high:
        raise ValueError(f"IS bounds need 0 <= low <= high, got low={low}, high={high}")
    if not logp_trainer.shape == logp_gen.shape == mask.shape:
        raise ValueError(
            f"logp_trainer {tuple(logp_trainer.shape)}, logp_gen {tuple(logp_gen.shape)} "
            f"and mask {tuple(mask.shape)} must have the same shape [B, L]"
        )
    valid = mask != 0  # [B, L]
    n = int(valid.sum().item())
    if n == 0:
        return _named(token_mult_prob_error=1.0, sampling_importance_ratio=1.0, num_tokens=0.0)

    zero = torch.zeros((), dtype=torch.float64)
    # padding may hold inf/nan: replace it before any arithmetic, so nothing leaks through a where
    prev = torch.where(valid, logp_trainer.to(torch.float64), zero)  # [B, L]
    gen = torch.where(valid, logp_gen.to(torch.float64), zero)  # [B, L]
    d = prev - gen  # [B, L]
    log_m = torch.logaddexp(prev, gen) - math.log(2.0)  # [B, L] log(0.5 e^prev + 0.5 e^gen), stably
    js = 0.5 * k3(log_m, prev) + 0.5 * k3(log_m, gen)  # [B, L]

    def token_mean(x: Tensor) -> float:
        return float(x[valid].mean())

    isc = importance_weights(prev, gen, mask, mode, low, high)
    applied = isc.raw if mode == "none" else isc.weights  # [B, L]
    if mode in _SEQUENCE_MODES:  # a share of the sequences with a valid token
        seqs = valid.any(dim=-1)  # [B]
        oob = float(isc.out_of_bounds.amax(dim=-1)[seqs].mean())
    else:
        oob = token_mean(isc.out_of_bounds) if mode != "none" else 0.0
    return _named(
        token_mult_prob_error=token_mean(torch.exp(d.abs())),
        gen_kl_error=token_mean(k3(gen, prev)),
        policy_kl_error=token_mean(k3(prev, gen)),
        js_divergence_error=token_mean(js),
        sampling_importance_ratio=token_mean(applied),
        is_oob_ratio=oob,
        chi2_token=token_mean((torch.exp(d) - 1.0).square()),
        num_tokens=float(n),
    )


def _named(
    token_mult_prob_error: float,
    sampling_importance_ratio: float,
    num_tokens: float,
    gen_kl_error: float = 0.0,
    policy_kl_error: float = 0.0,
    js_divergence_error: float = 0.0,
    is_oob_ratio: float = 0.0,
    chi2_token: float = 0.0,
) -> m.MismatchMetrics:
    """The metrics row with its fixed keys and order."""
    return {
        m.TOKEN_MULT_PROB_ERROR: float(token_mult_prob_error),
        m.GEN_KL_ERROR: float(gen_kl_error),
        m.POLICY_KL_ERROR: float(policy_kl_error),
        m.JS_DIVERGENCE_ERROR: float(js_divergence_error),
        m.SAMPLING_IMPORTANCE_RATIO: float(sampling_importance_ratio),
        m.IS_OOB_RATIO: float(is_oob_ratio),
        m.CHI2_TOKEN: float(chi2_token),
        m.MISMATCH_TOKENS: float(num_tokens),
    }
