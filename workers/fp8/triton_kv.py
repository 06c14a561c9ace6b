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
It is on by default on CUDA (an H200 measured it bit for bit against the torch path and faster,
2026-11-29, commit bec549e); ``FP8RL_KV_WRITE=torch`` turns it off. Imported only where it runs:
CUDA, or the CPU under Triton's interpreter (tests).

:func:`rope_write_kv` also takes RoPE into the launch, where the decode step's attention is the
Triton kernel too (:func:`workers.engines.native.decode_attention.fuse_rope`): from the q, k and v
projections as they come out of the GEMMs it writes the rotated query (BF16) and the rotated K and
the V into the cache. Hugging Face's ``apply_rotary_pos_emb`` is ~5 kernels for q and ~5 for k
(two products, the half rotation, the sum); here it is the same arithmetic, each BF16 operation
rounded where torch rounds it:

    x1, x2 = x[:D/2], x[D/2:]                          (q or k, BF16 values)
    out[:D/2] = bf16(bf16(x1 * cos1) - bf16(x2 * sin1))    (products of BF16 values: exact in float32)
    out[D/2:] = bf16(bf16(x2 * cos2) + bf16(x1 * sin2))

so the rotated values are torch's bit for bit, and K is then quantized as :func:`write_kv` does.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from workers.fp8.formats import get_format
from workers.fp8.triton_math import HW_BF16, bf16_value, to_fp8


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


