"""The RMSNorm of :mod:`workers.engines.native.rms_norm` in one Triton pass (imported only where
it runs: CUDA, or the CPU under Triton's interpreter).

One program per row, the whole row in registers (with a residual, ``x = bf16(residual + x)``
first, also written out: the next residual):

    var  = sum(x * x) / D                 float32 (Triton's reduction order)
    rstd = 1 / sqrt_rn(var + eps)         IEEE square root and division: the same bits on a GPU
                                          and in the interpreter
    out  = bf16(w * bf16(x * rstd))       Hugging Face's two roundings to BF16

It writes ``rstd`` too, for the backward.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from workers.fp8.triton_quant import HW_BF16, bf16_value


@triton.jit
def _rms_norm(
    x_ptr, r_ptr, w_ptr, s_ptr, out_ptr, rstd_ptr, stride_x, stride_r, dim, eps,
    BLOCK_D: tl.constexpr, RESIDUAL: tl.constexpr, HW: tl.constexpr,
) -> None:  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    inside = d < dim
    x = tl.load(x_ptr + row * stride_x + d, mask=inside, other=0.0).to(tl.float32)
    if RESIDUAL:  # the residual add before the norm: BF16's sum, written out (the next residual)
        r = tl.load(r_ptr + row * stride_r + d, mask=inside, other=0.0).to(tl.float32)
        x = bf16_value(r + x, HW)
        tl.store(s_ptr + row * dim + d, x.to(tl.bfloat16), mask=inside)
    var = tl.sum(x * x, axis=0) / dim
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    y = bf16_value(x * rstd, HW)
    w = tl.load(w_ptr + d, mask=inside, other=0.0).to(tl.float32)
    out = bf16_value(w * y, HW)
    tl.store(out_ptr + row * dim + d, out.to(tl.bfloat16), mask=inside)
    tl.store(rstd_ptr + row, rstd)


def rms_norm(
    x2d: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s, out [R, D] BF16, rstd [R] float32)`` of a BF16 ``x2d [R, D]`` (rows of any stride, the
    last dimension contiguous) and a BF16 ``weight [D]``: with ``residual`` (the same shape) the
    norm of ``s = residual + x2d`` (BF16), else of ``s = x2d`` itself."""
    rows, dim = x2d.shape
    out = torch.empty(rows, dim, dtype=torch.bfloat16, device=x2d.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x2d.device)
    s = x2d if residual is None else torch.empty_like(out)
    if rows == 0:
        return s, out, rstd
    block = triton.next_power_of_2(dim)
    grid: Any = (rows,)
    r = x2d if residual is None else residual
    _rms_norm[grid](
        x2d, r, weight, s, out, rstd, x2d.stride(0), r.stride(0), dim, float(eps),
        BLOCK_D=block, RESIDUAL=residual is not None, HW=HW_BF16,
        num_warps=8 if block >= 4096 else 4, enable_fp_fusion=False,
    )  # fmt: skip
    return s, out, rstd
