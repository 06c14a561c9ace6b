"""RL algorithms as pure functions: advantages, per-token losses, aggregation, IS correction,
train/generation mismatch metrics.

One GRPO step, put together::

    from workers.algo import (aggregate, clipped_policy_loss, grpo_advantages, importance_weights,
                              mismatch_metrics)

    adv = grpo_advantages(rewards, group_size=8)                      # [B]
    terms = clipped_policy_loss(logp, logp_old, adv)                  # .loss [B, L]
    isc = importance_weights(logp_old, logp_gen, mask, mode="tis")    # .weights [B, L]
    loss = aggregate(terms.loss * isc.weights, mask, "token-mean")    # scalar
    metrics = mismatch_metrics(logp_old, logp_gen, mask)              # {"mismatch/...": float}

Shapes: ``B`` sequences, ``L`` padded response tokens; ``mask [B, L]`` is nonzero on valid tokens,
and padding may hold any value (inf, nan) without leaking into results or gradients. Each module's
docstring gives its maths.
"""

from rljob.algorithms import AGGREGATIONS, IS_MODES
from workers.algo.advantages import grpo_advantages
from workers.algo.importance import IsCorrection, importance_weights
from workers.algo.losses import PolicyLossTerms, aggregate, clipped_policy_loss, kl_penalty
from workers.algo.mismatch import mismatch_metrics

__all__ = [
    "AGGREGATIONS",
    "IS_MODES",
    "IsCorrection",
    "PolicyLossTerms",
    "aggregate",
    "clipped_policy_loss",
    "grpo_advantages",
    "importance_weights",
    "kl_penalty",
    "mismatch_metrics",
]