@triton.jit
def _halves(ptr, b, h, stride_b, stride_h, rows, c, HALF: tl.constexpr):
    """Rows ``h`` (masked by ``rows``) of sequence ``b``: their two halves as float32 tiles."""
    inside = rows[:, None] & (c[None, :] < HALF)
    base = ptr + b * stride_b + h[:, None] * stride_h + c[None, :]
    first = tl.load(base, mask=inside, other=0.0).to(tl.float32)
    second = tl.load(base + HALF, mask=inside, other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _store_kv(
    buf_ptr, scale_ptr, b, h, heads, pos, length, rows, c, x1, x2,
    HALF: tl.constexpr, FP8: tl.constexpr, FMT_MAX: tl.constexpr, E4M3: tl.constexpr,
) -> None:  # fmt: skip
    """Rows ``h`` of K or V of sequence ``b`` into the cache at ``pos`` (FP8: quantized with the scale)."""
    inside = rows[:, None] & (c[None, :] < HALF)
    row = (b * heads + h).to(tl.int64)
    dst = buf_ptr + (row[:, None] * length + pos) * (2 * HALF) + c[None, :]
    if FP8:
        scale = tl.load(scale_ptr)
        tl.store(dst, to_fp8(tl.math.div_rn(x1, scale), FMT_MAX, E4M3), mask=inside)
        tl.store(dst + HALF, to_fp8(tl.math.div_rn(x2, scale), FMT_MAX, E4M3), mask=inside)
    else:
        tl.store(dst, x1.to(tl.bfloat16), mask=inside)  # BF16 values already: exact
        tl.store(dst + HALF, x2.to(tl.bfloat16), mask=inside)


@triton.jit
def _rope_write_kv(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, ks_ptr, vs_ptr, pos_ptr, q_out_ptr, k_buf_ptr, v_buf_ptr,
    length, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_cb, stride_sb,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, FP8: tl.constexpr, FMT_MAX: tl.constexpr, E4M3: tl.constexpr,
    HW: tl.constexpr,
) -> None:  # fmt: skip
    b = tl.program_id(0)  # one sequence
    r = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # rows of [q heads | k heads | v heads]
    c = tl.arange(0, BLOCK_HALF)
    is_q = r < HQ
    is_k = (r >= HQ) & (r < HQ + HKV)
    is_v = (r >= HQ + HKV) & (r < HQ + 2 * HKV)
    hk = r - HQ
    hv = r - HQ - HKV
    q1, q2 = _halves(q_ptr, b, r, stride_qb, stride_qh, is_q, c, HALF)
    k1, k2 = _halves(k_ptr, b, hk, stride_kb, stride_kh, is_k, c, HALF)
    v1, v2 = _halves(v_ptr, b, hv, stride_vb, stride_vh, is_v, c, HALF)
    x1 = tl.where(is_q[:, None], q1, k1)  # selected, not summed: -0.0 + 0.0 would lose the sign
    x2 = tl.where(is_q[:, None], q2, k2)
    half = c < HALF
    cos1 = tl.load(cos_ptr + b * stride_cb + c, mask=half, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + b * stride_cb + HALF + c, mask=half, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + b * stride_sb + c, mask=half, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + b * stride_sb + HALF + c, mask=half, other=0.0).to(tl.float32)[None, :]
    # (x * cos) + (rotate_half(x) * sin), rotate_half(x) = [-x2, x1]: each torch BF16 op rounded
    r1 = bf16_value(bf16_value(x1 * cos1, HW) - bf16_value(x2 * sin1, HW), HW)
    r2 = bf16_value(bf16_value(x2 * cos2, HW) + bf16_value(x1 * sin2, HW), HW)
    pos = tl.load(pos_ptr).to(tl.int64)
    q_rows = is_q[:, None] & half[None, :]
    q_dst = q_out_ptr + (b * HQ + r).to(tl.int64)[:, None] * (2 * HALF) + c[None, :]
    tl.store(q_dst, r1.to(tl.bfloat16), mask=q_rows)
    tl.store(q_dst + HALF, r2.to(tl.bfloat16), mask=q_rows)
    _store_kv(k_buf_ptr, ks_ptr, b, hk, HKV, pos, length, is_k, c, r1, r2, HALF, FP8, FMT_MAX, E4M3)
    _store_kv(v_buf_ptr, vs_ptr, b, hv, HKV, pos, length, is_v, c, v1, v2, HALF, FP8, FMT_MAX, E4M3)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    pos: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
) -> torch.Tensor:
    """One decode step's RoPE and K/V write in one launch (the module docstring).

    Args:
        q: ``[B, Hq, D]`` BF16 queries, k, v: ``[B, Hkv, D]`` BF16 (any batch and head strides,
            the last dimension contiguous: the projections' outputs viewed per head).
        cos, sin: ``[B, D]`` BF16, the rotary embedding of each sequence's position.
        k_scale, v_scale: 0-d float32 (read only for an FP8 cache).
        pos: a 1-element integer tensor on the device: the cache position written.
        k_buf, v_buf: the contiguous caches ``[B, Hkv, T, D]``, BF16 or FP8.

    Returns the rotated queries ``[B, Hq, D]`` BF16 (contiguous)."""
    bsz, hq, dim = q.shape
    hkv = k.shape[1]
    if (
        dim % 2
        or tuple(k.shape) != (bsz, hkv, dim)
        or v.shape != k.shape
        or tuple(cos.shape) != (bsz, dim)
        or cos.shape != sin.shape
        or tuple(k_buf.shape[:2]) != (bsz, hkv)
        or k_buf.shape[3] != dim
        or v_buf.shape != k_buf.shape
    ):
        raise ValueError(
            f"rope_write_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cos "
            f"{tuple(cos.shape)} do not fit one position of the cache {tuple(k_buf.shape)} (even D)"
        )
    dtypes = {t.dtype for t in (q, k, v, cos, sin)}
    if dtypes != {torch.bfloat16} or any(t.stride(-1) != 1 for t in (q, k, v, cos, sin)):
        raise ValueError("rope_write_kv: q, k, v, cos and sin must be BF16 with a contiguous last dimension")
    fp8 = k_buf.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if not (k_buf.is_contiguous() and v_buf.is_contiguous()) or (not fp8 and k_buf.dtype != torch.bfloat16):
        raise ValueError(f"rope_write_kv: the cache must be contiguous BF16 or FP8, got {k_buf.dtype}")
    fmt = get_format(k_buf.dtype if fp8 else torch.float8_e4m3fn)
    out = torch.empty(bsz, hq, dim, dtype=torch.bfloat16, device=q.device)
    if bsz == 0:
        return out
    block_h = 16
    grid: Any = (bsz, triton.cdiv(hq + 2 * hkv, block_h))
    _rope_write_kv[grid](
        q, k, v, cos, sin, k_scale, v_scale, pos, out, k_buf, v_buf, k_buf.shape[2],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        HQ=hq, HKV=hkv, HALF=dim // 2, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(dim // 2),
        FP8=fp8, FMT_MAX=fmt.max, E4M3=fmt.name == "e4m3", HW=HW_BF16,
        enable_fp_fusion=False,  # else a product and the sum fuse into one FMA: one rounding short
    )  # fmt: skip
    return out
