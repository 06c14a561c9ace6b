"""Train/generation mismatch metrics, logged every step.

The generator (FP8 inference engine) and the trainer assign different probabilities to the same
sampled token. Over the valid tokens ``y_t`` (sampled from the generator), with

    d_t = logp_trainer_t - logp_gen_t      (clamped to +-20)
    w_t = exp(d_t) = pi_trainer(y_t) / pi_gen(y_t)

the metrics (keys ``mismatch/<name>``) are token means of:

    token_mult_prob_error      exp(|d_t|): multiplicative error of the token probability, >= 1.
    gen_kl_error               w_t - d_t - 1: the k3 estimate of KL(gen || trainer) =
                               E_gen[-log w], plus the zero-mean control variate w - 1; >= 0.
    policy_kl_error            w_t d_t - (w_t - 1): KL(trainer || gen) = E_trainer[log w] =
                               E_gen[w log w], with the same control variate; >= 0 per token.
    js_divergence_error        1/2 log(p/m) + 1/2 (q/p) log(q/m), with p = pi_gen(y_t),
                               q = pi_trainer(y_t), m = (p + q) / 2: a sampled-token estimator
                               of JS(gen, trainer) between next-token distributions, the second
                               term importance-weighted by q/p = w_t. Not >= 0 per token.
    sampling_importance_ratio  w_t; 1 in expectation when nothing is truncated.
    chi2_token                 (w_t - 1)^2: estimates chi^2(trainer || gen), the IS variance.

plus ``is_oob_ratio``, the fraction of tokens with ``w_t`` outside ``[low, high]``, and
``num_tokens``, the number of valid tokens. The JS term depends on ``d_t`` alone,
``log(p/m) = ln 2 - softplus(d)`` and ``log(q/m) = ln 2 - softplus(-d)``, and is computed that way
(stable for any ``d``). With no valid token every metric takes its value for identical policies:
1 for the multiplicative error and the ratio, 0 for the rest. Computed in float64 without
gradient; padding may hold anything (inf, nan) and never leaks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

_MAX_LOG_RATIO = 20.0
_PREFIX = "mismatch/"


@torch.no_grad()
def mismatch_metrics(
    logp_trainer: Tensor,
    logp_gen: Tensor,
    mask: Tensor,
    low: float = 0.5,
    high: float = 2.0,
) -> dict[str, float]:
    """Mismatch metrics between trainer and generator log-probs of the same sampled tokens.

    Args:
        logp_trainer: ``[B, L]`` log-probs of the sampled tokens under the trainer.
        logp_gen: ``[B, L]`` log-probs the generator reported for them.
        mask: ``[B, L]`` bool or float, nonzero on valid response tokens.
        low, high: bounds on ``w_t`` for ``is_oob_ratio`` (same meaning as in ``importance``).

    Returns:
        ``{"mismatch/<name>": value}`` python floats; names as in the module docstring.
    """
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

    diff = logp_trainer.to(torch.float64) - logp_gen.to(torch.float64)  # [B, L]
    d = diff[valid].clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [n]  boolean indexing drops padding
    w = torch.exp(d)  # [n]
    ln2 = math.log(2.0)
    js = 0.5 * (ln2 - F.softplus(d)) + 0.5 * w * (ln2 - F.softplus(-d))  # [n]
    oob = (w < low) | (w > high)  # [n]
    return _named(
        token_mult_prob_error=torch.exp(d.abs()).mean().item(),
        gen_kl_error=(w - d - 1.0).mean().item(),
        policy_kl_error=(w * d - (w - 1.0)).mean().item(),
        js_divergence_error=js.mean().item(),
        sampling_importance_ratio=w.mean().item(),
        is_oob_ratio=oob.to(torch.float64).mean().item(),
        chi2_token=(w - 1.0).square().mean().item(),
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
) -> dict[str, float]:
    """The metrics dict with its fixed keys and order."""
    values = {
        "token_mult_prob_error": token_mult_prob_error,
        "gen_kl_error": gen_kl_error,
        "policy_kl_error": policy_kl_error,
        "js_divergence_error": js_divergence_error,
        "sampling_importance_ratio": sampling_importance_ratio,
        "is_oob_ratio": is_oob_ratio,
        "chi2_token": chi2_token,
        "num_tokens": num_tokens,
    }
    return {_PREFIX + name: float(value) for name, value in values.items()}
