"""Group-relative advantages (GRPO).

For each prompt the generator samples a group of ``K`` responses with scalar rewards
``r_1 .. r_K``. GRPO needs no value network: the baseline is the group mean, and the advantage of
response ``i`` is

    A_i = r_i - mean_j(r_j)                                  (normalize="none", Dr. GRPO)
    A_i = (r_i - mean_j(r_j)) / (std_j(r_j) + eps)           (normalize="std", original GRPO)

where ``std`` is the unbiased (``K - 1``) standard deviation. Every token of response ``i`` gets
the same ``A_i``. A group whose rewards are all equal carries no signal and gets ``A = 0``; so does
a group of one (its baseline is itself).

Rewards arrive flat, ``N = num_groups * K``, with each group's responses consecutive:
``[g0_r0, g0_r1, .., g0_rK-1, g1_r0, ..]``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

NORMALIZATIONS = ("std", "none")


def grpo_advantages(
    rewards: Tensor,
    group_size: int,
    normalize: Literal["std", "none"] = "std",
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages, one per response.

    Args:
        rewards: ``[N]`` scalar reward per response, groups consecutive.
        group_size: ``K``, responses per prompt; must divide ``N``.
        normalize: ``"std"`` divides by the group's unbiased std plus ``eps``; ``"none"`` only
            subtracts the group mean.
        eps: keeps the division finite when a group's rewards are all equal.

    Returns:
        ``[N]`` advantages, float (float32 for integer or bool rewards).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 (responses per prompt), got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(
            f"number of rewards ({n}) is not a multiple of group_size ({group_size}); "
            "pass the rewards of whole groups, each group's responses consecutive"
        )
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")

    r = rewards if rewards.is_floating_point() else rewards.to(torch.float32)  # [N]
    grouped = r.reshape(-1, group_size)  # [G, K]
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # [G, K]
    if normalize == "std":
        if group_size > 1:
            std = grouped.std(dim=1, correction=1, keepdim=True)  # [G, 1]
        else:
            # The unbiased std of one sample is undefined (0/0); the centred reward is 0 anyway.
            std = torch.zeros_like(centered[:, :1])  # [G, 1]
        centered = centered / (std + eps)  # [G, K]
    return centered.reshape(-1)  # [N]
