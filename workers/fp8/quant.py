"""Scaled FP8 quantization: tensorwise, 1x128 tiles and 128x128 blocks.

A tensor ``x`` is stored as ``data`` (float8) and ``scale`` (float32, one per block), so that

    x ~= dequantize = data.float() * scale          (scale broadcast over its block)

The scale of a block is ``amax(|x_block|) / fmt.max``: the largest element of the block lands
exactly on the format's largest finite value, and everything else keeps the format's relative
precision (unit roundoff u = 1/16 for E4M3) as long as it stays above the smallest normal number
times the scale. That last condition is why blocks help: one huge outlier in a tensorwise scale
pushes every small element of the tensor into the subnormal range, where precision is lost; with
blocks only the outlier's own block pays.

Blocks apply to the last two dimensions (``block=(rows, cols)``); leading dimensions are batch.
Shapes that are not multiples of the block are handled: the last block of a row or column is
partial, and its scale comes from the elements it has. Casts saturate at ``fmt.max`` (torch's own
cast would give NaN for E4M3 and inf for E5M2). ``power_of_two=True`` rounds every scale up to a
power of two, so that scaling is exact in binary and dequantization multiplies by 2^k only.

Layouts used by the rest of fp8rl (DeepSeek-V3 style): weights ``[out, in]`` in 128x128 blocks, so
the same FP8 copy serves ``x @ W.T`` and ``dy @ W``; activations and gradients in 1x128 tiles
along the contraction dimension.
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch
import torch.nn.functional as F

from workers.fp8 import cpu_compiled
from workers.fp8.block_ops import (
    abs_cpu,
    all_finite,
    apply_block_scale,
    block_grid,
    block_max_cpu,
    scaled_cast_cpu,
)
from workers.fp8.formats import Fp8Format, get_format
from workers.fp8.fp8_tensor import Block, BLOCK_128x128, Fp8Tensor, LazyBytesFp8Tensor, TILE_1x128
from workers.fp8.guard import check_input, check_known_finite

# Smallest scale we allow: an all-zero block gets this, and its data is all zeros anyway.
_MIN_SCALE = torch.finfo(torch.float32).tiny


def _check_block(block: Block, x: torch.Tensor) -> tuple[int, int] | None:
    if block is None:
        return None
    if (
        not isinstance(block, tuple | list)
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(
            f"block={block!r} is not valid; use None (one scale per tensor), (1, 128) "
            "(activation tiles) or (128, 128) (weight blocks): two positive integers"
        )
    if x.dim() < 2:
        raise ValueError(
            f"block={tuple(block)} needs a tensor with at least 2 dimensions, got shape "
            f"{tuple(x.shape)}; reshape it to [1, n] or use block=None"
        )
    return (int(block[0]), int(block[1]))


def _round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    # frexp: scale = mantissa * 2**exponent with mantissa in [0.5, 1); exact powers of two have
    # mantissa 0.5 and stay, everything else rounds up so that no element saturates.
    mantissa, exponent = torch.frexp(scale)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(scale), exponent)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Max |x| of every ``block`` of the last two dims: ``[*lead, ceil(R/br), ceil(C/bc)]``."""
    if x.device.type == "cpu":
        amax = block_max_cpu(abs_cpu(x), block)
        if all_finite(amax):
            return amax
    return _block_amax_padded(x, block)


