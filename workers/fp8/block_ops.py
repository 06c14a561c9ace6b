"""Per-block arithmetic of scaled FP8 quantization (:mod:`workers.fp8.quant`), on plain tensors:
a scale broadcast over its blocks (:func:`apply_block_scale`, the padded formula every device
runs), and the CPU path that gives the same bytes without padded copies (block maxima, the
scaled cast and the dequantization through views of whole blocks, the partial tail blocks apart).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from workers.fp8.formats import Fp8Format, to_float32


def apply_block_scale(
    x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, divide: bool
) -> torch.Tensor:
    """``x / scale`` or ``x * scale`` with the scale broadcast over its blocks (float32 x).

    Works on a ``[*lead, nR, br, nC, bc]`` view of x (padded when the shape is not a multiple of
    the block), so no full-size scale tensor is ever built.
    """
    if block is None:
        return x / scale if divide else x * scale
    br, bc = block
    rows, cols = x.shape[-2:]
    n_r, n_c = scale.shape[-2:]
    padded = n_r * br != rows or n_c * bc != cols
    xp = F.pad(x, (0, n_c * bc - cols, 0, n_r * br - rows)) if padded else x
    blocks = xp.reshape(*x.shape[:-2], n_r, br, n_c, bc)
    s = scale.reshape(*scale.shape[:-2], n_r, 1, n_c, 1)
    out = (blocks / s if divide else blocks * s).reshape(*x.shape[:-2], n_r * br, n_c * bc)
    return out[..., :rows, :cols] if padded else out


# --- The CPU path: whole blocks through views, the partial tail block apart -------------------
#
# Bit for bit the padded formula above (held to an independent padded reference in
# tests/workers/fp8/test_quant_cpu_fast.py): a max is exact in any order, and every element meets
# the same one IEEE division or product by its block's scale; only the copies go. On SmolLM2's
# hidden size 576 (4.5 blocks of 128) the padded formula copied every activation and gradient
# twice to quantize (amax, scaling) and once more to dequantize, and read x through its transpose
# for wgrad's copy.


def _spans(n: int, b: int) -> list[tuple[int, int, int, int]]:
    """``(start, stop, n_blocks, length)`` of the whole blocks of ``b`` in ``n``, then the partial one."""
    whole = n // b
    spans = [(0, whole * b, whole, b)] if whole else []
    if n > whole * b:
        spans.append((whole * b, n, 1, n - whole * b))
    return spans


def _block_pieces(x: torch.Tensor, block: tuple[int, int]) -> list[tuple[torch.Tensor, tuple[slice, slice]]]:
    """``x [*lead, R, C]`` as at most four views ``[*lead, nr, lr, nc, lc]`` (whole blocks; the
    last row of blocks; the last column; the corner), each with the slices of its scales."""
    br, bc = block
    lead = x.shape[:-2]
    pieces = []
    for r0, r1, nr, lr in _spans(x.shape[-2], br):
        for c0, c1, nc, lc in _spans(x.shape[-1], bc):
            view = x[..., r0:r1, c0:c1].reshape(*lead, nr, lr, nc, lc)  # a view: dims only split
            pieces.append((view, (slice(r0 // br, r0 // br + nr), slice(c0 // bc, c0 // bc + nc))))
    return pieces


def block_grid(x: torch.Tensor, block: tuple[int, int]) -> tuple[int, int]:
    """Blocks along ``x``'s last two dims: ``(ceil(R / br), ceil(C / bc))``."""
    return -(-x.shape[-2] // block[0]), -(-x.shape[-1] // block[1])


def _scale_piece(scale: torch.Tensor, at: tuple[slice, slice]) -> torch.Tensor:
    """The scales of one piece of :func:`_block_pieces`, as ``[*lead, nr, 1, nc, 1]`` (a view)."""
    s = scale[..., at[0], at[1]]
    return s.unsqueeze(-1).unsqueeze(-3)


def all_finite(amax: torch.Tensor) -> bool:
    """Whether the CPU path may go on. A NaN or inf (an error the finite guard reports) takes the
    padded formula instead: torch's vectorized max turns a NaN into the all-ones NaN and its
    scalar one keeps the input's, so a NaN's sign and payload, and the bytes divided by it, hang
    on how the reduction was split. Bit for bit with the padded formula, even then. (A host read
    of a small CPU tensor; its max is NaN or inf where any element is: NaN propagates.)"""
    return amax.numel() == 0 or math.isfinite(float(amax.max()))


def abs_cpu(x: torch.Tensor) -> torch.Tensor:
    """|x| in x's dtype (exact), float64 and others in float32 first, as the padded formula."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)
    return x.abs()


def block_max_cpu(a: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Max of every ``block`` of ``a = |x|`` (:func:`abs_cpu`) without a padded copy:
    ``[*lead, ceil(R/br), ceil(C/bc)]`` float32."""
    out = torch.empty(*a.shape[:-2], *block_grid(a, block), dtype=torch.float32, device=a.device)
    for view, at in _block_pieces(a, block):
        out[..., at[0], at[1]] = view.amax(dim=(-3, -1))  # [*lead, nr, nc]
    return out


def scaled_cast_cpu(
    x: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    f: Fp8Format,
    saturate: bool = True,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """``clamp(x / scale) -> f.dtype`` per block, row-major: the bytes of
    :func:`workers.fp8.quant.cast_to_fp8`.

    ``saturate=False`` leaves out the clamp, for scales made from x's own block maxima
    (:func:`workers.fp8.quant.quantize`), where it changes no byte: with
    ``s = max(RN(amax / max), tiny)`` (or that rounded up to 2^k), |x| / s <= max * (1 + 2^-23)
    rounded, far below the first value torch's cast does not round down to ``max`` (464 = 448 +
    half a step for E4M3, a tie to even that stays at 448; 61440 for E5M2: checked over every
    float32 of [max / 2, that) in the tests);
    NaN and inf scales give the same NaN or 0 either way. One pass fewer over the activation.

    ``scratch``: a float32 buffer of x's shape, row-major, free to overwrite (e.g. |x| once its
    maxima are taken): fresh memory costs a page fault per 4 KiB on the first write.
    """
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)  # BF16/FP16 are widened inside the division, exactly
    out = scratch if scratch is not None else torch.empty(x.shape, dtype=torch.float32, device=x.device)
    out_pieces = _block_pieces(out, block)
    for (xv, at), (ov, _) in zip(_block_pieces(x, block), out_pieces, strict=True):
        torch.div(xv, _scale_piece(scale, at), out=ov)
    if saturate:
        out.clamp_(-f.max, f.max)
    return out.to(f.dtype)


def dequantize_blocks_cpu(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``data * scale`` per block in float32, in the memory layout the padded formula gives (the
    emulated GEMM's operand: a float32 GEMM need not sum alike over another layout): with a
    partial block, a view into a row-major buffer padded to whole blocks (its bytes are padded
    here, 1 byte an element, and decoded there); else ``data``'s own layout. Scaled in place."""
    rows, cols = data.shape[-2:]
    n_r, n_c = scale.shape[-2:]
    if n_r * block[0] != rows or n_c * block[1] != cols:
        padded = torch.zeros(*data.shape[:-2], n_r * block[0], n_c * block[1], dtype=data.dtype)
        if data.element_size() == 1:  # bytes copied as bytes (not every float8 copy has a kernel)
            padded.view(torch.uint8)[..., :rows, :cols] = data.view(torch.uint8)
        else:
            padded[..., :rows, :cols] = data
        out = to_float32(padded)[..., :rows, :cols]
    else:
        out = to_float32(data)
        if out.data_ptr() == data.data_ptr():  # data was float32 already: do not scale it in place
            out = out.clone()
    for ov, at in _block_pieces(out, block):
        ov.mul_(_scale_piece(scale, at))
    return out
