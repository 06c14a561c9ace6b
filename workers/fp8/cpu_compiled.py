"""The training quantizer of power-of-two scales on a CPU, compiled: both layouts of an activation
or output gradient, and their BF16 dequantizations, in two passes over it.

With ``precision.power_of_two_scales`` a CPU runs each FP8 GEMM as a BF16 GEMM of the dequantized
operands (kernel ``emulate_bf16``, :func:`workers.fp8.matmul.matmul_bf16`). Eagerly, each operand
then costs a quantization (|x|, two block maxima, two divisions, two casts to FP8, a byte
transpose) and a dequantization (a table decode of every byte, a product, a cast to BF16): on
SmolLM2's MLP those took ~7x the BF16 GEMMs they feed. Here Inductor (torch.compile's C++ backend)
fuses them into one pass for the block maxima and one that writes, for each layout, the FP8
bytes and ``bytes x scale`` in BF16; the scales between the two are
:func:`workers.fp8.quant.amax_to_scale`'s own.
:func:`workers.fp8.quant.quantize_dual` keeps the BF16 values in its tensors' dequantization
memo, so the GEMMs read them without decoding a byte.

Bit for bit the eager :func:`workers.fp8.quant.quantize_dual` and ``dequantize(torch.bfloat16)``:
the same IEEE operations on the same values (a max in any order, one division, one rounding
cast, one exact product; ``tests/workers/fp8/test_cpu_compiled.py`` compares every byte, scale
and BF16 value, over partial blocks, both formats and both input dtypes). One thing differs on
purpose: ``x.T``'s bytes are a transposed view of a ``[M, K]`` buffer, not a contiguous
``[K, M]`` copy (nothing on the CPU reads them through their layout; the GEMM reads the memo).

A trainer's FP8 weights after each optimizer step (:mod:`workers.fp8.weights`, 128x128 blocks)
take the same road: one pass for the block maxima, one that writes the bytes and the BF16 values
the GEMMs read (:func:`workers.fp8.quant.quantize_weight_compiled`; a fused group's operand is its
members' stacked), the eager quantizer's bytes and scales.

Used where it pays and is safe: a 2-D CPU tensor, power-of-two scales, every value finite (a
NaN or inf takes the eager path, which reports it exactly as before). ``FP8RL_CPU_COMPILE=0``
turns it off; a machine where Inductor cannot build (no C++ compiler) falls back to the eager
path once, with a warning. The first call per process compiles (~5-20 s on 2 cores); Inductor's
cache on disk serves later processes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CPU_COMPILE_ENV = "FP8RL_CPU_COMPILE"
_TILE = 128

# None: not tried yet; False: off (the switch, or a failed build); else the compiled passes
# (activations: block maxima, both casts; weights: block maxima, cast)
_COMPILED: tuple[Any, ...] | bool | None = None


def _block_maxima(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """|x|'s maxima over 1x128 tiles along K ``[M, ceil(K/128)]`` and over 128x1 tiles along M
    ``[ceil(M/128), K]`` (x.T's 1x128 tiles), in float32; zero padding never raises a max."""
    m, k = x.shape
    nk, nm = -(-k // _TILE), -(-m // _TILE)
    a = x.abs().float()
    rows = F.pad(a, (0, nk * _TILE - k)).reshape(m, nk, _TILE).amax(-1)
    cols = F.pad(a, (0, 0, 0, nm * _TILE - m)).reshape(nm, _TILE, k).amax(1)
    return rows, cols


def _cast_both(
    x: torch.Tensor, scale: torch.Tensor, scale_c: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x / scale`` cast to ``dtype`` and those bytes times the scale in BF16, for the rows layout
    (``scale [M, nK]``) and for the columns one (``scale_c [nM, K]``), all ``[M, K]``."""
    m, k = x.shape
    nk, nm = -(-k // _TILE), -(-m // _TILE)
    xf = x.float()
    y = F.pad(xf, (0, nk * _TILE - k)).reshape(m, nk, _TILE) / scale.unsqueeze(-1)
    q = y.to(dtype)
    d = (q.float() * scale.unsqueeze(-1)).to(torch.bfloat16)
    y_c = F.pad(xf, (0, 0, 0, nm * _TILE - m)).reshape(nm, _TILE, k) / scale_c.unsqueeze(1)
    q_c = y_c.to(dtype)
    d_c = (q_c.float() * scale_c.unsqueeze(1)).to(torch.bfloat16)
    return (
        q.reshape(m, nk * _TILE)[:, :k].contiguous(),
        d.reshape(m, nk * _TILE)[:, :k].contiguous(),
        q_c.reshape(nm * _TILE, k)[:m].contiguous(),
        d_c.reshape(nm * _TILE, k)[:m].contiguous(),
    )


def _weight_maxima(w: torch.Tensor) -> torch.Tensor:
    """|w|'s maxima over 128x128 blocks, ``[ceil(N/128), ceil(K/128)]`` float32 (a weight's scale grid)."""
    n, k = w.shape
    nn_, nk = -(-n // _TILE), -(-k // _TILE)
    a = F.pad(w.abs().float(), (0, nk * _TILE - k, 0, nn_ * _TILE - n))
    return a.reshape(nn_, _TILE, nk, _TILE).amax(dim=(1, 3))


def _weight_cast(
    w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w / scale`` per 128x128 block cast to ``dtype`` and those bytes times the scale in BF16,
    both ``[N, K]``: a weight's FP8 copy and the BF16 operand of its ``emulate_bf16`` GEMMs."""
    n, k = w.shape
    nn_, nk = scale.shape
    y = F.pad(w.float(), (0, nk * _TILE - k, 0, nn_ * _TILE - n)).reshape(nn_, _TILE, nk, _TILE)
    q = (y / scale[:, None, :, None]).to(dtype)
    d = (q.float() * scale[:, None, :, None]).to(torch.bfloat16)
    return (
        q.reshape(nn_ * _TILE, nk * _TILE)[:n, :k].contiguous(),
        d.reshape(nn_ * _TILE, nk * _TILE)[:n, :k].contiguous(),
    )


def enabled() -> bool:
    """Whether the compiled quantizer may run (``FP8RL_CPU_COMPILE``, default on; read once)."""
    global _COMPILED
    if _COMPILED is None:
        value = os.environ.get(CPU_COMPILE_ENV, "1").strip()
        if value not in ("0", "1"):
            raise ValueError(f"{CPU_COMPILE_ENV}={value!r}: use 1 (compile, the default) or 0 (eager)")
        passes = (_block_maxima, _cast_both, _weight_maxima, _weight_cast)
        _COMPILED = tuple(torch.compile(f, dynamic=True) for f in passes) if value == "1" else False
    return _COMPILED is not False


def _first_pass(index: int, x: torch.Tensor) -> Any:
    """Compiled pass ``index`` of ``x`` (the maxima pass of an activation or a weight), or None
    where the eager path must run: turned off, or Inductor could not build here (then off for the
    rest of the process, with a warning). The casts run after it, so they find it built."""
    global _COMPILED
    if not enabled():
        return None
    assert isinstance(_COMPILED, tuple)
    try:
        return _COMPILED[index](x.detach())
    except Exception as err:  # Inductor could not build here: eager from now on
        log.warning(
            "the compiled FP8 quantizer is off in this process (%s: %s); eager instead",
            type(err).__name__,
            err,
        )
        _COMPILED = False
        return None


def block_maxima(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`_block_maxima` compiled, or None where the eager path must run (:func:`_first_pass`)."""
    out: tuple[torch.Tensor, torch.Tensor] | None = _first_pass(0, x)
    return out


def weight_maxima(w: torch.Tensor) -> torch.Tensor | None:
    """:func:`_weight_maxima` compiled, or None where the eager path must run (:func:`_first_pass`)."""
    out: torch.Tensor | None = _first_pass(2, w)
    return out


def weight_cast(
    w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_weight_cast` compiled (after :func:`weight_maxima` answered, so it is built)."""
    assert isinstance(_COMPILED, tuple)
    out: tuple[torch.Tensor, torch.Tensor] = _COMPILED[3](w.detach(), scale, dtype)
    return out


def cast_both(
    x: torch.Tensor, scale: torch.Tensor, scale_c: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_cast_both` compiled (after :func:`block_maxima` answered, so it is built)."""
    assert isinstance(_COMPILED, tuple)
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] = _COMPILED[1](
        x.detach(), scale, scale_c, dtype
    )
    return out
