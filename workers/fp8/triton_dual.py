"""Training's 1x128 quantization of both layouts from one read (Triton): ``x`` along its columns
and ``x.T`` along its rows, each in the tiles :func:`workers.fp8.triton_quant.quantize_1x128`
writes, for the forward GEMM (``x``) and the weight-gradient GEMM (``x.T``, contracting over
tokens). :func:`workers.fp8.quant.quantize_dual` calls it on CUDA; the bytes and scales are bit
for bit two one-layout passes (``tests/workers/fp8/triton_kernel_checks.py`` under the
interpreter, ``tests/workers/test_gpu_data_plane.py`` on a GPU). Imported only on CUDA.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from workers.fp8.triton_math import to_fp8
from workers.fp8.triton_quant import TILE_WIDTH, load_tile, scale_of, tile_amax, write_rows

# How the dual-layout pass makes x.T (FP8RL_DUAL_QUANT, read at each call; all three write the same
# bits): "fp8", one 128x128 tile per program, transposed after the cast as 1-byte FP8 values
# (the default; measured on an H200, 2026-11-29: 0.67-0.79 TB/s against 2.2-2.9 TB/s for one
# layout); "f32", the same tile transposed before the cast, as float32 (timed by the kernel
# bench's quantize_dual_f32t rows); "split", each tile's two layouts made by eight programs of
# narrow strips in the same launch (_quantize_1x128_split; the quantize_dual_split rows). The
# 128x128 tile needs 255 registers a thread at 8 warps and spills (ptxas for SM90), so one such
# program fits on a multiprocessor at a time; a strip needs none spilled (test_triton_kernels.py).
DUAL_ENV = "FP8RL_DUAL_QUANT"
DUAL_TRANSPOSES = ("fp8", "f32", "split")
DUAL_TRANSPOSE = "fp8"
_STRIP = 32  # the split pass's strips: 32 rows x 128 columns (x's layout), 128 rows x 32 columns (x.T's)


@triton.jit
def _quantize_1x128_dual(
    x_ptr,
    data_ptr,
    scale_ptr,
    data_t_ptr,
    scale_t_ptr,
    code_ptr,
    rows,
    rows_out,
    rows_t_out,
    cols,
    stride_r,
    stride_c,
    n_tiles_c,
    call_code,
    FMT_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    POW2: tl.constexpr,
    CHECK: tl.constexpr,
    TILE: tl.constexpr,
    T32: tl.constexpr,
) -> None:
    """One 128x128 tile of ``x [rows, cols]`` read once, written twice: along ``cols`` (1x128
    tiles of a row: :func:`~workers.fp8.triton_quant.quantize_1x128` of ``x``) and along ``rows``
    (1x128 tiles of a column: the same of ``x.T``, its rows ``rows_t_out >= rows`` long, zeros
    past ``rows``), each with its own scales (:func:`write_rows`, :func:`write_columns`). ``T32``:
    the tile is transposed in float32 before ``x.T``'s cast (4-byte elements through shared
    memory) instead of after it (1-byte FP8 elements); the same bits either way (see
    DUAL_TRANSPOSE)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * TILE + tl.arange(0, TILE)  # [TILE] rows of x (tokens)
    c = pid_c * TILE + tl.arange(0, TILE)  # [TILE] columns of x
    x = load_tile(x_ptr, r, c, rows, cols, stride_r, stride_c)
    # along cols, as the one-layout kernel (the rows' tiles name a non-finite value for the guard;
    # the columns' tiles see the same ones)
    write_rows(x, r, c, pid_c, rows, rows_out, cols, data_ptr, scale_ptr, code_ptr, n_tiles_c, call_code,
               FMT_MAX, E4M3, POW2, CHECK)  # fmt: skip
    write_columns(x, r, c, pid_r, cols, rows_t_out, data_t_ptr, scale_t_ptr, FMT_MAX, E4M3, POW2, T32)


@triton.jit
def write_columns(
    x, r, c, tile_r, cols, rows_t_out, data_t_ptr, scale_t_ptr,
    FMT_MAX: tl.constexpr, E4M3: tl.constexpr, POW2: tl.constexpr, T32: tl.constexpr,
) -> None:  # fmt: skip
    """The tile ``x [r, c]`` (``r``: all 128 rows of row tile ``tile_r``) along ``rows``: ``x.T``'s
    rows in 1x128 tiles, one scale per column over the tile's rows, FP8 bytes into ``data_t [cols,
    rows_t_out]`` (row-major; x is 0 past ``rows``: data 0) and scales into ``scale_t``
    (``[cols, n_tiles_r]``, stride 1 along cols). ``T32``: transposed before the cast (float32)
    rather than after it (FP8 bytes); the same bits."""
    scale_t = scale_of(tile_amax(x, 0), FMT_MAX, POW2)
    if T32:
        q8_t = to_fp8(tl.math.div_rn(tl.trans(x), scale_t[:, None]), FMT_MAX, E4M3)  # [cols, rows]
    else:
        q8_t = tl.trans(to_fp8(tl.math.div_rn(x, scale_t[None, :]), FMT_MAX, E4M3))
    inside_t = (c[:, None] < cols) & (r[None, :] < rows_t_out)
    tl.store(data_t_ptr + c[:, None] * rows_t_out + r[None, :], q8_t, mask=inside_t)
    tl.store(scale_t_ptr + tile_r * cols + c, scale_t, mask=c < cols)


