"""1x128 quantization in one GPU pass (Triton): the activation and gradient quantizer of ``Fp8Linear``.

:func:`workers.fp8.quant.quantize` in torch makes several passes over the tensor (a float32 copy,
``abs``, the block ``amax``, the division, the clamp, the cast) and, inside a finite guard, a few
more small kernels for the NaN/inf check. On a GPU that is memory traffic and launches per FP8
linear per decoded token. This kernel reads each 128-wide tile once and writes its FP8 bytes and
its scale, computing bit for bit what the torch code computes:

    amax  = max |x| over the tile (NaN if the tile holds one)      exact: max is order-free
    scale = max(amax / fmt.max, 2^-126)   (rounded up to 2^k if asked; IEEE division, div_rn)
    data  = cast(clamp(x / scale, -fmt.max, fmt.max))               (IEEE division, round to nearest)

and, inside a finite guard, folds ``call * 2^32 + tile`` of a non-finite tile into the guard's
device buffer with an atomic min (see :mod:`workers.fp8.guard`). ``tests/workers/test_gpu_data_plane.py``
checks the bytes and scales against the torch path on the GPU. Imported only on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from workers.fp8.triton_math import to_fp8

TILE_WIDTH = 128  # a 1x128 tile's width, the scale block of every quantizer here and in triton_dual.py


@triton.jit
def _quantize_1x128(
    x_ptr,
    data_ptr,
    scale_ptr,
    code_ptr,
    rows,
    rows_out,
    cols,
    stride_r,
    stride_c,
    n_tiles_c,
    call_code,
    FMT_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    POW2: tl.constexpr,
    CHECK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    TILE: tl.constexpr,
) -> None:
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    c = pid_c * TILE + tl.arange(0, TILE)  # [TILE]
    x = load_tile(x_ptr, r, c, rows, cols, stride_r, stride_c)
    write_rows(x, r, c, pid_c, rows, rows_out, cols, data_ptr, scale_ptr, code_ptr, n_tiles_c, call_code,
               FMT_MAX, E4M3, POW2, CHECK)  # fmt: skip


@triton.jit
def load_tile(x_ptr, r, c, rows, cols, stride_r, stride_c):
    """``x[r, c]`` as float32, zeros outside ``[rows, cols]``."""
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None] * stride_r + c[None, :] * stride_c, mask=inside, other=0.0)
    return x.to(tl.float32)


@triton.jit
def tile_amax(x, AXIS: tl.constexpr):
    """max |x| along ``AXIS``; NaN where a NaN is (max() may drop NaN; torch's amax keeps it)."""
    amax = tl.max(tl.abs(x), axis=AXIS)
    nans = tl.sum((x != x).to(tl.int32), axis=AXIS)
    return tl.where(nans > 0, float("nan"), amax)


@triton.jit
def write_rows(
    x, r, c, pid_c, rows, rows_out, cols, data_ptr, scale_ptr, code_ptr, n_tiles_c, call_code,
    FMT_MAX: tl.constexpr, E4M3: tl.constexpr, POW2: tl.constexpr, CHECK: tl.constexpr,
) -> None:  # fmt: skip
    """The tile ``x [r, c]`` in 1x128 tiles along ``c``: FP8 bytes into ``data [rows_out, cols]``
    (row-major), one scale per row into ``scale`` (M-major: ``[n_tiles_c, rows_out]``); rows in
    ``[rows, rows_out)`` are padding (x loaded as 0 gives data 0; their scale is 1)."""
    amax = tile_amax(x, 1)
    scale = scale_of(amax, FMT_MAX, POW2)
    q8 = to_fp8(tl.math.div_rn(x, scale[:, None]), FMT_MAX, E4M3)
    scale = tl.where(r < rows, scale, 1.0)
    written = (r[:, None] < rows_out) & (c[None, :] < cols)
    tl.store(data_ptr + r[:, None] * cols + c[None, :], q8, mask=written)
    tl.store(scale_ptr + pid_c * rows_out + r, scale, mask=r < rows_out)
    if CHECK:
        fold_bad_tiles(code_ptr, amax, r, rows, n_tiles_c, pid_c, call_code)


@triton.jit
def fold_bad_tiles(code_ptr, amax, r, rows, n_tiles_c, pid_c, call_code) -> None:
    """Fold the first non-finite tile among rows ``r`` (column tile ``pid_c``) into the guard's
    code with an atomic min, issued only by a program that has one: finite tiles cost no atomic."""
    bad = (amax != amax) | (amax == float("inf"))
    tile = r.to(tl.int64) * n_tiles_c + pid_c
    code = tl.where(bad & (r < rows), call_code + tile, 9223372036854775807)
    first = tl.min(code, axis=0)
    tl.atomic_min(code_ptr, first, mask=first != 9223372036854775807)


@triton.jit
def scale_of(amax, FMT_MAX: tl.constexpr, POW2: tl.constexpr):
    """amax -> scale, as :func:`workers.fp8.quant.amax_to_scale` (NaN stays NaN)."""
    scale = tl.math.div_rn(amax, FMT_MAX)
    scale = tl.where(scale < 1.1754943508222875e-38, 1.1754943508222875e-38, scale)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        up = (bits & 0x7F800000) + 0x00800000  # next power of two
        bits = tl.where((bits & 0x007FFFFF) == 0, bits, up)
        scale = bits.to(tl.float32, bitcast=True)
    return scale


def rows_layout(
    rows_out: int, cols: int, fp8_dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The buffers a one-layout 1x128 pass writes (``data [R', C]`` row-major, ``scale [R', C/128]``
    M-major), the number of column tiles and the rows a program takes."""
    n_tiles = triton.cdiv(cols, TILE_WIDTH)
    data = torch.empty((rows_out, cols), dtype=fp8_dtype, device=device)
    scale = torch.empty((n_tiles, rows_out), dtype=torch.float32, device=device).t()
    return data, scale, n_tiles, 16 if rows_out <= 16 else 32


def quantize_1x128(
    x: torch.Tensor,
    fmt_name: str,
    fmt_max: float,
    fp8_dtype: torch.dtype,
    power_of_two: bool,
    check: tuple[torch.Tensor, int] | None,
    rows_out: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data [R', C], scale [R', ceil(C/128)])`` of a 2-D CUDA tensor ``x [R, C]`` in 1x128 tiles.

    ``rows_out = R' >= R``: rows past ``R`` are zeros with scale 1 (padding for the GEMM). The
    scale is M-major (strides ``(1, R')``). ``check``: ``(guard code buffer, call number)`` to
    fold non-finite tiles into, or None.
    """
    rows, cols = x.shape
    data, scale, n_tiles, block_r = rows_layout(rows_out, cols, fp8_dtype, x.device)
    if rows_out == 0 or cols == 0:
        return data, scale
    code_buf, call = check if check is not None else (scale, 0)  # unused without CHECK
    grid: Any = (triton.cdiv(rows_out, block_r), n_tiles)
    _quantize_1x128[grid](
        x,
        data,
        scale,
        code_buf,
        rows,
        rows_out,
        cols,
        x.stride(0),
        x.stride(1),
        n_tiles,
        call * 2**32,
        FMT_MAX=fmt_max,
        E4M3=fmt_name == "e4m3",
        POW2=power_of_two,
        CHECK=check is not None,
        BLOCK_R=block_r,
        TILE=TILE_WIDTH,
    )
    return data, scale


# -- every weight of a model in 128x128 blocks, one launch (workers.fp8.weights) -----------------

# The columns of the per-weight table the grouped weight kernel reads (int64, one row per weight).
WEIGHT_FIELDS = (
    "src",  # the master weight's address
    "rows",  # N
    "cols",  # K
    "stride_r",
    "stride_c",
    "n_blocks_c",  # ceil(K / 128)
    "first_block",  # the weight's first block in the launch's block numbering
    "data_off",  # its FP8 bytes in the flat data buffer ([N, K] row-major)
    "scale_off",  # its scales in the flat scale buffer ([ceil(N/128), ceil(K/128)] row-major)
    "cublas_off",  # its cuBLAS scale layout in the flat cuBLAS buffer ([ceil(N/128), ld] row-major)
    "cublas_ld",  # ceil(K / 128) rounded up to a multiple of 4
)
SRC_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _quantize_128x128_many(
    table_ptr,
    owner_ptr,
    data_ptr,
    scale_ptr,
    cublas_ptr,
    code_ptr,
    call_code,
    SRC: tl.constexpr,
    FIELDS: tl.constexpr,
    FMT_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    POW2: tl.constexpr,
    CHECK: tl.constexpr,
    CUBLAS: tl.constexpr,
    TILE: tl.constexpr,
) -> None:
    """One 128x128 block of one of many weights per program: the weight is ``owner[block]``, its
    addresses and shape a row of ``table`` (:data:`WEIGHT_FIELDS`). One scale per block, as
    :func:`workers.fp8.quant.quantize` with ``block=(128, 128)`` computes it."""
    b = tl.program_id(0)
    w = tl.load(owner_ptr + b).to(tl.int64)
    row = table_ptr + w * FIELDS
    rows, cols = tl.load(row + 1), tl.load(row + 2)
    n_blocks_c = tl.load(row + 5)
    local = b - tl.load(row + 6)
    br, bc = local // n_blocks_c, local % n_blocks_c
    r = br * TILE + tl.arange(0, TILE)
    c = bc * TILE + tl.arange(0, TILE)
    src = tl.load(row)
    if SRC == 0:
        x_ptr = src.to(tl.pointer_type(tl.float32))
    elif SRC == 1:
        x_ptr = src.to(tl.pointer_type(tl.bfloat16))
    else:
        x_ptr = src.to(tl.pointer_type(tl.float16))
    x = load_tile(x_ptr, r, c, rows, cols, tl.load(row + 3), tl.load(row + 4))  # zeros past the edges
    amax = tile_amax(tile_amax(x, 1), 0)  # the rows' amax, then theirs: a NaN anywhere stays NaN
    scale = scale_of(amax, FMT_MAX, POW2)
    q8 = to_fp8(tl.math.div_rn(x, scale), FMT_MAX, E4M3)
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    tl.store(data_ptr + tl.load(row + 7) + r[:, None] * cols + c[None, :], q8, mask=inside)
    tl.store(scale_ptr + tl.load(row + 8) + local, scale)
    if CUBLAS:
        tl.store(cublas_ptr + tl.load(row + 9) + br * tl.load(row + 10) + bc, scale)
    if CHECK:
        bad = (amax != amax) | (amax == float("inf"))
        tl.atomic_min(code_ptr, call_code + w * 4294967296 + local, mask=bad)


def quantize_128x128_many(
    table: torch.Tensor,
    owner: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    cublas: torch.Tensor | None,
    src_dtype: torch.dtype,
    fmt_name: str,
    fmt_max: float,
    power_of_two: bool,
    check: tuple[torch.Tensor, int] | None,
) -> None:
    """Quantize every weight ``table`` names (int64 ``[n, len(WEIGHT_FIELDS)]``, all of
    ``src_dtype``) in 128x128 blocks, in one launch of one program per block (``owner [blocks]``:
    each block's row of the table), into the flat buffers ``data`` (FP8), ``scale`` (float32) and,
    if given, ``cublas`` (float32, its padding left as it is). ``check``: ``(guard code buffer,
    first call number)``; weight ``i`` is call ``first + i``, its code ``call * 2**32 + block``."""
    blocks = owner.shape[0]
    if blocks == 0:
        return
    code_buf, call = check if check is not None else (scale, 0)  # unused without CHECK
    _quantize_128x128_many[(blocks,)](
        table, owner, data, scale, cublas if cublas is not None else scale, code_buf, call * 2**32,
        SRC=SRC_CODES[src_dtype], FIELDS=len(WEIGHT_FIELDS), FMT_MAX=fmt_max, E4M3=fmt_name == "e4m3",
        POW2=power_of_two, CHECK=check is not None, CUBLAS=cublas is not None, TILE=TILE_WIDTH, num_warps=8,
    )  # fmt: skip
