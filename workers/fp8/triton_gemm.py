"""A block-FP8 GEMM for few tokens, in Triton: ``x @ W.T`` for a BF16/float32 ``x [M, K]`` with
``M <= 64`` and an E4M3 weight ``W [N, K]`` in 128x128 blocks, the activation quantized inside.

Why: on an H100 cuBLAS's blockwise GEMM is 0.71-1.10x of BF16 for a down-projection (8192 ->
2048) at 1-256 tokens (``make gpu-check``, kernels), the decode regime, where a GEMM only streams
its weight: FP8 halves those bytes, so up to ~2x is there to take. With few tokens and few
128-wide column blocks (16 for N = 2048) there are too few tiles to fill the GPU, so the
contraction is split (split-K): each program owns one 128-column block and a range of K-blocks,
and the float32 partial sums of the ranges are added afterwards.

What a program computes, for its column block ``nb`` and each 128-long K-block ``kb`` of its range,
is exactly what :func:`workers.fp8.quant.quantize_rows` followed by the blockwise GEMM compute:

    sa[m]  = max(amax(x[m, kb]) / 448, 2^-126)                   (IEEE division)
    qa[m]  = e4m3(clamp(x[m, kb] / sa[m], -448, 448))            (IEEE division, nearest)
    acc   += (qa @ W_q[nb, kb].T) * sa[m] * sw[nb, kb]            (float32)

so the bytes multiplied are the quantizer's, bit for bit, and only the float32 summation order
differs from cuBLAS's. Each program quantizes its rows' K-blocks itself (the activation is a few
KB: reading it once per column block costs little and saves a launch and a round trip through
memory); a non-finite activation tile is reported to the finite guard as the quantizer reports it,
by the programs of column block 0.

Which GEMM runs: :mod:`workers.fp8.linear_gemm` binds this kernel for the forward GEMM on CUDA when
``FP8RL_SMALL_M_GEMM=triton`` (read when the weight is bound) and the call has at most
``MAX_M`` tokens; off by default until ``make gpu-check``'s kernel microbenchmark
(``small_m`` rows) has measured it. Imported only where it runs (Triton on CUDA, or its
interpreter in the CPU tests).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from workers.fp8.dispatch import multiprocessors
from workers.fp8.triton_math import to_fp8
from workers.fp8.triton_quant import fold_bad_tiles, scale_of, tile_amax

MAX_M = 64  # tokens per call this kernel takes; more go to cuBLAS
_BLOCK = 128


@triton.jit
def _small_m_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    part_ptr,
    code_ptr,
    m_rows,
    n_cols,
    k_len,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    blocks_per_split,
    n_kblocks,
    call_code,
    FMT_MAX: tl.constexpr,
    CHECK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    pid_n = tl.program_id(0)  # 128-column block of the output (the weight's row block)
    pid_s = tl.program_id(1)  # range of K-blocks
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK + tl.arange(0, BLOCK)
    kk = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK_M, BLOCK], tl.float32)
    kb0 = pid_s * blocks_per_split
    kb1 = tl.minimum(kb0 + blocks_per_split, n_kblocks)
    # only column block 0 reports non-finite activation tiles (every column block sees them)
    rows_checked = tl.where(pid_n == 0, m_rows, 0)
    for kb in range(kb0, kb1):
        k = kb * BLOCK + kk
        x_in = (m[:, None] < m_rows) & (k[None, :] < k_len)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :] * stride_xk, mask=x_in, other=0.0)
        x = x.to(tl.float32)
        amax = tile_amax(x, 1)
        sa = scale_of(amax, FMT_MAX, False)
        qa = to_fp8(tl.math.div_rn(x, sa[:, None]), FMT_MAX, True)  # [BLOCK_M, BLOCK] E4M3
        w_in = (k[:, None] < k_len) & (n[None, :] < n_cols)
        w = tl.load(w_ptr + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=w_in, other=0.0)
        sw = tl.load(ws_ptr + pid_n * stride_sn + kb * stride_sk)  # the 128x128 block's scale
        acc += tl.dot(qa, w) * (sa[:, None] * sw)  # [BLOCK_M, BLOCK], float32
        if CHECK:
            fold_bad_tiles(code_ptr, amax, m, rows_checked, n_kblocks, kb, call_code)
    out = (m[:, None] < m_rows) & (n[None, :] < n_cols)
    tl.store(part_ptr + pid_s * m_rows * n_cols + m[:, None] * n_cols + n[None, :], acc, mask=out)


def splits_for(n_cols: int, n_kblocks: int, device: torch.device) -> int:
    """K-ranges per column block: about two programs per multiprocessor in all, each range at
    least two K-blocks. Depends on shapes only (a captured graph keeps it)."""
    sms = multiprocessors(device, elsewhere=8)  # 8: the interpreter's (CPU tests)
    col_blocks = -(-n_cols // _BLOCK)
    wanted = -(-2 * sms // col_blocks)
    return max(1, min(wanted, n_kblocks // 2))


def small_m_gemm(
    x: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    check: tuple[torch.Tensor, int] | None,
    splits: int | None = None,
) -> torch.Tensor:
    """``q(x) @ dequant(W).T`` in ``out_dtype`` for ``x [M, K]`` (``M <= MAX_M``), ``w_data [N, K]``
    E4M3 in 128x128 blocks with scales ``w_scale [N/128, K/128]``. ``check``: the finite guard's
    (code buffer, call number) for the activation, or None."""
    m_rows, k_len = x.shape
    n_cols = w_data.shape[0]
    if m_rows > MAX_M or n_cols % _BLOCK or w_data.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"small_m_gemm: x {tuple(x.shape)} @ W {tuple(w_data.shape)} {w_data.dtype}: needs at most "
            f"{MAX_M} tokens, N a multiple of {_BLOCK} and an E4M3 weight"
        )
    n_kblocks = -(-k_len // _BLOCK)
    splits = splits or splits_for(n_cols, n_kblocks, x.device)
    per_split = -(-n_kblocks // splits)
    splits = -(-n_kblocks // per_split)  # no empty range
    part = torch.empty(splits, m_rows, n_cols, dtype=torch.float32, device=x.device)
    code_buf, call = check if check is not None else (part, 0)  # unused without CHECK
    grid: Any = (n_cols // _BLOCK, splits)
    _small_m_kernel[grid](
        x, w_data, w_scale, part, code_buf, m_rows, n_cols, k_len, x.stride(0), x.stride(1),
        w_data.stride(0), w_data.stride(1), w_scale.stride(0), w_scale.stride(1), per_split, n_kblocks,
        call * 2**32,
        FMT_MAX=448.0, CHECK=check is not None, BLOCK_M=max(16, triton.next_power_of_2(m_rows)), BLOCK=_BLOCK,
    )  # fmt: skip
    return (part[0] if splits == 1 else part.sum(dim=0)).to(out_dtype)