@triton.jit
def _quantize_1x128_split(
    x_ptr,
    data_ptr,
    scale_ptr,
    data_t_ptr,
    scale_t_ptr,
    code_ptr,
    rows,
    rows_out,
    rows_t_out,
    cols,
    stride_r,
    stride_c,
    n_tiles_c,
    call_code,
    FMT_MAX: tl.constexpr,
    E4M3: tl.constexpr,
    POW2: tl.constexpr,
    CHECK: tl.constexpr,
    TILE: tl.constexpr,
    STRIP: tl.constexpr,
) -> None:
    """What :func:`_quantize_1x128_dual` writes, by ``2 * TILE / STRIP`` programs per 128x128 tile
    of ``x``, numbered one after the other (so that the tile's second read can find it in the L2
    cache): the first ``TILE / STRIP`` each write ``STRIP`` rows of ``x``'s own layout (the
    one-layout kernel's program), the others each ``STRIP`` columns of ``x.T``'s. A program holds
    a quarter of the tile (at ``STRIP`` 32), not all of it."""
    STRIPS: tl.constexpr = TILE // STRIP
    pid = tl.program_id(0)
    tile = pid // (2 * STRIPS)
    part = pid % (2 * STRIPS)
    tile_r = tile // n_tiles_c
    tile_c = tile % n_tiles_c
    if part < STRIPS:
        first_row = tile_r * TILE + part * STRIP
        _rows_strip(
            x_ptr, data_ptr, scale_ptr, code_ptr, first_row, tile_c, rows, rows_out, cols, stride_r, stride_c,
            n_tiles_c, call_code, FMT_MAX, E4M3, POW2, CHECK, TILE, STRIP,
        )  # fmt: skip
    else:
        first_col = tile_c * TILE + (part - STRIPS) * STRIP
        _columns_strip(
            x_ptr, data_t_ptr, scale_t_ptr, tile_r, first_col, rows, rows_t_out, cols, stride_r, stride_c,
            FMT_MAX, E4M3, POW2, TILE, STRIP,
        )  # fmt: skip


@triton.jit
def _rows_strip(
    x_ptr, data_ptr, scale_ptr, code_ptr, first_row, tile_c, rows, rows_out, cols, stride_r, stride_c,
    n_tiles_c, call_code, FMT_MAX: tl.constexpr, E4M3: tl.constexpr, POW2: tl.constexpr,
    CHECK: tl.constexpr, TILE: tl.constexpr, STRIP: tl.constexpr,
) -> None:  # fmt: skip
    """Rows ``[first_row, first_row + STRIP)`` of column tile ``tile_c``, along ``cols``."""
    r = first_row + tl.arange(0, STRIP)
    c = tile_c * TILE + tl.arange(0, TILE)
    x = load_tile(x_ptr, r, c, rows, cols, stride_r, stride_c)
    write_rows(x, r, c, tile_c, rows, rows_out, cols, data_ptr, scale_ptr, code_ptr, n_tiles_c, call_code,
               FMT_MAX, E4M3, POW2, CHECK)  # fmt: skip


@triton.jit
def _columns_strip(
    x_ptr, data_t_ptr, scale_t_ptr, tile_r, first_col, rows, rows_t_out, cols, stride_r, stride_c,
    FMT_MAX: tl.constexpr, E4M3: tl.constexpr, POW2: tl.constexpr, TILE: tl.constexpr, STRIP: tl.constexpr,
) -> None:  # fmt: skip
    """Columns ``[first_col, first_col + STRIP)`` of row tile ``tile_r``, along ``rows``: x.T's
    rows, one scale each over the tile's 128 rows (zeros past ``rows``), as the dual kernel."""
    r = tile_r * TILE + tl.arange(0, TILE)
    c = first_col + tl.arange(0, STRIP)
    x = load_tile(x_ptr, r, c, rows, cols, stride_r, stride_c)  # [TILE, STRIP]
    write_columns(x, r, c, tile_r, cols, rows_t_out, data_t_ptr, scale_t_ptr, FMT_MAX, E4M3, POW2, False)


