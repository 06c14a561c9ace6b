"""Blockwise-scaled FP8 GEMM: ``fp8_matmul(a, b) = dequant(a) @ dequant(b)``, float32 accumulation.

With ``a = [M, K]`` in 1x128 tiles (scale ``sa[m, kb]``) and ``b = [K, N]`` in 128x128 blocks
(scale ``sb[kb, nb]``), the scales are constant inside each K-chunk of 128, so

    out[m, n] = sum_kb  sa[m, kb] * sb[kb, n // 128] * sum_{k in chunk kb} qa[m, k] * qb[k, n]

i.e. a sum over K-chunks of *rowwise*-scaled products (one scale per row of ``a``, one per column
of ``b``). Every combination of tensorwise, 1x128, 128x1 and 128x128 operands decomposes the same
way as long as the two operands' K-blocks nest (one divides the other).

Backends (``backend=``):

``emulate``   Dequantize both operands to float32 and run one float32 GEMM. Same mathematical value;
              only float32 rounding differs. The CPU default: torch's CPU ``_scaled_mm`` is a
              reference kernel (~0.07 GFLOP/s measured on 2 cores, about 600x slower than this).
``scaled_mm`` ``torch._scaled_mm`` per K-chunk with rowwise scales (one call when both operands are
              tensorwise). Works on CPU and on CUDA (SM89+).
``auto``      CUDA: ``torch.nn.functional.scaled_mm`` with native 1x128 x 128x128 scaling on SM90 with
              CUDA >= 12.9 (cuBLAS DeepSeek-style scaling), otherwise chunked ``scaled_mm``, otherwise
              (dims not multiples of 16) ``emulate``. CPU: ``emulate``.

``_scaled_mm`` wants its first operand row-major and its second column-major: ``b = W.t()`` of a
contiguous weight ``W [N, K]`` already is.
"""

from __future__ import annotations

import math
import os
from typing import Literal

import torch

from workers.fp8.quant import Fp8Tensor

Backend = Literal["auto", "emulate", "scaled_mm"]
BACKENDS: tuple[str, ...] = ("auto", "emulate", "scaled_mm")


def _k_block(x: Fp8Tensor, dim: int) -> int | None:
    """Block length of ``x`` along its contraction dim (None: the scale is constant along it)."""
    if x.block is None or x.block[dim] >= x.shape[dim]:
        return None
    return x.block[dim]


def chunk_size(a: Fp8Tensor, b: Fp8Tensor) -> int:
    """Length of the K-chunks inside which both operands' scales are constant."""
    k = a.shape[1]
    ka, kb = _k_block(a, 1), _k_block(b, 0)
    if ka is None and kb is None:
        return max(k, 1)
    if ka is None or kb is None:
        return ka or kb or k
    if max(ka, kb) % min(ka, kb) != 0:
        raise ValueError(
            f"fp8_matmul: the operands' blocks along K ({ka} and {kb}) do not nest; quantize both "
            "with blocks of 128 along the contraction dimension (a: (1, 128), b: (128, 128))"
        )
    return min(ka, kb)


def row_scales(a: Fp8Tensor) -> torch.Tensor:
    """Scale of every row of ``a [M, K]`` per K-block: ``[M, n_kblocks]`` (float32)."""
    m = a.shape[0]
    if a.block is None:
        return a.scale.reshape(1, 1).expand(m, 1)
    return a.scale.repeat_interleave(a.block[0], dim=0)[:m]


def col_scales(b: Fp8Tensor) -> torch.Tensor:
    """Scale of every column of ``b [K, N]`` per K-block: ``[n_kblocks, N]`` (float32)."""
    n = b.shape[1]
    if b.block is None:
        return b.scale.reshape(1, 1).expand(1, n)
    return b.scale.repeat_interleave(b.block[1], dim=1)[:, :n]


def _validate(a: Fp8Tensor, b: Fp8Tensor) -> None:
    if a.data.dim() != 2 or b.data.dim() != 2:
        raise ValueError(
            f"fp8_matmul needs 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}; "
            "flatten leading dimensions first"
        )
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_matmul: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not agree on K")
    if a.device != b.device:
        raise ValueError(f"fp8_matmul: operands on {a.device} and {b.device}; move them together")


