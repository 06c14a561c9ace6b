"""The weight gradient of an FP8 linear in Triton: ``dW [N, K] = dy.T @ x``, both operands E4M3
tiled 1x128 along the M tokens (the contraction), promoted to float32 once per 128-token chunk.

Why: on the H200 (docs/gpu-check-h200-2026-11-29.md) cuBLAS's blockwise GEMM in this layout, 1x128
by 1x128, ran at 1.13-1.36x of BF16 at the 8B shapes and 0.99-1.13x at the 1B's, where its
fprop and dgrad (1x128 by 128x128) reach 1.4-1.8x. The GPU plan's change 4 asks for a kernel of
our own, adopted if it reaches 1.3x.

What a program computes, for its ``[BLOCK_N, BLOCK_K]`` tile of ``dW`` and each chunk ``c`` of 128
tokens, with ``g = dy.T [N, M]`` and ``x = x.T [K, M]`` as training keeps them
(:func:`workers.fp8.quant.quantize_dual`'s second layout):

    acc += (g[n, c] @ x[k, c].T) * (sg[n, c] * sx[k, c])            (float32)

which is the blockwise recipe: inside a chunk both scales are constant, so the chunk's product of
FP8 values is one tensor-core dot, and its float32 result is scaled and added to the accumulator
(DeepSeek-V3's promotion interval of 128; it also keeps the sum out of Hopper's FP8 accumulator,
which holds about 14 bits, beyond one chunk). Every product of two E4M3 values is exact in float32,
so the float32 result differs from the float64 product of the same bytes only by the float32
sums: within ``g_n sum |dy_i x_i|`` with ``g_n = n u / (1 - n u)``, ``u = 2^-24`` and ``n = M + 2 +
chunks`` (the chunk's sum, the scale product, its multiply, the sum over chunks); on a GPU the
sum inside a chunk is the tensor core's.

Which GEMM runs: :func:`workers.fp8.linear_gemm.train_backward` takes this kernel for the weight
gradient on CUDA when ``FP8RL_WGRAD_GEMM=triton`` (read at each backward) and both operands are
E4M3 with 1x128 tiles along the tokens; off by default until a GPU has measured it (``fp8rl bench
kernels --kinds wgrad,wgrad_triton``). Imported only where it runs (Triton on CUDA, or its
interpreter in the CPU tests).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

CHUNK = 128  # tokens per promotion: the 1x128 tiles' length along M


@triton.jit
def _wgrad_kernel(
    g_ptr,
    gs_ptr,
    x_ptr,
    xs_ptr,
    out_ptr,
    n_rows,
    k_cols,
    m_len,
    n_chunks,
    stride_gn,
    stride_gm,
    stride_gsn,
    stride_gsc,
    stride_xk,
    stride_xm,
    stride_xsk,
    stride_xsc,
    stride_on,
    stride_ok,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr,
) -> None:
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tokens = tl.arange(0, CHUNK)
    n_in = n < n_rows
    k_in = k < k_cols
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for c in range(n_chunks):
        m = c * CHUNK + tokens
        m_in = m < m_len
        # dy.T's rows and x.T's rows, both contiguous along the tokens (K-major for the tensor core)
        g = tl.load(
            g_ptr + n[:, None] * stride_gn + m[None, :] * stride_gm,
            mask=n_in[:, None] & m_in[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + k[None, :] * stride_xk + m[:, None] * stride_xm,
            mask=m_in[:, None] & k_in[None, :],
            other=0.0,
        )
        sg = tl.load(gs_ptr + n * stride_gsn + c * stride_gsc, mask=n_in, other=0.0)
        sx = tl.load(xs_ptr + k * stride_xsk + c * stride_xsc, mask=k_in, other=0.0)
        acc += tl.dot(g, x) * (sg[:, None] * sx[None, :])  # [BLOCK_N, BLOCK_K], float32
    out = out_ptr + n[:, None] * stride_on + k[None, :] * stride_ok
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_in[:, None] & k_in[None, :])


def wgrad_gemm(
    g_data: torch.Tensor,
    g_scale: torch.Tensor,
    x_data: torch.Tensor,
    x_scale: torch.Tensor,
    out_dtype: torch.dtype,
    tile: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """``dequant(g) @ dequant(x).T`` in ``out_dtype``: ``g_data [N, M]`` and ``x_data [K, M']``
    E4M3 tiled 1x128 along their second dim (scales ``[N, ceil(M/128)]``, ``[K, ceil(M'/128)]``),
    over the first ``min(M, M')`` tokens (a padded layout's extra tokens are zeros); ``tile``:
    the output tile ``(BLOCK_N, BLOCK_K)``."""
    n_rows, m_g = g_data.shape
    k_cols, m_x = x_data.shape
    m_len = min(m_g, m_x)
    n_chunks = -(-m_len // CHUNK)
    e4m3 = torch.float8_e4m3fn
    if g_data.dtype != e4m3 or x_data.dtype != e4m3:
        raise ValueError(f"wgrad_gemm: E4M3 operands only, got {g_data.dtype} and {x_data.dtype}")
    if (
        g_scale.shape[0] != n_rows
        or x_scale.shape[0] != k_cols
        or min(g_scale.shape[1], x_scale.shape[1]) < n_chunks
    ):
        raise ValueError(
            f"wgrad_gemm: scales {tuple(g_scale.shape)} and {tuple(x_scale.shape)} do not tile "
            f"{tuple(g_data.shape)} and {tuple(x_data.shape)} 1x128 along the tokens"
        )
    out = torch.empty(n_rows, k_cols, dtype=out_dtype, device=g_data.device)
    block_n, block_k = tile
    grid: Any = (-(-n_rows // block_n), -(-k_cols // block_k))
    _wgrad_kernel[grid](
        g_data, g_scale, x_data, x_scale, out, n_rows, k_cols, m_len, n_chunks,
        g_data.stride(0), g_data.stride(1), g_scale.stride(0), g_scale.stride(1),
        x_data.stride(0), x_data.stride(1), x_scale.stride(0), x_scale.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, CHUNK=CHUNK, num_warps=8, num_stages=3,
    )  # fmt: skip
    return out
