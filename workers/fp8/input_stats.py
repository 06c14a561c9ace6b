"""Input-activation statistics of a model's linear layers on a calibration batch, for the audit.

For one linear layer, let ``X`` be its input activations on the batch, one row per real token
(padding rows left out), ``T`` rows and ``C`` input channels. Then

    amax            = max over t, c of |X[t, c]|
    p_c             = the nearest-rank 99.9th percentile of |X[:, c]|: sort the T values ascending
                      and take the k-th, k = ceil(0.999 * T) (1-based; exact rational arithmetic)
    ratio_c         = max_t |X[t, c]| / p_c       (1.0 if the channel is all zeros; inf if only
                      p_c is zero)
    outlier_ratio   = max over c of ratio_c, and outlier_channel = the first c that attains it

``ratio_c`` says how far a channel's largest value sits above the bulk of that channel: the
"massive activation" channels of LLMs have ratios of 10-1000 while ordinary channels stay near 1-3.
Such a channel makes the 1x128 tile that holds it scale every other value of the tile down
(fp8-numerics.md, "What blockwise scaling buys"). With T < 1000 tokens, k = T and every ratio is
1 by construction: calibrate on at least 1000 tokens (:data:`MIN_TOKENS`).

The statistics come from forward pre-hooks during one forward in ``torch.no_grad``; inputs a
q/k/v or gate/up group share are measured once. All values reach the host in one transfer at the
end (no host sync per layer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import nn

PERCENTILE = Fraction(999, 10)  # 99.9, exactly
MIN_TOKENS = 1000  # fewer tokens: the 99.9th percentile is the max, every ratio 1


@dataclass(frozen=True)
class InputStats:
    """One linear layer's input statistics (see the module docstring)."""

    amax: float
    outlier_ratio: float
    outlier_channel: int
    tokens: int  # T: the rows the statistics were taken over


def nearest_rank(n: int, percentile: Fraction = PERCENTILE) -> int:
    """The 1-based rank of the nearest-rank ``percentile`` of ``n`` sorted values: ceil(p/100 * n)."""
    if n < 1:
        raise ValueError(f"nearest_rank: need at least one value, got n={n}")
    return max(1, math.ceil(percentile / 100 * n))


def channel_outliers(
    x: torch.Tensor, percentile: Fraction = PERCENTILE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [T, C] -> (amax [], outlier_ratio [], outlier_channel []) as 0-d tensors, on x's device."""
    a = x.detach().abs().float()  # [T, C]
    col_max = a.amax(dim=0)  # [C]
    col_p = a.kthvalue(nearest_rank(a.shape[0], percentile), dim=0).values  # [C]
    ratio = torch.where(col_p > 0, col_max / col_p, torch.where(col_max > 0, math.inf, 1.0))  # [C]
    channel = ratio.argmax()  # the first maximum
    return a.amax(), ratio[channel], channel


def input_stats(x: torch.Tensor, percentile: Fraction = PERCENTILE) -> InputStats:
    """The statistics of ``x`` [T, C] (one row per token), read to the host."""
    amax, ratio, channel = channel_outliers(x, percentile)
    return InputStats(float(amax), float(ratio), int(channel), int(x.shape[0]))


def _linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from workers.fp8.linear import Fp8Linear

    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear | Fp8Linear)]


def measure_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    percentile: Fraction = PERCENTILE,
) -> dict[str, InputStats]:
    """Run ``model`` once on a batch and return every linear layer's :class:`InputStats`.

    Args:
        model: a Hugging Face causal LM (any module called as ``model(input_ids=, attention_mask=)``).
        input_ids: [B, L] token ids. Pad on the right: with a causal mask, pads after a sequence
            change none of its tokens' activations.
        attention_mask: [B, L], 1 for real tokens; their rows alone are measured (None: all).
    """
    keep = None if attention_mask is None else attention_mask.reshape(-1).bool()  # [B*L]
    found: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}
    # the last input measured, held so that q/k/v (gate/up), which run one after another on the
    # same tensor, are measured once; held, its memory cannot be reused by another layer's input
    last: list[Any] = [None, None]

    def hook(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def pre(_: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if last[0] is not x:
                rows = x.reshape(-1, x.shape[-1])  # [B*L, C]
                if keep is not None and rows.shape[0] == keep.numel():
                    rows = rows[keep.to(rows.device)]
                last[0], last[1] = x, (*channel_outliers(rows, percentile), rows.shape[0])
            found[name] = last[1]

        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in _linears(model)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for h in handles:
            h.remove()
        last.clear()
    if not found:
        return {}
    names = list(found)
    values = torch.stack([torch.stack([v[0], v[1], v[2].to(v[0].dtype)]) for v in found.values()]).tolist()
    return {
        n: InputStats(amax, ratio, int(ch), found[n][3])
        for n, (amax, ratio, ch) in zip(names, values, strict=True)
    }
