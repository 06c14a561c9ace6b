"""Triton arithmetic every kernel of the project shares, each operation rounded where torch
rounds it: BF16 rounding (:func:`bf16_value`), CUDA's own ``expf``/``logf``, and the FP8 cast
(:func:`to_fp8`). On a GPU they are the hardware's conversions and libdevice's functions; under
Triton's interpreter (the CPU tests), which truncates on a BF16 cast, rounds some FP8 casts wrongly
and has no libdevice, the same values are made with bit and float32 operations, in branches a GPU
build compiles away (``HW_BF16``, ``_INTERPRETED``). Imported only where Triton runs.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

# On a GPU a kernel rounds float32 to BF16 with the hardware's conversion (to nearest, ties to
# even). Triton's interpreter (the CPU tests) truncates on .to(bfloat16), so there the same values
# are made with bit operations (:func:`bf16_bits`): kernels take ``HW=HW_BF16`` as a constexpr.
HW_BF16 = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def bf16_bits(x):
    """float32 ``x`` rounded to the nearest BF16 value (ties to even), kept as float32: torch's
    ``.to(torch.bfloat16)`` for finite values, done on the bits (Triton's interpreter truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def bf16_value(x, HW: tl.constexpr):
    """float32 ``x`` rounded to BF16 (nearest, ties to even), as float32: the hardware conversion
    on a GPU, :func:`bf16_bits` in the interpreter."""
    if HW:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        return bf16_bits(x)


@triton.jit
def expf(x, HW: tl.constexpr):
    """CUDA's ``expf`` (libdevice, what torch's float32 ``exp`` calls) on a GPU, not Triton's
    faster ``tl.exp``; the interpreter, which has no libdevice, its own exp."""
    if HW:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def logf(x, HW: tl.constexpr):
    """CUDA's ``logf`` (libdevice) on a GPU, not Triton's ``tl.log``; the interpreter's own log."""
    if HW:
        return libdevice.log(x)
    else:
        return tl.log(x)


# In Triton's interpreter (the CPU tests) the FP8 cast rounds wrongly where rounding carries into
# the exponent (31 -> 16 where 32 is right, ~4.6% of log-uniform values: up to 2x off). There
# :func:`to_fp8` first rounds to the format's grid in float32 (:func:`fp8_grid`, exact bit and
# float32 operations), so the cast itself never rounds and the bytes are torch's. A GPU compiles
# that branch away and casts with the hardware's round-to-nearest conversion.
_INTERPRETED = tl.constexpr(not HW_BF16)


@triton.jit
def fp8_grid(q, E4M3: tl.constexpr):
    """float32 ``q`` (within the format's range, or NaN) rounded to the nearest E4M3 (``E4M3``) or
    E5M2 value, ties to even, as float32: the mantissa's dropped bits for normal values, a sum
    with ``1.5 * 2^k`` (whose float32 spacing is the subnormal step) below the smallest normal;
    the sign (and -0.0) kept, NaN left as it is."""
    bits = q.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    mag = tl.abs(q)
    m = mag.to(tl.int32, bitcast=True)
    if E4M3:  # 3 mantissa bits (20 dropped), smallest normal 2^-6, subnormal step 2^-9
        normal = ((m + 0x7FFFF + ((m >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        small = (mag + 24576.0) - 24576.0  # 1.5 * 2^14: float32 spacing 2^-9 there
        r = tl.where(mag < 0.015625, small, normal)
    else:  # 2 mantissa bits (21 dropped), smallest normal 2^-14, subnormal step 2^-16
        normal = ((m + 0xFFFFF + ((m >> 21) & 1)) & -2097152).to(tl.float32, bitcast=True)
        small = (mag + 192.0) - 192.0  # 1.5 * 2^7: float32 spacing 2^-16 there
        r = tl.where(mag < 0.00006103515625, small, normal)
    out = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(q != q, q, out)


@triton.jit
def to_fp8(q, FMT_MAX: tl.constexpr, E4M3: tl.constexpr):
    """Scaled values -> E4M3 (``E4M3``) or E5M2, saturated at ``FMT_MAX``, rounded to nearest."""
    q = tl.minimum(tl.maximum(q, -FMT_MAX), FMT_MAX)
    if _INTERPRETED:  # compiled away on a GPU (see _INTERPRETED)
        q = fp8_grid(q, E4M3)
    if E4M3:  # noqa: SIM108 - a constexpr branch, compiled away
        q8 = q.to(tl.float8e4nv)
    else:
        q8 = q.to(tl.float8e5)
    return q8
