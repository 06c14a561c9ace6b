"""The decode attention computed in float64 and rounded once to the output's dtype: the most precise
attention a BF16 kernel can return. Bounds that FP8 amplification sets (an fp8-e2e model quantizes
o_proj's input to E4M3, so a last-bit difference in attention can move a value by an E4M3 step)
are measured against it: a kernel is held to what this attention scores in the same run, on the
same hardware (docs/engines.md, "The decode attention's precision bounds")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from workers.engines.native import decode_attention as da


def rounded_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: torch.Tensor,
    length: torch.Tensor,
    scaling: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """:func:`decode_attention.decode_attention`'s contract (``splits`` has no meaning here), in
    float64, rounded once; no host sync (``length`` stays a device tensor), so a CUDA graph can
    capture it."""
    return da.reference(q, k, v, seen, length, scaling, k_scale, v_scale).to(q.dtype)


@contextmanager
def exact_decode_attention() -> Iterator[None]:
    """Within the block, a decode step that would run the Triton kernel runs :func:`rounded_exact`
    (a static decoder captures or issues its steps there); on leaving, the kernel is back."""
    real = da.decode_attention
    da.decode_attention = rounded_exact
    try:
        yield
    finally:
        da.decode_attention = real