def _block_amax_padded(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """:func:`block_amax` through a zero-padded copy (every device but the CPU's fast path)."""
    br, bc = block
    rows, cols = x.shape[-2:]
    n_r, n_c = math.ceil(rows / br), math.ceil(cols / bc)
    xp = x.to(torch.float32)
    if n_r * br != rows or n_c * bc != cols:
        xp = F.pad(xp, (0, n_c * bc - cols, 0, n_r * br - rows))  # zeros never raise an amax
    blocks = xp.reshape(*x.shape[:-2], n_r, br, n_c, bc)  # [*lead, nR, br, nC, bc]
    return blocks.abs().amax(dim=(-3, -1))  # [*lead, nR, nC]


def amax_to_scale(amax: torch.Tensor, fmt: Fp8Format, power_of_two: bool = False) -> torch.Tensor:
    """Scale that maps ``amax`` onto ``fmt.max`` (float32; rounded up to 2^k if asked)."""
    # IEEE division on every device: CUDA turns a division by a Python number into a product with
    # its float32 reciprocal, which is off by an ulp for some inputs (and from the Triton kernel)
    fmt_max = torch.full((), fmt.max, dtype=torch.float32, device=amax.device)
    scale = (amax.to(torch.float32) / fmt_max).clamp(min=_MIN_SCALE)
    return _round_up_pow2(scale) if power_of_two else scale


def use_triton() -> bool:
    """The one-pass Triton quantizer serves 1x128 tiles on CUDA unless ``FP8RL_TRITON=0``."""
    global _TRITON
    if _TRITON is None:
        _TRITON = (
            os.environ.get("FP8RL_TRITON", "1") != "0" and importlib.util.find_spec("triton") is not None
        )
    return _TRITON


_TRITON: bool | None = None


def _quantize_triton(
    x: torch.Tensor, f: Fp8Format, power_of_two: bool, check: bool, where: str, rows_out: int
) -> Fp8Tensor:
    from workers.fp8.guard import active_guard
    from workers.fp8.triton_quant import quantize_1x128

    guard = active_guard() if check else None
    slot = guard.reserve(x.device, tuple(x.shape), TILE_1x128, where) if guard is not None else None
    data, scale = quantize_1x128(x, f.name, f.max, f.dtype, power_of_two, slot, rows_out)
    return Fp8Tensor(data, scale, TILE_1x128, f)


def quantize_rows(
    x: torch.Tensor,
    fmt: str | Fp8Format,
    *,
    power_of_two: bool = False,
    where: str = "quantize",
    rows_multiple: int = 1,
) -> Fp8Tensor:
    """:func:`quantize` in 1x128 tiles of a 2-D ``x``, for a GEMM's first operand.

    On CUDA (the Triton kernel) the result may have more rows than ``x``: up to a multiple of
    ``rows_multiple``, zeros with scale 1, written in the same pass so that the GEMM needs no
    padded copy (its extra output rows are dropped by the caller). The scales are laid out
    M-major (stride 1 along rows), as cuBLAS's blockwise GEMM reads them.
    """
    f = get_format(fmt)
    if x.is_cuda and x.dim() == 2 and use_triton():
        rows = -(-x.shape[0] // rows_multiple) * rows_multiple
        return _quantize_triton(x.detach(), f, power_of_two, True, where, rows)
    if power_of_two and x.device.type == "cpu" and x.dim() == 2:
        q = _quantize_rows_compiled(x, f, where)  # None: the eager path below
        if q is not None:
            return q
    return quantize(x, f, TILE_1x128, power_of_two=power_of_two, where=where)


def _quantize_rows_compiled(x: torch.Tensor, f: Fp8Format, where: str) -> Fp8Tensor | None:
    """:func:`quantize_rows` of power-of-two scales on the CPU through
    :mod:`workers.fp8.cpu_compiled` (one compiled call), as :func:`_quantize_dual_compiled`'s
    first layout: the eager path's scales, the BF16 values kept for the ``emulate_bf16`` GEMM
    and the bytes made from them on first read; None where the eager path must run."""
    _check_quantizable(x)
    out = cpu_compiled.quantize_rows(x, f.max, f.min_subnormal, f.dtype)
    if out is None:
        return None
    scale, d = out
    check_known_finite(tuple(x.shape), TILE_1x128, where)
    return LazyBytesFp8Tensor(scale, f, {str(torch.bfloat16): d})


def quantize_dual(
    x: torch.Tensor,
    fmt: str | Fp8Format,
    *,
    power_of_two: bool = False,
    where: str = "quantize",
    rows_multiple: int = 1,
    pad_tokens: bool = False,
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """A 2-D ``x [M, K]`` for the two GEMMs that read it: ``x`` in 1x128 tiles along K (as
    :func:`quantize_rows`) and ``x.T [K, M]`` in 1x128 tiles along M (as ``quantize(x.t(), fmt,
    (1, 128))``), the activation's or the output gradient's two layouts in training.

    On CUDA one Triton kernel reads each 128x128 tile of ``x`` once and writes both layouts and
    both scale tensors (:func:`workers.fp8.triton_dual.quantize_1x128_dual`); elsewhere it is
    those two calls. Either way the bytes and scales are the two calls' (tested under Triton's
    interpreter), and a NaN/inf in ``x`` is reported once, for ``x``'s own tiles. On CUDA,
    ``pad_tokens`` writes ``x.T`` as ``[K, M']`` with M' the next multiple of 128, zeros past M
    (the wgrad GEMM contracts over M, and cuBLAS's blockwise kernel wants it a multiple of 128:
    no padded copy per call); the scales are the same.
    """
    f = get_format(fmt)
    if x.is_cuda and x.dim() == 2 and use_triton():
        from workers.fp8.guard import active_guard
        from workers.fp8.triton_dual import quantize_1x128_dual

        guard = active_guard()
        slot = guard.reserve(x.device, tuple(x.shape), TILE_1x128, where) if guard is not None else None
        rows = -(-x.shape[0] // rows_multiple) * rows_multiple
        tokens = -(-x.shape[0] // 128) * 128 if pad_tokens else x.shape[0]
        data, scale, data_t, scale_t = quantize_1x128_dual(
            x.detach(), f.name, f.max, f.dtype, power_of_two, slot, rows, tokens
        )
        return Fp8Tensor(data, scale, TILE_1x128, f), Fp8Tensor(data_t, scale_t, TILE_1x128, f)
    if x.device.type == "cpu" and x.dim() == 2:
        if power_of_two:  # compiled, with the BF16 operands of the emulate_bf16 GEMMs (None: eager)
            both = _quantize_dual_compiled(x, f, where)
            if both is not None:
                return both
        return _quantize_dual_cpu(x, f, power_of_two, where)
    rows_q = quantize_rows(x, f, power_of_two=power_of_two, where=where, rows_multiple=rows_multiple)
    return rows_q, quantize(x.t(), f, TILE_1x128, power_of_two=power_of_two, where=where)


def _quantize_dual_compiled(x: torch.Tensor, f: Fp8Format, where: str) -> tuple[Fp8Tensor, Fp8Tensor] | None:
    """:func:`quantize_dual` of power-of-two scales on the CPU through
    :mod:`workers.fp8.cpu_compiled` (one compiled call): the eager path's scales, each result
    keeping its BF16 dequantization and making the eager path's bytes from it on first read
    (:class:`LazyBytesFp8Tensor`; ``x.T``'s as a transposed view of an ``[M, K]`` tensor). None where
    the eager path must run: the compiled one is off or not built, ``x`` has a NaN or inf (the
    eager path reports it as before), or a nonzero block is so small that its BF16 values are
    not exact."""
    _check_quantizable(x)
    out = cpu_compiled.quantize_dual(x, f.max, f.min_subnormal, f.dtype)
    if out is None:
        return None
    scale, scale_t, d, d_c = out
    check_known_finite(tuple(x.shape), TILE_1x128, where)  # the two calls' checks, in their order
    check_known_finite((x.shape[1], x.shape[0]), TILE_1x128, where)
    bf16 = str(torch.bfloat16)  # the dequantize() memo's key
    rows = LazyBytesFp8Tensor(scale, f, {bf16: d})
    cols = LazyBytesFp8Tensor(scale_t, f, {bf16: d_c.t()})
    return rows, cols


def quantize_weight_compiled(w: torch.Tensor, f: Fp8Format, where: str) -> Fp8Tensor | None:
    """:func:`quantize` of a 2-D CPU weight in 128x128 blocks with power-of-two scales through
    :mod:`workers.fp8.cpu_compiled` (one compiled call), its BF16 dequantization kept in the
    result's memo (the ``emulate_bf16`` GEMMs' operand): the eager path's bytes and scales. None
    where the eager path must run: off or not built, not a 2-D CPU tensor, or a NaN or inf (the
    eager path reports it)."""
    if w.device.type != "cpu" or w.dim() != 2:
        return None
    _check_quantizable(w)
    out = cpu_compiled.quantize_weight(w, f.max, f.dtype)
    if out is None:
        return None
    scale, q, d = out
    check_known_finite(tuple(w.shape), BLOCK_128x128, where)
    return Fp8Tensor(q, scale, BLOCK_128x128, f, True, {str(torch.bfloat16): d})


def _dual_scales(
    x: torch.Tensor, amax: torch.Tensor, amax_t: torch.Tensor, f: Fp8Format, power_of_two: bool, where: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The scales of ``x``'s two layouts from their block maxima (``amax [M, ceil(K/128)]``,
    ``amax_t [K, ceil(M/128)]``), after the two calls' checks in their order; None when a maximum
    is NaN or inf (the caller takes the padded path, which reports it as the two calls did)."""
    if not (all_finite(amax) and all_finite(amax_t)):
        return None
    check_input(x, amax, TILE_1x128, where)
    check_input(x.t(), amax_t, TILE_1x128, where)
    return amax_to_scale(amax, f, power_of_two), amax_to_scale(amax_t, f, power_of_two)


def _quantize_dual_cpu(
    x: torch.Tensor, f: Fp8Format, power_of_two: bool, where: str
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """:func:`quantize_dual` on the CPU: the two calls' bytes and scales (and their checks, in
    their order), from one |x| and without reading x through its transpose: ``x.T``'s 1x128
    tiles are x's 128x1 tiles, scaled in x's layout and transposed as bytes."""
    _check_quantizable(x)
    x = x.detach()
    a = abs_cpu(x)  # [M, K], read by both amaxes
    amax = block_max_cpu(a, TILE_1x128)  # [M, ceil(K/128)]
    amax_t = block_max_cpu(a, (128, 1)).t().contiguous()  # [K, ceil(M/128)]
    scales = _dual_scales(x, amax, amax_t, f, power_of_two, where)
    if scales is None:  # the two calls, as they were
        pad = (_quantize_padded(y, f, TILE_1x128, power_of_two, True, where) for y in (x, x.t()))
        return next(pad), next(pad)
    scale, scale_t = scales
    scratch = a if a.dtype == torch.float32 and a.is_contiguous() else None  # |x| is spent
    data = scaled_cast_cpu(x, scale, TILE_1x128, f, False, scratch)  # [M, K]
    data_t = scaled_cast_cpu(x, scale_t.t(), (128, 1), f, False, scratch).t().contiguous()  # [K, M]
    return Fp8Tensor(data, scale, TILE_1x128, f), Fp8Tensor(data_t, scale_t, TILE_1x128, f)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str | Fp8Format, block: Block = None) -> Fp8Tensor:
    """Quantize ``x`` with given scales (e.g. calibrated KV-cache scales): saturating cast."""
    f = get_format(fmt)
    blk = _check_block(block, x)
    scale = scale.to(device=x.device, dtype=torch.float32)
    if blk is not None and x.device.type == "cpu" and tuple(scale.shape[-2:]) == block_grid(x, blk):
        return Fp8Tensor(scaled_cast_cpu(x, scale, blk, f), scale, blk, f)
    return _cast_padded(x, scale, f, blk)


def _cast_padded(x: torch.Tensor, scale: torch.Tensor, f: Fp8Format, blk: Block) -> Fp8Tensor:
    scaled = apply_block_scale(x.to(torch.float32), scale, blk, divide=True)
    q = scaled.clamp_(-f.max, f.max).to(f.dtype)
    return Fp8Tensor(q.contiguous(), scale, blk, f)


def _check_quantizable(x: torch.Tensor) -> None:
    if not torch.is_floating_point(x) or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"quantize needs a float32/bf16/fp16 tensor, got dtype {x.dtype}")


def quantize(
    x: torch.Tensor,
    fmt: str | Fp8Format = "e4m3",
    block: Block = None,
    *,
    power_of_two: bool = False,
    check_finite: bool = True,
    where: str = "quantize",
) -> Fp8Tensor:
    """Quantize ``x`` to FP8 with one float32 scale per ``block`` (``None``: per tensor).

    Args:
        x: floating-point tensor; with a block, at least 2-D (blocks tile the last two dims).
        fmt: ``"e4m3"`` (max 448) or ``"e5m2"`` (max 57344).
        block: ``None``, ``(1, 128)``, ``(128, 128)`` or any ``(rows, cols)``.
        power_of_two: round each scale up to a power of two.
        check_finite: check for NaN/inf (default on). Inside a :func:`~workers.fp8.guard.finite_guard`
            the check is a device-side flag read once when the guard ends (no host sync here);
            outside one, a CPU tensor is checked at once. Either way the error is a
            :class:`~workers.fp8.guard.NonFiniteError` (a ``ValueError``) that says where.
        where: what is being quantized, for that error (e.g. ``"layers.0.mlp.up_proj: input"``).

    Returns:
        An :class:`Fp8Tensor`; ``.dequantize()`` gives back ``x`` within the format's precision.
    """
    f = get_format(fmt)
    _check_quantizable(x)
    blk = _check_block(block, x)
    if blk == TILE_1x128 and x.dim() == 2 and x.is_cuda and use_triton():
        return _quantize_triton(x.detach(), f, power_of_two, check_finite, where, x.shape[0])
    if blk is not None and x.device.type == "cpu":
        return _quantize_blocks_cpu(x, f, blk, power_of_two, check_finite, where)
    return _quantize_padded(x, f, blk, power_of_two, check_finite, where)


def _quantize_blocks_cpu(
    x: torch.Tensor, f: Fp8Format, blk: tuple[int, int], power_of_two: bool, check_finite: bool, where: str
) -> Fp8Tensor:
    """:func:`quantize` with blocks on the CPU: no padded copies, no clamp (see
    :func:`scaled_cast_cpu`), |x| reused as the scaling pass's buffer."""
    a = abs_cpu(x.detach())
    amax = block_max_cpu(a, blk)
    if not all_finite(amax):
        return _quantize_padded(x, f, blk, power_of_two, check_finite, where)
    if check_finite:
        check_input(x, amax, blk, where)
    scale = amax_to_scale(amax, f, power_of_two)
    scratch = a if a.dtype == torch.float32 and a.is_contiguous() else None
    return Fp8Tensor(scaled_cast_cpu(x.detach(), scale, blk, f, False, scratch), scale, blk, f)


def _quantize_padded(
    x: torch.Tensor, f: Fp8Format, blk: Block, power_of_two: bool, check_finite: bool, where: str
) -> Fp8Tensor:
    """:func:`quantize` off the Triton path: amax and a saturating cast through padded copies."""
    amax = x.detach().abs().amax().to(torch.float32) if blk is None else _block_amax_padded(x.detach(), blk)
    if check_finite:
        check_input(x, amax, blk, where)
    return _cast_padded(x.detach(), amax_to_scale(amax, f, power_of_two), f, blk)