def dual_transpose() -> str:
    """``FP8RL_DUAL_QUANT``: how the dual-layout pass makes ``x.T`` (:data:`DUAL_TRANSPOSES`;
    unset, :data:`DUAL_TRANSPOSE`). The same bits every way; only the speed differs."""
    wanted = os.environ.get(DUAL_ENV, DUAL_TRANSPOSE)
    if wanted not in DUAL_TRANSPOSES:
        shown = ", ".join(f"{w} (default)" if w == DUAL_TRANSPOSE else w for w in DUAL_TRANSPOSES)
        raise ValueError(f"{DUAL_ENV}={wanted!r}: use {shown}")
    return wanted


def quantize_1x128_dual(
    x: torch.Tensor,
    fmt_name: str,
    fmt_max: float,
    fp8_dtype: torch.dtype,
    power_of_two: bool,
    check: tuple[torch.Tensor, int] | None,
    rows_out: int,
    rows_t_out: int | None = None,
    transpose: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~workers.fp8.triton_quant.quantize_1x128` of ``x [R, C]`` and of ``x.T``, from one
    read of ``x``:
    ``(data [R', C], scale [R', ceil(C/128)], data_t [C, R''], scale_t [C, ceil(R/128)])``, each
    laid out as that call lays it out (row-major data, M-major scales). ``rows_t_out = R''``
    (default ``R``, at most the next multiple of 128): ``x.T``'s rows padded with zeros, so that a
    GEMM contracting over them finds the contraction already a multiple of 128 (the scales cover
    the padding: no new tile). ``check`` folds the non-finite tiles of ``x``'s own layout into the
    guard. ``transpose`` (default: :func:`dual_transpose`, ``FP8RL_DUAL_QUANT``): ``fp8`` or
    ``f32``, where one program's 128x128 tile is transposed, or ``split``, strips of the tile by
    eight programs (:func:`_quantize_1x128_split`); the bench's ``quantize_dual``,
    ``quantize_dual_f32t`` and ``quantize_dual_split`` rows time each."""
    transpose = dual_transpose() if transpose is None else transpose
    if transpose not in DUAL_TRANSPOSES:
        raise ValueError(f"transpose={transpose!r}: one of {', '.join(DUAL_TRANSPOSES)}")
    rows, cols = x.shape
    rows_t_out = rows if rows_t_out is None else rows_t_out
    n_tiles_c, n_tiles_r = triton.cdiv(cols, TILE_WIDTH), triton.cdiv(rows, TILE_WIDTH)
    if not rows <= rows_t_out <= n_tiles_r * TILE_WIDTH:
        raise ValueError(
            f"rows_t_out={rows_t_out}: between {rows} and {n_tiles_r * TILE_WIDTH} (no new tile)"
        )
    data = torch.empty((rows_out, cols), dtype=fp8_dtype, device=x.device)
    scale = torch.empty((n_tiles_c, rows_out), dtype=torch.float32, device=x.device).t()
    data_t = torch.empty((cols, rows_t_out), dtype=fp8_dtype, device=x.device)
    scale_t = torch.empty((n_tiles_r, cols), dtype=torch.float32, device=x.device).t()
    if rows_out == 0 or cols == 0:
        return data, scale, data_t, scale_t
    code_buf, call = check if check is not None else (scale, 0)  # unused without CHECK
    tiles_r = triton.cdiv(max(rows_out, rows_t_out), TILE_WIDTH)
    if transpose == "split":
        _quantize_1x128_split[(tiles_r * n_tiles_c * 2 * (TILE_WIDTH // _STRIP),)](
            x, data, scale, data_t, scale_t, code_buf, rows, rows_out, rows_t_out, cols, x.stride(0),
            x.stride(1), n_tiles_c, call * 2**32,
            FMT_MAX=fmt_max, E4M3=fmt_name == "e4m3", POW2=power_of_two, CHECK=check is not None,
            TILE=TILE_WIDTH, STRIP=_STRIP, num_warps=4,
        )  # fmt: skip
        return data, scale, data_t, scale_t
    grid: Any = (tiles_r, n_tiles_c)
    _quantize_1x128_dual[grid](
        x, data, scale, data_t, scale_t, code_buf, rows, rows_out, rows_t_out, cols, x.stride(0), x.stride(1),
        n_tiles_c, call * 2**32,
        FMT_MAX=fmt_max, E4M3=fmt_name == "e4m3", POW2=power_of_two, CHECK=check is not None, TILE=TILE_WIDTH,
        T32=transpose == "f32", num_warps=8,
    )  # fmt: skip
    return data, scale, data_t, scale_t
