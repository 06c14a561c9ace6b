"""The training quantizer of power-of-two scales on a CPU, compiled: both layouts of an activation
or output gradient, their scales and their BF16 dequantizations, in one compiled call.

With ``precision.power_of_two_scales`` a CPU runs each FP8 GEMM as a BF16 GEMM of the dequantized
operands (kernel ``emulate_bf16``, :func:`workers.fp8.matmul.matmul_bf16`). Eagerly, each operand
then costs a quantization (|x|, two block maxima, two divisions, two casts to FP8, a byte
transpose) and a dequantization (a table decode of every byte, a product, a cast to BF16): on
SmolLM2's MLP those took ~7x the BF16 GEMMs they feed. Here Inductor (torch.compile's C++ backend)
compiles one call that computes the block maxima, the scales (:func:`_pow2_scales`: the eager
:func:`workers.fp8.quant.amax_to_scale`'s bits, in float32 bit arithmetic), and for each layout
the FP8 values times their scale in BF16, with one flag that says whether every maximum is
finite and every nonzero block's scale exact (below). It writes no FP8 byte: nothing on this path
reads them (the GEMMs read the BF16 values), so the activation's tensors
(:class:`workers.fp8.fp8_tensor.Fp8Tensor`) make them from the BF16 values on first read, which is
exact where every nonzero FP8 value times its power-of-two scale is a finite BF16 normal: a
scale of at least 2^-126 over the format's smallest subnormal (2^-117 for E4M3, 2^-110 for E5M2)
and at most the largest power of two whose product with the format's maximum BF16 holds (2^119,
2^112), or a block of zeros. Any other block takes the eager path. One call, not two with eager scale
arithmetic between them: on SmolLM2's training step the ~25 small eager operations per
quantization (scales, the finite guard's bookkeeping) and a second pass through Dynamo's guards
cost about as much as the casts themselves.
:func:`workers.fp8.quant.quantize_dual` keeps the BF16 values in its tensors' dequantization
memo, so the GEMMs read them without decoding a byte.

Bit for bit the eager :func:`workers.fp8.quant.quantize_dual` and ``dequantize(torch.bfloat16)``:
the same IEEE operations on the same values (a max in any order, one division, done as a
product by the scale's reciprocal, which is exact for a power of two, so it rounds the same real
number; one rounding cast, one exact product; ``tests/workers/fp8/test_cpu_compiled.py``
compares every byte, scale and BF16 value, over partial blocks, both formats, both input dtypes
and extreme magnitudes, and the scales at every power-of-two boundary against a float64
reference; the bytes are made on first read there).

An activation that one GEMM reads (generation's FP8 linears, and dgrad's output gradient where
that is quantized alone) takes the rows half of the same call (:func:`_rows`,
:func:`workers.fp8.quant.quantize_rows`). A trainer's FP8 weights after each optimizer step
(:mod:`workers.fp8.weights`, 128x128 blocks) take the same road, one call each: the bytes, the
scales and the BF16 values the GEMMs read (:func:`workers.fp8.quant.quantize_weight_compiled`; a
fused group's operand is its members' stacked), the eager quantizer's bytes and scales.

Used where it pays and is safe: a 2-D CPU tensor, power-of-two scales, every value finite (a
NaN or inf takes the eager path, which reports it exactly as before). ``FP8RL_CPU_COMPILE=0``
turns it off; a machine where Inductor cannot build (no C++ compiler) falls back to the eager
path once, with a warning. The first call per process compiles (~5-20 s on 2 cores); Inductor's
cache on disk serves later processes.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CPU_COMPILE_ENV = "FP8RL_CPU_COMPILE"
_TILE = 128

# None: not tried yet; False: off (the switch, or a failed build); else the compiled calls
# (an activation's two layouts, a weight's blocks)
_COMPILED: tuple[Any, ...] | bool | None = None


_TINY = torch.finfo(torch.float32).tiny
_BF16_MAX = torch.finfo(torch.bfloat16).max
_EXPONENT_CARRY, _EXPONENT_MASK = 0x7FFFFF, -0x800000  # float32: mantissa bits, sign and exponent


def _pow2_scales(amax: torch.Tensor, fmt_max: torch.Tensor) -> torch.Tensor:
    """:func:`workers.fp8.quant.amax_to_scale` with power-of-two scales, in float32 bit
    arithmetic Inductor compiles: ``amax / fmt_max`` (an IEEE division by the 0-d tensor, as the
    eager one), at least float32's smallest normal, then rounded up to a power of two by adding
    the mantissa's all-ones and keeping sign and exponent (an exact power keeps its exponent,
    anything above it carries into the next; every scale here is a positive normal). The eager
    ``frexp``/``ldexp`` bits for every finite ``amax``; a NaN or inf maximum gives garbage here,
    and the caller takes the eager path on the ``finite`` flag."""
    scale = (amax / fmt_max).clamp(min=_TINY)
    bits = scale.view(torch.int32)
    return ((bits + _EXPONENT_CARRY) & _EXPONENT_MASK).view(torch.float32)


def _within(
    amax: torch.Tensor, scale: torch.Tensor, exact_scale: torch.Tensor, top_scale: torch.Tensor
) -> torch.Tensor:
    """Whether every block maximum is finite, and every block is zero or has a scale of at least
    ``exact_scale`` and at most ``top_scale`` (a 0-d bool tensor)."""
    exact = ((amax == 0) | (scale >= exact_scale)) & (scale <= top_scale)
    return torch.isfinite(amax).all() & exact.all()


def _values(xf: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``xf``'s FP8 values (cast to ``dtype``) times their scale, in BF16; ``scale`` is each
    element's block scale as a view. ``xf`` times 1/scale, not ``xf / scale``: a power of two in
    [2^-126, 2^127] has an exact reciprocal, so both are the rounding of the same real number (bit
    for bit), and a product is cheaper."""
    return ((xf * (1.0 / scale)).to(dtype).float() * scale).to(torch.bfloat16)


