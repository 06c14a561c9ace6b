"""The decode step's FP8 KV-cache write in one launch (Triton): quantize the new token's K (or V)
of one layer with the layer's calibrated scale and store its bytes at the cache position.

The torch path (:meth:`workers.engines.native.static_decode.StaticKvCache.update`) makes about
five kernels of it per K or V per layer and step: a float32 copy, the division by the scale, the
clamp, the cast and the ``index_copy_`` into the cache. On an H200 (2026-11-28, 1B preset, 64
sequences x 2048 new tokens) the E4M3 cache cost 0.48 ms more per decode step than the BF16 one,
about what ~160 such small kernels cost inside a CUDA graph (docs/gpu-checks.md). This kernel
computes the same bytes in one pass:

    data[b, h, pos, :] = cast(clamp(x[b, h, 0, :] / scale, -fmt.max, fmt.max))   (IEEE division)

with the position read from a device tensor (no host sync; the graph holds its address).
``FP8RL_KV_WRITE=triton`` switches it on (off by default until a GPU has measured it). Imported
only where it runs: CUDA, or the CPU under Triton's interpreter (tests).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from workers.fp8.formats import get_format
from workers.fp8.triton_quant import to_fp8


@triton.jit
def _write_kv(
    x_ptr,
    scale_ptr,
    pos_ptr,
    buf_ptr,
    rows,
    heads,
    dim,
    length,
    stride_b,
    stride_h,
    stride_d,
    FMT_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] rows b * heads + h
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    inside = (r[:, None] < rows) & (d[None, :] < dim)
    b, h = r // heads, r % heads
    src = x_ptr + b[:, None] * stride_b + h[:, None] * stride_h + d[None, :] * stride_d
    x = tl.load(src, mask=inside, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr)
    pos = tl.load(pos_ptr).to(tl.int64)
    q8 = to_fp8(tl.math.div_rn(x, scale), FMT_MAX, E4M3)
    dst = buf_ptr + (r.to(tl.int64)[:, None] * length + pos) * dim + d[None, :]
    tl.store(dst, q8, mask=inside)


def write_kv(x: torch.Tensor, scale: torch.Tensor, pos: torch.Tensor, buf: torch.Tensor) -> None:
    """Store ``x [B, H, 1, D]`` (any strides) quantized with the 0-d float32 ``scale`` into the
    contiguous FP8 cache ``buf [B, H, T, D]`` (its dtype is the format) at position ``pos`` (a
    1-element integer tensor on the device; one position for every row, as the static decode loop
    writes)."""
    bsz, heads, new, dim = x.shape
    if new != 1 or tuple(buf.shape[:2]) != (bsz, heads) or buf.shape[3] != dim:
        raise ValueError(
            f"write_kv: x {tuple(x.shape)} does not fit one position of the cache {tuple(buf.shape)}"
        )
    if not buf.is_contiguous() or buf.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"write_kv: the cache must be a contiguous FP8 tensor, got {buf.dtype}")
    fmt = get_format(buf.dtype)
    rows = bsz * heads
    if rows == 0:
        return
    block_r = 16
    grid: Any = (triton.cdiv(rows, block_r),)
    _write_kv[grid](
        x,
        scale,
        pos,
        buf,
        rows,
        heads,
        dim,
        buf.shape[2],
        x.stride(0),
        x.stride(1),
        x.stride(3),
        FMT_MAX=fmt.max,
        E4M3=fmt.name == "e4m3",
        BLOCK_R=block_r,
        BLOCK_D=triton.next_power_of_2(dim),
    )
