"""Blockwise-scaled FP8 GEMM: ``fp8_matmul(a, b) = dequant(a) @ dequant(b)``, float32 accumulation.

With ``a = [M, K]`` in 1x128 tiles (scale ``sa[m, kb]``) and ``b = [K, N]`` in 128x128 blocks
(scale ``sb[kb, nb]``), the scales are constant inside each K-chunk of 128, so

    out[m, n] = sum_kb  sa[m, kb] * sb[kb, n // 128] * sum_{k in chunk kb} qa[m, k] * qb[k, n]

i.e. a sum over K-chunks of *rowwise*-scaled products (one scale per row of ``a``, one per column
of ``b``). Every combination of tensorwise, 1x128, 128x1 and 128x128 operands decomposes the same
way as long as the two operands' K-blocks nest (one divides the other).

Which kernel computes it is decided by :func:`workers.fp8.dispatch.plan_gemm` from the device
profile, the operands' scales and formats (``backend="auto"``; ``"emulate"`` and ``"scaled_mm"``
force one). Before a CUDA kernel runs, :func:`lay_out` gives it what CUDA requires: ``a``
row-major and ``b`` column-major, M a multiple of 16 and the contraction a multiple of 16 (128
for blockwise), padding with zeros (which add nothing to the product) and copying only when the
operands are not already so. Callers that keep their operands in those layouts (``Fp8Linear``
does) never pay for a copy.
"""

from __future__ import annotations

import math

import torch

from workers.fp8.cpu_bf16 import bf16_matmul
from workers.fp8.dispatch import Backend, GemmPlan, plan_gemm, profile_of
from workers.fp8.fp8_tensor import Fp8Tensor

__all__ = [
    "Backend",
    "GemmPlan",
    "chunk_size",
    "cublas_b_scale",
    "fp8_matmul",
    "lay_out",
    "matmul_bf16",
    "matmul_emulated",
    "plan_for",
]


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
    if len(a.shape) != 2 or len(b.shape) != 2:
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


def matmul_bf16(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    """``dequant(a) @ dequant(b)`` as one BF16 GEMM (kernel ``emulate_bf16``), BF16 output; only for
    operands whose dequantized values are exact in BF16, which power-of-two scales make them.

    Why that is exact where it matters: an E4M3 (E5M2) value has 4 (3) significant bits and a
    power-of-two scale only moves its exponent, so ``q x 2^e`` is exact in BF16 (8 bits, float32's
    exponent range) as in float32. The two kernels then multiply the same numbers exactly and
    both accumulate in float32; they differ in the order of the float32 sums (as any two GEMM
    kernels do) and in the BF16 rounding of this one's output. For ``s = sum_k a_k b_k`` over
    ``K`` terms, with ``u = 2^-24`` and ``g = K u / (1 - K u)``, each kernel's float32 sum is
    within ``g sum_k |a_k b_k|`` of ``s``, so

        |matmul_bf16 - s| <= 2^-8 |s| + 2 g sum_k |a_k b_k|

    (``2^-8`` covers BF16's rounding to nearest, ``2^-9`` relative, of a sum already within ``g``;
    ``tests/workers/fp8/test_cpu_bf16_gemm.py`` holds it against a float64 product). A BF16
    linear's output is rounded to BF16 the same way. What does not hold: values below 2^-126,
    which a CPU's BF16 instructions may read as zero; a power-of-two scale reaches them only for a
    block whose largest magnitude is below ~2^-108.
    """
    _validate(a, b)
    chunk_size(a, b)
    return bf16_matmul(a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16))


def is_row_major(x: torch.Tensor) -> bool:
    """CUDA's test for the first operand (torch's meta kernel uses the same one)."""
    return x.stride(1) == 1 and x.stride(0) > x.stride(1)