def matmul_emulated(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    """``dequant(a) @ dequant(b)`` in float32: the reference every backend must match."""
    _validate(a, b)
    chunk_size(a, b)  # same K-block rules as the real kernels, so no backend accepts more
    return a.dequantize(torch.float32) @ b.dequantize(torch.float32)


def _column_major(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(0) == 1 else x.t().contiguous().t()


def matmul_scaled_mm(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    """Sum over K-chunks of rowwise-scaled ``torch._scaled_mm`` products (float32 out)."""
    _validate(a, b)
    k = a.shape[1]
    step = chunk_size(a, b)
    b_data = _column_major(b.data)
    if a.block is None and b.block is None:  # tensorwise x tensorwise: one call
        return torch._scaled_mm(a.data, b_data, a.scale, b.scale, out_dtype=torch.float32)
    sa, sb = row_scales(a), col_scales(b)  # [M, nKa], [nKb, N]
    ka, kb = _k_block(a, 1), _k_block(b, 0)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    for k0 in range(0, k, step):
        k1 = min(k0 + step, k)
        ia = 0 if ka is None else k0 // ka
        ib = 0 if kb is None else k0 // kb
        out += torch._scaled_mm(
            a.data[:, k0:k1],
            _column_major(b_data[k0:k1, :]),
            sa[:, ia : ia + 1].contiguous(),
            sb[ib : ib + 1, :].contiguous(),
            out_dtype=torch.float32,
        )
    return out


def blockwise_scales_for_cublas(a: Fp8Tensor, b: Fp8Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale layouts cuBLAS wants for a 1x128 ``a [M, K]`` times a 128x128 ``b [K, N]``.

    1x128 scales ``[M, K/128]`` must be outer-dim-major (stride 1 along M). 128x128 scales are given
    as ``[K/128 padded to a multiple of 4, N/128]`` whose transpose is contiguous.
    """
    sa = a.scale.t().contiguous().t()  # [M, K/128], strides (1, M)
    w_scale = b.scale.t()  # [N/128, K/128]: the weight's own block grid
    n_kb = w_scale.shape[1]
    padded = math.ceil(n_kb / 4) * 4
    if padded != n_kb:
        w_scale = torch.nn.functional.pad(w_scale, (0, padded - n_kb))
    return sa, w_scale.contiguous().t()  # [L4, N/128]


def _cublas_blockwise_ok(a: Fp8Tensor, b: Fp8Tensor) -> bool:
    if os.environ.get("FP8RL_CUBLAS_BLOCKWISE", "1") == "0" or not a.data.is_cuda:
        return False
    if a.block != (1, 128) or b.block != (128, 128):
        return False
    m, k = a.shape
    n = b.shape[1]
    cuda_version = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return (
        torch.cuda.get_device_capability(a.device) == (9, 0)
        and cuda_version >= (12, 9)
        and hasattr(torch.nn.functional, "scaled_mm")
        and k % 128 == 0
        and n % 128 == 0
        and m % 16 == 0
    )


def _matmul_cublas_blockwise(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    scaling = torch.nn.functional.ScalingType
    sa, sb = blockwise_scales_for_cublas(a, b)
    return torch.nn.functional.scaled_mm(
        a.data,
        _column_major(b.data),
        sa,
        scaling.BlockWise1x128,
        sb,
        scaling.BlockWise128x128,
        output_dtype=torch.float32,
    )


def resolve_backend(a: Fp8Tensor, b: Fp8Tensor, backend: str = "auto") -> str:
    """The backend ``fp8_matmul`` will use for these operands (for audits and benchmarks)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend != "auto":
        return backend
    if not a.data.is_cuda:
        return "emulate"
    if _cublas_blockwise_ok(a, b):
        return "cublas_blockwise"
    dims_ok = a.shape[0] % 16 == 0 and b.shape[1] % 16 == 0 and chunk_size(a, b) % 16 == 0
    return "scaled_mm" if dims_ok else "emulate"


def fp8_matmul(
    a: Fp8Tensor,
    b: Fp8Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``a @ b`` for FP8 ``a [M, K]`` and ``b [K, N]``, accumulated in float32.

    Scales may be tensorwise or blockwise on either side, as long as the blocks along K nest
    (see :func:`chunk_size`). Returns ``[M, N]`` in ``out_dtype``.
    """
    _validate(a, b)
    chosen = resolve_backend(a, b, backend)
    if chosen == "emulate":
        out = matmul_emulated(a, b)
    elif chosen == "cublas_blockwise":
        out = _matmul_cublas_blockwise(a, b)
    else:
        out = matmul_scaled_mm(a, b)
    return out.to(out_dtype)
