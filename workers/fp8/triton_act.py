"""An FP8 generator's MLP activation in one pass (Triton): ``silu(gate) * up`` quantized in 1x128
tiles for the down projection, from the fused gate/up GEMM's output.

Hugging Face's MLP computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. With gate/up fused
into one FP8 GEMM (:mod:`workers.fp8.fused`) that is, per layer and decode step, the SiLU kernel,
the product kernel and the down projection's input quantizer, each reading and writing the
``[M, I]`` intermediate in BF16. This kernel reads the ``[M, 2I]`` GEMM output once and writes the
FP8 bytes and scales the quantizer would, computing each value as torch does:

    s = bf16(g / (1 + exp(-g)))        torch's SiLU on BF16: float32, IEEE division, rounded once
    h = bf16(s * u)                    the BF16 product (exact in float32, rounded once)
    h in 1x128 tiles                   as :func:`workers.fp8.triton_quant.quantize_1x128`

``exp`` is libdevice's ``expf`` on a GPU (what CUDA's ``expf`` is, in torch's SiLU kernel), not
Triton's faster ``tl.exp`` (:data:`FP_FUSION` says how the sum is contracted). Non-finite tiles
are folded into the active finite guard as the quantizer folds them.
``FP8RL_SILU_MUL=triton`` switches it on (off by default until a GPU has measured it): see
:func:`workers.fp8.fused.fuse_silu_mul`. Imported only where it runs: CUDA, or the CPU under
Triton's interpreter (tests).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from workers.fp8.formats import Fp8Format
from workers.fp8.fp8_tensor import Fp8Tensor, TILE_1x128
from workers.fp8.triton_math import HW_BF16, bf16_value, expf
from workers.fp8.triton_quant import rows_layout, write_rows

_TILE = 128
# Multiply-add contraction, as the launch's enable_fp_fusion. torch's SiLU is one CUDA kernel
# built by nvcc, whose default (--fmad=true) contracts exp's last product with the "1 +": Triton's
# default does the same (the SM90 compile test shows the fma). Which of the two builds is torch's
# bit for bit only a GPU shows: tests/workers/test_gpu_data_plane.py checks both and names the one
# that matches.
FP_FUSION = True


@triton.jit
def _silu_mul_1x128(
    gu_ptr, data_ptr, scale_ptr, code_ptr, rows, rows_out, inter, stride_r, stride_c, n_tiles_c,
    call_code, FMT_MAX: tl.constexpr, E4M3: tl.constexpr, POW2: tl.constexpr, CHECK: tl.constexpr,
    BLOCK_R: tl.constexpr, TILE: tl.constexpr, HW: tl.constexpr,
) -> None:  # fmt: skip
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    c = pid_c * TILE + tl.arange(0, TILE)  # [TILE] columns of h (gate's; up's are inter further)
    inside = (r[:, None] < rows) & (c[None, :] < inter)
    at = gu_ptr + r[:, None] * stride_r + c[None, :] * stride_c
    g = tl.load(at, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(at + inter * stride_c, mask=inside, other=0.0).to(tl.float32)
    s = bf16_value(tl.math.div_rn(g, 1.0 + expf(-g, HW)), HW)
    h = bf16_value(s * u, HW)
    write_rows(h, r, c, pid_c, rows, rows_out, inter, data_ptr, scale_ptr, code_ptr, n_tiles_c, call_code,
                FMT_MAX, E4M3, POW2, CHECK)  # fmt: skip


def silu_mul_1x128(
    gu: torch.Tensor,
    fmt: Fp8Format,
    power_of_two: bool,
    check: tuple[torch.Tensor, int] | None,
    rows_out: int,
    fp_fusion: bool = FP_FUSION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data [R', I], scale [R', ceil(I/128)])`` of ``h = silu(gu[:, :I]) * gu[:, I:]`` for a
    2-D BF16 ``gu [R, 2I]``, laid out as :func:`workers.fp8.triton_quant.quantize_1x128` lays
    out its result (rows past ``R`` zeros with scale 1, the scale M-major). ``check``: ``(guard
    code buffer, call number)`` to fold non-finite tiles into, or None; ``fp_fusion``: the
    launch's contraction (:data:`FP_FUSION`; the GPU test tries both)."""
    rows, cols = gu.shape
    if cols % 2 or gu.dtype != torch.bfloat16:
        raise ValueError(f"silu_mul: gate and up side by side in BF16, got {tuple(gu.shape)} {gu.dtype}")
    inter = cols // 2
    data, scale, n_tiles, block_r = rows_layout(rows_out, inter, fmt.dtype, gu.device)
    if rows_out == 0 or inter == 0:
        return data, scale
    code_buf, call = check if check is not None else (scale, 0)  # unused without CHECK
    grid: Any = (triton.cdiv(rows_out, block_r), n_tiles)
    _silu_mul_1x128[grid](
        gu, data, scale, code_buf, rows, rows_out, inter, gu.stride(0), gu.stride(1), n_tiles, call * 2**32,
        FMT_MAX=fmt.max, E4M3=fmt.name == "e4m3", POW2=power_of_two, CHECK=check is not None,
        BLOCK_R=block_r, TILE=_TILE, HW=HW_BF16,
        enable_fp_fusion=fp_fusion,
    )  # fmt: skip
    return data, scale


def silu_mul_rows(
    gu: torch.Tensor, fmt: Fp8Format, power_of_two: bool, where: str, rows_multiple: int = 16
) -> Fp8Tensor:
    """``silu(gate) * up`` of the fused gate/up output ``gu [M, 2I]`` as the down projection's
    FP8 input (:func:`workers.fp8.quant.quantize_rows` of it, rows padded to ``rows_multiple``),
    checked by the active finite guard under ``where``."""
    from workers.fp8.guard import active_guard

    rows = -(-gu.shape[0] // rows_multiple) * rows_multiple
    guard = active_guard()
    shape = (gu.shape[0], gu.shape[1] // 2)
    slot = guard.reserve(gu.device, shape, TILE_1x128, where) if guard is not None else None
    data, scale = silu_mul_1x128(gu, fmt, power_of_two, slot, rows)
    return Fp8Tensor(data, scale, TILE_1x128, fmt)