def is_col_major(x: torch.Tensor) -> bool:
    """CUDA's test for the second operand."""
    return x.stride(0) == 1 and x.stride(1) > 1


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_scale(t: Fp8Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t``'s scales for the tensor grown to ``[rows, cols]``: new blocks get scale 1."""
    if t.block is None:
        return t.scale
    n_r, n_c = math.ceil(rows / t.block[0]), math.ceil(cols / t.block[1])
    if (n_r, n_c) == tuple(t.scale.shape):
        return t.scale
    out = torch.ones(n_r, n_c, dtype=t.scale.dtype, device=t.scale.device)
    out[: t.scale.shape[0], : t.scale.shape[1]] = t.scale
    return out


def _placed(t: Fp8Tensor, rows: int, cols: int, row_major: bool) -> Fp8Tensor:
    """``t`` as ``[rows, cols]`` (zero-padded) in the given layout; ``t`` itself when it already is."""
    laid_out = is_row_major(t.data) if row_major else is_col_major(t.data)
    if tuple(t.shape) == (rows, cols) and laid_out:
        return t
    data = torch.zeros((rows, cols) if row_major else (cols, rows), dtype=t.data.dtype, device=t.data.device)
    data = data if row_major else data.t()
    data[: t.shape[0], : t.shape[1]] = t.data
    return Fp8Tensor(data, _pad_scale(t, rows, cols), t.block, t.fmt)


def lay_out(a: Fp8Tensor, b: Fp8Tensor, k_multiple: int = 16) -> tuple[Fp8Tensor, Fp8Tensor]:
    """``a`` row-major ``[M', K']`` and ``b`` column-major ``[K', N]``: M' a multiple of 16, K' of
    ``k_multiple`` (see the module docstring). The product's first M rows are ``a @ b``."""
    m, k = a.shape
    mp, kp = _round_up(m, 16), _round_up(k, k_multiple)
    return _placed(a, mp, kp, row_major=True), _placed(b, kp, b.shape[1], row_major=False)


def _rowwise(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    """Sum over K-chunks of rowwise-scaled ``torch._scaled_mm`` products (float32)."""
    k = a.shape[1]
    step = chunk_size(a, b)
    sa, sb = row_scales(a), col_scales(b)  # [M, nKa], [nKb, N]
    ka, kb = _k_block(a, 1), _k_block(b, 0)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    for k0 in range(0, k, step):
        k1 = min(k0 + step, k)
        ia = 0 if ka is None else k0 // ka
        ib = 0 if kb is None else k0 // kb
        out += torch._scaled_mm(
            a.data[:, k0:k1],
            b.data[k0:k1, :],
            sa[:, ia : ia + 1].contiguous(),
            sb[ib : ib + 1, :].contiguous(),
            out_dtype=torch.float32,
        )
    return out


def matmul_scaled_mm(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    """``torch._scaled_mm`` (tensorwise: one call; else per K-chunk), laid out as CUDA wants."""
    _validate(a, b)
    kernel = "scaled_mm_tensorwise" if a.block is None and b.block is None else "scaled_mm_rowwise"
    return _run(kernel, *lay_out(a, b), torch.float32)[: a.shape[0]]


def blockwise_scales_for_cublas(a: Fp8Tensor, b: Fp8Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale layouts cuBLAS wants for ``a [M, K]`` in 1x128 tiles times ``b [K, N]`` in 128x128
    blocks or in 128x1 tiles (blocks along K). K must be a multiple of 128 (:func:`lay_out`).

    1x128 scales of ``a`` ``[M, K/128]`` are outer-dim-major (stride 1 along M). 128x128 scales of
    ``b`` are ``[K/128 padded to a multiple of 4, N/128]`` whose transpose is contiguous; 128x1
    scales of ``b`` are ``[N, K/128]`` with stride 1 along N.
    """
    sa = a.scale.t().contiguous().t()  # [M, K/128], strides (1, M): free when already so
    return sa, cublas_b_scale(b)


def cublas_b_scale(b: Fp8Tensor) -> torch.Tensor:
    """``b``'s scales as cuBLAS's blockwise GEMM reads them (:func:`blockwise_scales_for_cublas`).
    A weight's layout (``b`` the transpose of a weight) is made once per weight and kept with its
    FP8 copy, not per call; an in-place weight load rewrites it in place."""
    owner = b._transpose_of
    sb = owner._memo.get("cublas_scale_t") if owner is not None else None
    if sb is None:
        sb = cublas_b_scale_layout(b)
        if owner is not None:
            owner._memo["cublas_scale_t"] = sb
    return sb


def cublas_b_scale_layout(b: Fp8Tensor) -> torch.Tensor:
    """``b``'s scales laid out for cuBLAS's blockwise GEMM, computed afresh (no memo): what
    :func:`cublas_b_scale` keeps, and what an in-place weight load writes over the kept copy."""
    if b.block == (128, 128):
        w_scale = b.scale.t()  # [N/128, K/128]: the weight's own block grid
        n_kb = w_scale.shape[1]
        padded = math.ceil(n_kb / 4) * 4
        if padded != n_kb:
            w_scale = torch.nn.functional.pad(w_scale, (0, padded - n_kb))
        return w_scale.contiguous().t()  # [L4, N/128]
    return b.scale.contiguous().t()  # [N, K/128], strides (1, N)


def blockwise_scaled_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` by ``torch.nn.functional.scaled_mm``'s blockwise recipes (cuBLAS on SM90+, 1x128
    and 128x128 blocks), with no plan or fallback: the kernel itself, for the dispatch and benches."""
    scaling = torch.nn.functional.ScalingType
    recipe = {(1, 128): scaling.BlockWise1x128, (128, 1): scaling.BlockWise1x128}
    recipe[(128, 128)] = scaling.BlockWise128x128
    assert a.block is not None and b.block is not None
    sa, sb = blockwise_scales_for_cublas(a, b)
    return torch.nn.functional.scaled_mm(
        a.data, b.data, sa, recipe[a.block], sb, recipe[b.block], output_dtype=out_dtype
    )


def plan_for(
    a: Fp8Tensor,
    b: Fp8Tensor,
    backend: str = "auto",
    out_dtype: torch.dtype = torch.float32,
    bf16_exact: bool = False,
) -> GemmPlan:
    """The plan :func:`fp8_matmul` follows for these operands on their device."""
    return plan_gemm(a, b, profile_of(a.device), backend, out_dtype, bf16_exact)


def fp8_matmul(
    a: Fp8Tensor,
    b: Fp8Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
    bf16_exact: bool = False,
) -> torch.Tensor:
    """``a @ b`` for FP8 ``a [M, K]`` and ``b [K, N]``, accumulated in float32.

    Scales may be tensorwise or blockwise on either side, as long as the blocks along K nest
    (see :func:`chunk_size`). Returns ``[M, N]`` in ``out_dtype``. ``bf16_exact``: both
    operands have power-of-two scales, so on a CPU the GEMM may run in BF16 (:func:`matmul_bf16`).
    """
    _validate(a, b)
    chunk_size(a, b)  # the same K-block rules for every kernel
    plan = plan_for(a, b, backend, out_dtype, bf16_exact)
    m = a.shape[0]
    if plan.kernel == "emulate":
        return matmul_emulated(a, b).to(out_dtype)
    if plan.kernel == "emulate_bf16":
        return matmul_bf16(a, b).to(out_dtype)
    out = _run(plan.kernel, *lay_out(a, b, plan.k_multiple), plan.out_dtype)
    return out[:m].to(out_dtype)


def _run(kernel: str, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """One CUDA-side kernel on operands already laid out (:func:`lay_out`)."""
    if kernel == "cublas_blockwise":
        return blockwise_scaled_mm(a, b, out_dtype)
    if kernel == "scaled_mm_tensorwise":
        return torch._scaled_mm(a.data, b.data, a.scale, b.scale, out_dtype=out_dtype)
    return _rowwise(a, b)
