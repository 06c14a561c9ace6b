"""The RMSNorm of :mod:`workers.engines.native.rms_norm` in one Triton pass (imported only where
it runs: CUDA, or the CPU under Triton's interpreter).

One program per row, the whole row in registers (with a residual, ``x = bf16(residual + x)``
first, also written out: the next residual):

    var  = sum(x * x) / D                 float32 (Triton's reduction order)
    rstd = 1 / sqrt_rn(var + eps)         IEEE square root and division: the same bits on a GPU
                                          and in the interpreter
    out  = bf16(w * bf16(x * rstd))       Hugging Face's two roundings to BF16

It writes ``rstd`` too, for the backward. For an FP8 generator it can also write the output in
1x128 tiles (:func:`rms_norm_fp8`): the bytes and scales the next projections' input quantizer
would make of it (the same :mod:`workers.fp8.triton_quant` arithmetic on the same BF16 values), so
they skip that pass.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from workers.fp8.formats import Fp8Format
from workers.fp8.fp8_tensor import Fp8Tensor, TILE_1x128
from workers.fp8.triton_math import HW_BF16, bf16_value, to_fp8
from workers.fp8.triton_quant import fold_bad_tiles, rows_layout, scale_of, tile_amax


@triton.jit
def _rms_norm(
    x_ptr, r_ptr, w_ptr, s_ptr, out_ptr, rstd_ptr, stride_x, stride_r, dim, eps, rows,
    q_ptr, qs_ptr, code_ptr, rows_out, n_tiles, call_code,
    BLOCK_D: tl.constexpr, RESIDUAL: tl.constexpr, HW: tl.constexpr, EMIT: tl.constexpr,
    FMT_MAX: tl.constexpr, E4M3: tl.constexpr, POW2: tl.constexpr, CHECK: tl.constexpr,
) -> None:  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    real = row < rows  # with EMIT the grid also covers the GEMM's padding rows
    inside = (d < dim) & real
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
    tl.store(rstd_ptr + row, rstd, mask=real)
    if EMIT:  # the output in 1x128 tiles, as the next GEMM's input quantizer writes them
        tiles = tl.reshape(out, (BLOCK_D // 128, 128))  # [tile, column in tile]: 0 past dim
        t = tl.arange(0, BLOCK_D // 128)
        amax = tile_amax(tiles, 1)
        scale = scale_of(amax, FMT_MAX, POW2)
        q8 = to_fp8(tl.math.div_rn(tiles, scale[:, None]), FMT_MAX, E4M3)
        col = t[:, None] * 128 + tl.arange(0, 128)[None, :]
        tl.store(q_ptr + row * dim + col, q8, mask=col < dim)
        scale = tl.where(real, scale, 1.0)  # padding rows: zeros with scale 1
        tl.store(qs_ptr + t * rows_out + row, scale, mask=t < n_tiles)
        if CHECK:
            fold_bad_tiles(code_ptr, amax, row, rows, n_tiles, t, call_code)


def rms_norm(
    x2d: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s, out [R, D] BF16, rstd [R] float32)`` of a BF16 ``x2d [R, D]`` (rows of any stride, the
    last dimension contiguous) and a BF16 ``weight [D]``: with ``residual`` (the same shape) the
    norm of ``s = residual + x2d`` (BF16), else of ``s = x2d`` itself."""
    s, out, rstd, _ = _launch(x2d, weight, eps, residual, None)
    return s, out, rstd


def rms_norm_fp8(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    fmt: Fp8Format,
    power_of_two: bool,
    rows_out: int,
    check: tuple[torch.Tensor, int] | None,
) -> tuple[torch.Tensor, torch.Tensor, Fp8Tensor]:
    """``(s, out, out in 1x128 tiles)``: :func:`rms_norm` that also writes what
    :func:`workers.fp8.triton_quant.quantize_1x128` writes for ``out`` (rows up to ``rows_out``
    zeros with scale 1, the scale M-major), in the same pass. ``check``: ``(guard code buffer,
    call number)`` to fold non-finite tiles into, or None."""
    s, out, _, q = _launch(x2d, weight, eps, residual, (fmt, power_of_two, rows_out, check))
    assert q is not None
    return s, out, q


def _launch(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    emit: tuple[Fp8Format, bool, int, tuple[torch.Tensor, int] | None] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Fp8Tensor | None]:
    rows, dim = x2d.shape
    out = torch.empty(rows, dim, dtype=torch.bfloat16, device=x2d.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x2d.device)
    s = x2d if residual is None else torch.empty_like(out)
    q: Fp8Tensor | None = None
    rows_out, n_tiles, call = rows, 1, 0
    data = scale = code = rstd  # stand-ins where nothing is emitted (EMIT=False reads none)
    fmt_max, e4m3, pow2 = 448.0, True, False
    if emit is not None:
        fmt, pow2, rows_out, check = emit
        data, scale, n_tiles, _ = rows_layout(rows_out, dim, fmt.dtype, x2d.device)
        q = Fp8Tensor(data, scale, TILE_1x128, fmt)
        fmt_max, e4m3 = fmt.max, fmt.name == "e4m3"
        if check is not None:
            code, call = check
    if rows_out == 0:
        return s, out, rstd, q
    block = max(triton.next_power_of_2(dim), 128)
    grid: Any = (rows_out,)
    r = x2d if residual is None else residual
    _rms_norm[grid](
        x2d, r, weight, s, out, rstd, x2d.stride(0), r.stride(0), dim, float(eps), rows,
        data, scale, code, rows_out, n_tiles, call * 2**32,
        BLOCK_D=block, RESIDUAL=residual is not None, HW=HW_BF16, EMIT=emit is not None,
        FMT_MAX=fmt_max, E4M3=e4m3, POW2=pow2, CHECK=emit is not None and emit[3] is not None,
        num_warps=8 if block >= 4096 else 4, enable_fp_fusion=False,
    )  # fmt: skip
    return s, out, rstd, q
