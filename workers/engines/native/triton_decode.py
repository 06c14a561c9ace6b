"""The Triton kernels of :mod:`workers.engines.native.decode_attention` (imported only when they
run: Triton is absent on some CPU machines)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from workers.fp8.triton_math import HW_BF16, bf16_bits

# -1e30 below stands for minus infinity: exp() and max() of a fully masked tile stay free of NaN

# On a GPU the kernels round to BF16 with the hardware's conversion (round to nearest even) and
# multiply BF16 tiles on the tensor cores with float32 accumulation. Triton's interpreter (the CPU
# tests) truncates on .to(bfloat16) and has no BF16 dot, so there the same values are made with
# bit operations (HW_BF16 False) and multiplied as float32 (exact for BF16 operands): the
# interpreter's branch is the one the CPU checks against float64, the hardware branch is checked
# against it on a GPU.


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    seen_ptr,
    len_ptr,
    ks_ptr,
    vs_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    scaling,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_sb,
    chunk,
    HQ: tl.constexpr,
    SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    HW: tl.constexpr,
    DIRECT: tl.constexpr,
) -> None:
    b = tl.program_id(0)
    h = tl.program_id(1)  # KV head
    s = tl.program_id(2)  # key range
    n = tl.load(len_ptr)  # positions written so far: keys [0, n)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = h * GROUP + g  # the query heads of this KV head's group
    in_group = g < GROUP
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=in_group[:, None], other=0.0
    )
    q = q.to(tl.bfloat16) if HW else q.to(tl.float32)  # BF16 values either way
    score_scale = scaling
    if FP8:
        k_scale = tl.load(ks_ptr)
        v_scale = tl.load(vs_ptr)
        # power-of-two scales come out of the loop: bf16(f32(x) * 2^e) = bf16(x) * 2^e, and the
        # float32 sums and products scale by 2^e exactly, so the scores and the weighted sum of V
        # are the same bits with the scales applied once, outside (module docstring)
        fold = _foldable(k_scale) & _foldable(v_scale)
        if fold:
            score_scale = scaling * k_scale
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    start = s * chunk
    end = tl.minimum(start + chunk, n)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        inside = j < end
        ok = tl.load(seen_ptr + b * stride_sb + j, mask=inside, other=0) != 0
        valid = inside & ok
        k = tl.load(
            k_ptr + b * stride_kb + h * stride_kh + j[:, None] * stride_kt + d[None, :],
            mask=inside[:, None],
            other=0.0,
        )
        v = tl.load(
            v_ptr + b * stride_vb + h * stride_vh + j[:, None] * stride_vt + d[None, :],
            mask=inside[:, None],
            other=0.0,
        )
        # BF16 operands (in the interpreter: float32 holding BF16 values, products exact either way)
        if FP8:  # in registers: the materialized dequantization's values, bf16(f32(x) * scale)
            if fold:  # E4M3 values are exact in BF16; the scales are applied outside the loop
                kt = k.to(tl.bfloat16) if HW else k.to(tl.float32)
                vt = v.to(tl.bfloat16) if HW else v.to(tl.float32)
            else:
                kt = _round_bf16(k.to(tl.float32) * k_scale, HW)
                vt = _round_bf16(v.to(tl.float32) * v_scale, HW)
        elif HW:
            kt = k.to(tl.bfloat16)  # a BF16 cache: as loaded
            vt = v.to(tl.bfloat16)
        else:
            kt = k.to(tl.float32)
            vt = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(kt)) * score_scale  # [BLOCK_G, BLOCK_N], float32 accumulation
        scores = tl.where(valid[None, :], scores, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(valid[None, :], tl.exp(scores - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(_round_bf16(p, HW), vt)  # P rounded to BF16, as flash attention
        m_i = m_new
    if FP8:  # noqa: SIM102 - a compile-time guard: without it Triton compiles the body (no v_scale)
        if fold:
            acc = acc * v_scale
    if DIRECT:  # one split: the combine's arithmetic here (its weight is exp(0) = 1), BF16 out
        out = acc / l_i[:, None]
        tl.store(out_ptr + (b * HQ + heads)[:, None] * D + d[None, :], _round_bf16(out, HW).to(tl.bfloat16),
                 mask=in_group[:, None])  # fmt: skip
    else:
        row = (b * HQ + heads) * SPLITS + s  # [BLOCK_G]
        tl.store(m_ptr + row, m_i, mask=in_group)
        tl.store(l_ptr + row, l_i, mask=in_group)
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=in_group[:, None])


@triton.jit
def _foldable(scale):
    """A power of two whose products stay normal floats: its mantissa bits are 0 and its exponent
    between 2^-60 and 2^60 (an E4M3 value times it, and the float32 sums it scales, then round
    as they do unscaled: scaling by 2^e commutes with rounding away from the subnormal range)."""
    bits = scale.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    return ((bits & 0x7FFFFF) == 0) & (exponent >= 127 - 60) & (exponent <= 127 + 60) & (bits > 0)


@triton.jit
def _round_bf16(x, HW: tl.constexpr):
    """float32 ``x`` rounded to BF16 (nearest, ties to even): a BF16 tensor on a GPU (the hardware
    conversion), the same values as float32 in the interpreter (``bf16_bits``)."""
    if HW:
        return x.to(tl.bfloat16)
    else:
        return bf16_bits(x)


@triton.jit
def _combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    D: tl.constexpr,
    HW: tl.constexpr,
) -> None:
    bh = tl.program_id(0)  # one (sequence, query head)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    live = s < SPLITS
    m = tl.load(m_ptr + bh * SPLITS + s, mask=live, other=-1.0e30)
    l_s = tl.load(l_ptr + bh * SPLITS + s, mask=live, other=0.0)
    acc = tl.load(acc_ptr + (bh * SPLITS + s)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    w = tl.where(live, tl.exp(m - tl.max(m, 0)), 0.0)  # a split that saw no key has l = 0
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l_s, 0)
    tl.store(out_ptr + bh * D + d, _round_bf16(out, HW).to(tl.bfloat16))  # the interpreter: exact


def run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: torch.Tensor,
    length: torch.Tensor,
    scaling: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    splits: int,
    block_n: int,
    fp8: bool,
    direct: bool | None = None,
) -> Any:
    """``direct`` (default: at one split) writes the output from the split kernel itself, without
    the partials and the combine kernel; False forces the combine (the tests compare the two)."""
    b, hq, d = q.shape
    _, hkv, t, _ = k.shape
    group = hq // hkv
    direct = splits == 1 if direct is None else direct
    if direct and splits != 1:
        raise ValueError(f"decode attention: a direct output needs one split, not {splits}")
    chunk = triton.cdiv(triton.cdiv(t, splits), block_n) * block_n  # keys per split, whole tiles
    out = torch.empty(b, hq, d, dtype=torch.bfloat16, device=q.device)
    parts = 0 if direct else b * hq * splits  # no partials at all for a direct output
    m = torch.empty(parts, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(parts, d, dtype=torch.float32, device=q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    scales = (k_scale, v_scale) if fp8 else (length, length)  # unused pointers when not FP8
    _split_kernel[(b, hkv, splits)](
        q, k, v, seen, length, scales[0], scales[1], m, l_sum, acc, out, float(scaling),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), seen.stride(0), chunk,
        HQ=hq, SPLITS=splits, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=d,
        BLOCK_N=block_n, FP8=fp8, HW=HW_BF16, DIRECT=direct,
    )  # fmt: skip
    if direct:
        return out
    block_s = triton.next_power_of_2(splits)
    _combine_kernel[(b * hq,)](m, l_sum, acc, out, SPLITS=splits, BLOCK_S=block_s, D=d, HW=HW_BF16)
    return out
