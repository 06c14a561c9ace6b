"""Independent float64 references for the FP8 tests: rounding to FP8 by hand, block scales by loop.

Nothing here calls fp8rl code or torch's float8 casts, so the tests compare the implementation
against arithmetic written from the formats' definitions.
"""

from __future__ import annotations

import math

import torch

# (max finite, mantissa bits, smallest normal exponent) from the OCP FP8 spec
FORMATS = {"e4m3": (448.0, 3, -6), "e5m2": (57344.0, 2, -14)}


def unit_roundoff(fmt: str) -> float:
    return 2.0 ** -(FORMATS[fmt][1] + 1)


def min_subnormal(fmt: str) -> float:
    _, m, emin = FORMATS[fmt]
    return 2.0 ** (emin - m)


def round_to_fp8(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round float64 values to the nearest FP8 value (ties to even), saturating at +-max."""
    fmax, m, emin = FORMATS[fmt]
    v = v.to(torch.float64)
    mag = v.abs()
    # exponent of each value's binade, never below the smallest normal's (subnormals share it)
    e = torch.floor(torch.log2(mag.clamp(min=2.0**emin))).clamp(min=emin)
    spacing = torch.pow(2.0, e - m)
    q = torch.round(mag / spacing) * spacing  # torch.round: half to even
    return (torch.sign(v) * q).clamp(-fmax, fmax)


def block_scales(x: torch.Tensor, block: tuple[int, int] | None, fmt: str) -> torch.Tensor:
    """amax/fmax per block, by an explicit loop over blocks (float64, 2-D input)."""
    fmax = FORMATS[fmt][0]
    x = x.to(torch.float64)
    if block is None:
        return torch.tensor(max(float(x.abs().max()), 1e-300) / fmax, dtype=torch.float64)
    rows, cols = x.shape
    br, bc = block
    out = torch.empty(math.ceil(rows / br), math.ceil(cols / bc), dtype=torch.float64)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            tile = x[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            out[i, j] = max(float(tile.abs().max()), 1e-300) / fmax
    return out


def expand(scale: torch.Tensor, block: tuple[int, int] | None, shape: torch.Size) -> torch.Tensor:
    if block is None:
        return scale.expand(shape)
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[: shape[0], : shape[1]]


def error_bound(x: torch.Tensor, block: tuple[int, int] | None, fmt: str) -> torch.Tensor:
    """Per-element bound on |dequant(quant(x)) - x|.

    Normal range: round to nearest with m mantissa bits errs by at most u|x|, u = 2^-(m+1).
    Subnormal range (|x|/s below the smallest normal): the spacing is fixed at
    s * min_subnormal, so the error is at most half of it. Add 2^-22 |x| for the float32
    division and multiplication in the implementation.
    """
    s = expand(block_scales(x, block, fmt), block, x.shape)
    x64 = x.to(torch.float64)
    return unit_roundoff(fmt) * x64.abs() + s * min_subnormal(fmt) / 2 + 2.0**-22 * x64.abs()
