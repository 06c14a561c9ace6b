"""The two FP8 formats and the facts about them that the rest of fp8rl relies on.

E4M3 (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa bits, no infinities, max 448.
    More precision, less range: weights and activations.
E5M2 (``torch.float8_e5m2``): 5 exponent bits, 2 mantissa bits, IEEE-like, max 57344.
    More range, less precision: gradients (the "hybrid" recipe).

Precision of a normal number with ``m`` mantissa bits: round-to-nearest makes a relative error
of at most ``u = 2**-(m+1)`` (the unit roundoff): 1/16 for E4M3, 1/8 for E5M2. Below the smallest
normal the spacing is fixed, so the absolute error there is at most half a subnormal step. Tests
derive their bounds from these two numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 format: its torch dtype and the constants scaling and error bounds use."""

    name: str
    dtype: torch.dtype
    max: float  # largest finite value; casts saturate here
    mantissa_bits: int
    min_normal: float
    min_subnormal: float

    @property
    def bits(self) -> int:
        return 8


E4M3 = Fp8Format(
    name="e4m3",
    dtype=torch.float8_e4m3fn,
    max=448.0,
    mantissa_bits=3,
    min_normal=2.0**-6,
    min_subnormal=2.0**-9,
)
E5M2 = Fp8Format(
    name="e5m2",
    dtype=torch.float8_e5m2,
    max=57344.0,
    mantissa_bits=2,
    min_normal=2.0**-14,
    min_subnormal=2.0**-16,
)

FORMATS: dict[str, Fp8Format] = {E4M3.name: E4M3, E5M2.name: E5M2}
_BY_DTYPE: dict[torch.dtype, Fp8Format] = {E4M3.dtype: E4M3, E5M2.dtype: E5M2}


def get_format(fmt: str | Fp8Format | torch.dtype) -> Fp8Format:
    """Resolve ``"e4m3"``, ``"e5m2"``, a format or a float8 dtype to an :class:`Fp8Format`."""
    if isinstance(fmt, Fp8Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        if fmt in _BY_DTYPE:
            return _BY_DTYPE[fmt]
        raise ValueError(f"dtype {fmt} is not an FP8 format fp8rl uses; use one of {sorted(FORMATS)}")
    key = str(fmt).lower()
    if key not in FORMATS:
        raise ValueError(f"fmt={fmt!r} is not an FP8 format; allowed: {sorted(FORMATS)}")
    return FORMATS[key]


# Every FP8 code's float32 value, per format, on the CPU: built by torch's own conversion, so a
# lookup returns exactly what ``.to(torch.float32)`` does (NaN and, for E5M2, infinities included).
_DECODE: dict[torch.dtype, torch.Tensor] = {
    f.dtype: torch.arange(256, dtype=torch.uint8).view(f.dtype).to(torch.float32) for f in FORMATS.values()
}


def to_float32(data: torch.Tensor) -> torch.Tensor:
    """``data.to(torch.float32)`` for an FP8 tensor, bit for bit. On CPU through a 256-entry
    table: torch's E4M3 conversion there decodes one element at a time (~6x slower than the
    lookup on an AVX2 host, measured on a 3072 x 256 activation), and the emulated FP8 GEMMs
    dequantize every activation and gradient. Elsewhere (a GPU converts at memory speed) and
    for other dtypes it is ``.to`` itself."""
    table = _DECODE.get(data.dtype)
    if table is None or data.device.type != "cpu":
        return data.to(torch.float32)
    if not data.is_contiguous():  # a column-major matrix stays column-major, as with .to
        if data.dim() == 2 and data.t().is_contiguous():
            return to_float32(data.t()).t()
        data = data.contiguous()
    codes = data.view(torch.uint8).reshape(-1).to(torch.int32)
    return table.index_select(0, codes).view(data.shape)