# Each element's scale as a view of the block scales (element (i, j) reads scale[i, j // 128], or
# scale_c[i // 128, j]): the values are written in x's layout, with no padded copy to slice. Not
# an index tensor (scale[:, arange(k) // 128]): on that, torch 2.13's Inductor splits the loop at
# the division and drops the last partial block (its loop split does not check that 128 divides
# the size); the bit-for-bit tests over partial blocks catch it.
def _along_k(t: torch.Tensor, m: int, k: int) -> torch.Tensor:  # [M, nK] -> [M, K]
    nk = t.shape[1]
    return t.unsqueeze(-1).expand(m, nk, _TILE).reshape(m, nk * _TILE)[:, :k]


def _along_m(t: torch.Tensor, m: int, k: int) -> torch.Tensor:  # [nM, K] -> [M, K]
    nm = t.shape[0]
    return t.unsqueeze(1).expand(nm, _TILE, k).reshape(nm * _TILE, k)[:m]


def _rows(
    x: torch.Tensor,
    fmt_max: torch.Tensor,
    exact_scale: torch.Tensor,
    top_scale: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` in 1x128 tiles along K with power-of-two scales, in one compiled call (a
    GEMM's first operand where no second layout is needed: generation, and the output gradient
    of dgrad), and the first half of :func:`_dual`: ``(ok, scale [M, nK], d)``, as there."""
    m, k = x.shape
    nk = -(-k // _TILE)
    xf = x.float()
    amax = F.pad(xf.abs(), (0, nk * _TILE - k)).reshape(m, nk, _TILE).amax(-1)  # [M, nK]
    scale = _pow2_scales(amax, fmt_max)
    return _within(amax, scale, exact_scale, top_scale), scale, _values(xf, _along_k(scale, m, k), dtype)


def _dual(
    x: torch.Tensor,
    fmt_max: torch.Tensor,
    exact_scale: torch.Tensor,
    top_scale: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """Both layouts of ``x [M, K]`` with power-of-two scales, in one compiled call:
    ``(ok, scale [M, nK], scale_t [K, nM], d, d_c, scale_c [nM, K])``. ``d``: ``x``'s FP8 values
    in 1x128 tiles along K times their scale, in BF16 (:func:`_rows`); ``d_c``: the same for
    ``x``'s 128x1 tiles (``x.T``'s 1x128 tiles) in ``x``'s layout, both ``[M, K]``; ``scale_c``:
    ``scale_t`` untransposed (see the end). The FP8 bytes are not written (the GEMMs read the BF16
    values; :class:`workers.fp8.fp8_tensor.Fp8Tensor` makes them from these on first read).
    ``ok``: every block maximum is finite, and every block is zero or has a scale of at least
    ``exact_scale`` and at most ``top_scale`` (then each nonzero FP8 value times its scale is a
    finite BF16 normal, so the BF16 values give the bytes back exactly); else nothing else is
    meaningful. Zero padding never raises a maximum. The values go through ``dtype`` (the cast
    rounds as the eager one does)."""
    m, k = x.shape
    nm = -(-m // _TILE)
    ok, scale, d = _rows(x, fmt_max, exact_scale, top_scale, dtype)
    xf = x.float()
    amax_c = F.pad(xf.abs(), (0, 0, 0, nm * _TILE - m)).reshape(nm, _TILE, k).amax(1)  # [nM, K]
    scale_c = _pow2_scales(amax_c, fmt_max)
    ok = ok & _within(amax_c, scale_c, exact_scale, top_scale)
    d_c = _values(xf, _along_m(scale_c, m, k), dtype)
    # scale_c [nM, K] is an output of its own (unused by the caller) so that Inductor writes it
    # once: otherwise d_c's loop, which reads only the transposed copy's source, recomputes each
    # element's scale from amax_c (a division, a clamp, two bit casts through scalar loops) and
    # the call takes 1.5-1.7x as long at SmolLM2's shapes (8.9 -> 5.3 ms at [3648, 1536])
    return ok, scale, scale_c.t().contiguous(), d, d_c, scale_c


def _weight(
    w: torch.Tensor, fmt_max: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight ``[N, K]`` in 128x128 blocks with power-of-two scales, in one compiled call:
    ``(finite, scale [nN, nK], q, d)``, the bytes and those bytes times their block's scale in
    BF16 (the operand of its ``emulate_bf16`` GEMMs)."""
    n, k = w.shape
    nn_, nk = -(-n // _TILE), -(-k // _TILE)
    wf = w.float()
    y = F.pad(wf, (0, nk * _TILE - k, 0, nn_ * _TILE - n)).reshape(nn_, _TILE, nk, _TILE)
    amax = y.abs().amax(dim=(1, 3))
    finite = torch.isfinite(amax).all()
    scale = _pow2_scales(amax, fmt_max)
    # each element's block scale as a view, as in _dual: no padded copy to slice
    s = scale[:, None, :, None].expand(nn_, _TILE, nk, _TILE).reshape(nn_ * _TILE, nk * _TILE)[:n, :k]
    q = (wf / s).to(dtype)
    return finite, scale, q, (q.float() * s).to(torch.bfloat16)


def enabled() -> bool:
    """Whether the compiled quantizer may run (``FP8RL_CPU_COMPILE``, default on; read once)."""
    global _COMPILED
    if _COMPILED is None:
        value = os.environ.get(CPU_COMPILE_ENV, "1").strip()
        if value not in ("0", "1"):
            raise ValueError(f"{CPU_COMPILE_ENV}={value!r}: use 1 (compile, the default) or 0 (eager)")
        passes = (_dual, _weight, _rows)
        _COMPILED = tuple(torch.compile(f, dynamic=True) for f in passes) if value == "1" else False
    return _COMPILED is not False


def _call(index: int, x: torch.Tensor, *args: Any) -> Any:
    """Compiled call ``index`` on ``x`` (an activation's two layouts, a weight's blocks, or an
    activation's rows), or
    None where the eager path must run: turned off, its ``ok`` flag false (a block maximum that
    is NaN or inf, which the eager path reports), or Inductor could not build here (then off for
    the rest of the process, with a warning)."""
    global _COMPILED
    if not enabled():
        return None
    assert isinstance(_COMPILED, tuple)
    try:
        out = _COMPILED[index](x.detach(), *args)
    except Exception as err:  # Inductor could not build here: eager from now on
        log.warning(
            "the compiled FP8 quantizer is off in this process (%s: %s); eager instead",
            type(err).__name__,
            err,
        )
        _COMPILED = False
        return None
    return out[1:] if bool(out[0]) else None


@functools.cache
def _scalar(value: float) -> torch.Tensor:
    """A float32 0-d tensor, made once per value (the compiled code only reads it): the compiled
    code divides by it (an IEEE division, as eager) and compares with it, and Dynamo does not
    build again for another value."""
    return torch.full((), value, dtype=torch.float32)


@functools.cache
def _bounds(fmt_max: float, min_subnormal: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The format's maximum and the scale bounds of an activation's compiled call, as the 0-d
    tensors it reads: ``2^-126 / min_subnormal`` and the largest power of two whose product with
    ``fmt_max`` is a finite BF16."""
    top = 2.0 ** math.floor(math.log2(_BF16_MAX / fmt_max))
    return _scalar(fmt_max), _scalar(_TINY / min_subnormal), _scalar(top)


def quantize_dual(
    x: torch.Tensor, fmt_max: float, min_subnormal: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`_dual` compiled, ``(scale, scale_t, d, d_c)``, or None where the eager path must run
    (:func:`_call`; also a nonzero block whose scale is under ``2^-126 / min_subnormal``, the
    format's smallest subnormal, or over the largest power of two whose product with the format's
    maximum is a finite BF16, 2^119 for E4M3 and 2^112 for E5M2: its BF16 values could not give
    the bytes back)."""
    out: tuple[torch.Tensor, ...] | None = _call(0, x, *_bounds(fmt_max, min_subnormal), dtype)
    return None if out is None else out[:4]  # type: ignore[return-value]


def quantize_rows(
    x: torch.Tensor, fmt_max: float, min_subnormal: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`_rows` compiled, ``(scale, d)``, or None where the eager path must run (as
    :func:`quantize_dual`)."""
    out: tuple[torch.Tensor, ...] | None = _call(2, x, *_bounds(fmt_max, min_subnormal), dtype)
    return out  # type: ignore[return-value]


def quantize_weight(
    w: torch.Tensor, fmt_max: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`_weight` compiled, ``(scale, q, d)``, or None where the eager path must run
    (:func:`_call`)."""
    out: tuple[torch.Tensor, ...] | None = _call(1, w, _scalar(fmt_max), dtype)
    return out  # type: ignore[return-value]
