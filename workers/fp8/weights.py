"""A trainer's FP8 weights, all quantized in one batched call after each optimizer step.

Left to itself, an :class:`~workers.fp8.linear.Fp8Linear` re-quantizes its master weight the first
time it is used after an update (:meth:`~workers.fp8.linear.Fp8Linear.fp8_weight`): one layer at
a time, inside the next forward, about ten torch kernels each (a float32 copy, the block amax,
the finite check, the division, the cast) and, for a fused q/k/v or gate/up group
(:class:`~workers.fp8.fused.TrainFusedGroup`), a concatenation of its members. A 1B model has ~112
FP8 linears: ~1000 launches per optimizer step. :class:`WeightBatch` quantizes them all at once,
right after the optimizer step:

- on CUDA, one Triton launch (per kind of master weight: dtype, FP8 format, scale rounding) with
  one program per 128x128 block of any weight
  (:func:`workers.fp8.triton_quant.quantize_128x128_many`), which also writes the scale layout
  cuBLAS's blockwise forward GEMM reads; elsewhere the torch quantizer, weight by weight. The
  bytes and scales are the quantizer's either way (tested under Triton's interpreter, and on a GPU);
- into flat buffers made anew at each update (a payload already exported keeps its bytes): each
  layer's FP8 weight is a view of its part; a fused group's members are adjacent, so the group's
  stacked weight is a view as well, with no concatenation;
- each layer takes its view as its FP8 copy of the updated master weight, so the next forward,
  weight sync and export all read it and nothing quantizes again. (The trainer calls it after
  each optimizer step and after a checkpoint load; a master weight changed in place anywhere else
  is noticed by its layer's version check, which re-quantizes it when next used, as before.)

Only layers with master weights in 128x128 blocks take part (a trainer's; a generator holds FP8
weights alone and loads them).

:func:`quantize_weights` serves an ``fp8-gen`` export (a BF16 trainer's master weights quantized
for FP8 generators at each sync) with the same grouped kernel: one launch for all of them, where
torch takes about eight kernels a weight.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from workers.fp8.dispatch import to_device
from workers.fp8.formats import Fp8Format, get_format
from workers.fp8.fp8_tensor import BLOCK_128x128, Fp8Tensor
from workers.fp8.fused import TrainFusedGroup
from workers.fp8.guard import active_guard
from workers.fp8.linear import Fp8Linear
from workers.fp8.linear_config import Fp8LinearConfig
from workers.fp8.quant import quantize_weight_compiled, use_triton

_DATA_ALIGN = 256  # bytes: where each unit's FP8 bytes start (cuBLAS wants 16)
_SCALE_ALIGN = 4  # floats: where each unit's scales start (16 bytes)


BF16_MEMO = str(torch.bfloat16)  # Fp8Tensor.dequantize's memo key for its BF16 values


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _align(n: int, to: int) -> int:
    return _cdiv(n, to) * to


@dataclass
class _Part:
    """One weight's place in its lane's flat buffers."""

    layer: Fp8Linear
    data_off: int  # its [N, K] bytes, row-major
    scale_off: int  # its [ceil(N/128), ceil(K/128)] scales, row-major
    cublas_off: int  # its [ceil(N/128), ld] scales, row-major (padding zeros): cuBLAS reads the transpose
    first_block: int  # its first 128x128 block in the lane's numbering

    @property
    def grid(self) -> tuple[int, int]:
        n, k = self.layer.weight.shape
        return _cdiv(n, 128), _cdiv(k, 128)

    @property
    def ld(self) -> int:
        return _align(self.grid[1], 4)


@dataclass
class _Lane:
    """Weights quantized by one launch: the same device, master dtype, format and scale rounding."""

    device: torch.device
    src_dtype: torch.dtype
    fmt: Fp8Format
    power_of_two: bool
    parts: list[_Part] = field(default_factory=list)
    groups: list[tuple[TrainFusedGroup, int]] = field(default_factory=list)  # (group, its first part)
    data_size: int = 0
    scale_size: int = 0
    cublas_size: int = 0
    blocks: int = 0
    _tables: tuple[torch.Tensor, torch.Tensor] | None = None
    _sources: tuple[Any, ...] | None = None

    def add(self, layers: list[Fp8Linear]) -> None:
        """A unit: one layer, or a fused group's members (adjacent, no padding between them)."""
        self.data_size = _align(self.data_size, _DATA_ALIGN)
        self.scale_size = _align(self.scale_size, _SCALE_ALIGN)
        self.cublas_size = _align(self.cublas_size, _SCALE_ALIGN)
        for m in layers:
            part = _Part(m, self.data_size, self.scale_size, self.cublas_size, self.blocks)
            n_r, n_c = part.grid
            self.data_size += m.weight.numel()
            self.scale_size += n_r * n_c
            self.cublas_size += n_r * part.ld
            self.blocks += n_r * n_c
            self.parts.append(part)

    def stale(self) -> bool:
        return any(p.layer._w_q_key != p.layer._weight_key() for p in self.parts)

    def _kernel_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's per-weight table and per-block owner, made again only when a master weight
        moved (the optimizer updates in place: once per trainer)."""
        sources = tuple((p.layer.weight.data_ptr(), p.layer.weight.stride()) for p in self.parts)
        if self._tables is None or sources != self._sources:
            rows, owner = [], []
            for i, p in enumerate(self.parts):
                n_r, n_c = p.grid
                rows.append(
                    _table_row(p.layer.weight, p.first_block, p.data_off, p.scale_off, p.cublas_off, p.ld)
                )
                owner += [i] * (n_r * n_c)
            table = torch.tensor(rows, dtype=torch.int64).to(self.device)
            self._tables = (table, torch.tensor(owner, dtype=torch.int32).to(self.device))
            self._sources = sources
        return self._tables

    @torch.no_grad()
    def quantize(self) -> None:
        fmt, dev = self.fmt, self.device
        # let go of the previous copies first: unless a payload still holds them, their memory
        # serves the new ones (no second set of FP8 weights at the peak); a layer left without
        # one (if this raises) quantizes its own at its next use
        for p in self.parts:
            p.layer.forget_fp8_weight()
        for group, _ in self.groups:
            group.forget()
        data = torch.empty(self.data_size, dtype=fmt.dtype, device=dev)
        scale = torch.empty(self.scale_size, dtype=torch.float32, device=dev)
        # cuBLAS's blockwise layout pads each weight's block columns to a multiple of 4
        cublas = (
            torch.zeros(self.cublas_size, dtype=torch.float32, device=dev) if dev.type == "cuda" else None
        )
        weights = [self._tensor(data, scale, cublas, p, p.layer.out_features) for p in self.parts]
        if dev.type == "cuda" and use_triton():
            table, owner = self._kernel_tables()
            masters = [(_where(p), p.layer.weight) for p in self.parts]
            _quantize_grouped(masters, table, owner, data, scale, cublas, fmt, self.power_of_two)
        else:
            for p, w in zip(self.parts, weights, strict=True):
                # on a CPU with power-of-two scales: compiled, the BF16 GEMM operand made in the same pass
                q = quantize_weight_compiled(p.layer.weight, fmt, _where(p)) if self.power_of_two else None
                q = q if q is not None else p.layer.config.quantize_weight(p.layer.weight, _where(p))
                w.data.copy_(q.data)
                w.scale.copy_(q.scale)
                if BF16_MEMO in q._memo:
                    w._memo[BF16_MEMO] = q._memo[BF16_MEMO]
                if cublas is not None:  # [ld, N/128]: the rows past K/128 stay zero
                    w._memo["cublas_scale_t"][: p.grid[1]].copy_(q.scale.t())
        for p, w in zip(self.parts, weights, strict=True):
            p.layer.adopt_fp8_weight(w)
        for group, first in self.groups:  # the members' rows are adjacent: the group's weight is a view
            rows = sum(m.out_features for m in group.layers)
            fused = self._tensor(data, scale, cublas, self.parts[first], rows)
            members = [w._memo.get(BF16_MEMO) for w in weights[first : first + len(group.layers)]]
            if members and all(m is not None for m in members):  # the members' BF16 operands, stacked
                fused._memo[BF16_MEMO] = torch.cat(members)  # type: ignore[arg-type]
            group.adopt(fused)

    def _tensor(
        self, data: torch.Tensor, scale: torch.Tensor, cublas: torch.Tensor | None, first: _Part, rows: int
    ) -> Fp8Tensor:
        """The FP8 weight of ``rows`` rows starting at part ``first`` (one part, or a fused group's
        adjacent parts, which share K), as views of the flat buffers."""
        k, (_, n_c) = first.layer.in_features, first.grid
        n_r = _cdiv(rows, 128)
        memo = (
            {} if cublas is None else {"cublas_scale_t": _view(cublas, first.cublas_off, n_r, first.ld).t()}
        )
        w_data, w_scale = _view(data, first.data_off, rows, k), _view(scale, first.scale_off, n_r, n_c)
        return Fp8Tensor(w_data, w_scale, BLOCK_128x128, self.fmt, True, memo)


def _view(flat: torch.Tensor, offset: int, rows: int, cols: int) -> torch.Tensor:
    return flat[offset : offset + rows * cols].view(rows, cols)


def _where(p: _Part) -> str:
    return f"{p.layer.name}: weight"


def _takes_part(m: Fp8Linear) -> bool:
    return not m.fp8_only and _groupable(m.weight, m.config)


def _groupable(w: torch.Tensor, cfg: Fp8LinearConfig) -> bool:
    """Whether the grouped kernel can quantize the master weight ``w`` under ``cfg``: a 2-D float
    weight in 128x128 blocks."""
    return cfg.weight_block == BLOCK_128x128 and w.dim() == 2 and w.dtype in _DTYPES


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class WeightBatch:
    """Every FP8 weight of ``model`` (layers with master weights in 128x128 blocks), quantized at
    once by :meth:`quantize` (see the module docstring). The layout is fixed when it is made: make
    it after the model is converted and fused."""

    def __init__(self, model: nn.Module) -> None:
        self.lanes: dict[tuple[Any, ...], _Lane] = {}
        seen: set[int] = set()
        for m in model.modules():
            if not isinstance(m, Fp8Linear) or id(m) in seen or not _takes_part(m):
                continue
            group = m.fused_train[0] if m.fused_train is not None else None
            unit = list(group.layers) if group is not None else [m]
            if not all(_takes_part(u) for u in unit):
                continue
            seen.update(id(u) for u in unit)
            cfg, w = m.config, m.weight
            key = (w.device, w.dtype, cfg.forward_fmt, cfg.power_of_two_scales)
            lane = self.lanes.get(key)
            if lane is None:
                lane = self.lanes[key] = _Lane(
                    w.device, w.dtype, get_format(cfg.forward_fmt), cfg.power_of_two_scales
                )
            if group is not None:
                lane.groups.append((group, len(lane.parts)))
            lane.add(unit)

    @property
    def layers(self) -> int:
        return sum(len(lane.parts) for lane in self.lanes.values())

    def quantize(self) -> int:
        """Quantize every weight of a lane whose master weights changed since their FP8 copies
        were made; returns how many weights were quantized."""
        done = 0
        for lane in self.lanes.values():
            if lane.stale():
                lane.quantize()
                done += len(lane.parts)
        return done


def _table_row(
    w: torch.Tensor, first_block: int, data_off: int, scale_off: int, cublas_off: int = 0, ld: int = 0
) -> list[int]:
    """A master weight's row of the grouped kernel's table (``triton_quant.WEIGHT_FIELDS``)."""
    n_c = _cdiv(w.shape[1], 128)
    return [w.data_ptr(), w.shape[0], w.shape[1], w.stride(0), w.stride(1), n_c, first_block, data_off,
            scale_off, cublas_off, ld]  # fmt: skip


def _quantize_grouped(
    masters: Sequence[tuple[str, torch.Tensor]],
    table: torch.Tensor,
    owner: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    cublas: torch.Tensor | None,
    fmt: Fp8Format,
    power_of_two: bool,
) -> None:
    """One launch of the grouped 128x128 kernel over ``masters`` ((where, weight), one device and
    master dtype, in ``table``'s order), with one call of the active finite guard reserved per
    weight, numbered in a row: an error names the weight."""
    from workers.fp8.triton_quant import quantize_128x128_many

    guard = active_guard()
    check = None
    if guard is not None:
        calls = [guard.reserve(data.device, tuple(w.shape), BLOCK_128x128, where) for where, w in masters]
        check = calls[0]
    src_dtype = masters[0][1].dtype
    quantize_128x128_many(
        table, owner, data, scale, cublas, src_dtype, fmt.name, fmt.max, power_of_two, check
    )


def quantize_weights(named: Sequence[tuple[str, torch.Tensor]], cfg: Fp8LinearConfig) -> list[Fp8Tensor]:
    """``cfg.quantize_weight(w, name)`` of each named master weight, as new FP8 copies: an
    ``fp8-gen`` export, the generators' FP8 layers quantized from a BF16 trainer's weights at each
    sync. On CUDA with Triton and 128x128 blocks, the weights of one device and master dtype in one
    launch of the grouped kernel, as views of one flat buffer (before: about eight torch kernels a
    weight); elsewhere weight by weight. The same bytes and scales either way."""
    fmt = get_format(cfg.forward_fmt)
    out: list[Fp8Tensor | None] = [None] * len(named)
    grouped: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (name, w) in enumerate(named):
        if _grouped_here(w) and _groupable(w, cfg):
            grouped.setdefault((w.device, w.dtype), []).append(i)
        else:
            out[i] = cfg.quantize_weight(w, name)
    for (dev, _), members in grouped.items():
        masters = [(named[i][0], named[i][1].detach()) for i in members]
        rows, places, blocks = [], [], []
        data_size = scale_size = first = 0
        for _, w in masters:
            data_size, scale_size = _align(data_size, _DATA_ALIGN), _align(scale_size, _SCALE_ALIGN)
            grid = (_cdiv(w.shape[0], 128), _cdiv(w.shape[1], 128))
            rows.append(_table_row(w, first, data_size, scale_size))
            places.append((data_size, scale_size, grid))
            blocks.append(grid[0] * grid[1])
            data_size, scale_size, first = data_size + w.numel(), scale_size + blocks[-1], first + blocks[-1]
        owner = np.repeat(np.arange(len(masters), dtype=np.int32), blocks)  # each block's weight
        table = to_device(torch.tensor(rows, dtype=torch.int64), dev)
        data = torch.empty(data_size, dtype=fmt.dtype, device=dev)
        scale = torch.empty(scale_size, dtype=torch.float32, device=dev)
        _quantize_grouped(masters, table, to_device(torch.from_numpy(owner), dev), data, scale, None, fmt,
                          cfg.power_of_two_scales)  # fmt: skip
        for i, (_, w), (d, s, (n_r, n_c)) in zip(members, masters, places, strict=True):
            out[i] = Fp8Tensor(
                _view(data, d, w.shape[0], w.shape[1]), _view(scale, s, n_r, n_c), BLOCK_128x128, fmt
            )
    done = [q for q in out if q is not None]
    assert len(done) == len(named), "quantize_weights: a weight was left out"
    return done


def _grouped_here(w: torch.Tensor) -> bool:
    """Whether the grouped kernel quantizes ``w`` for :func:`quantize_weights`: on CUDA with Triton
    (unless ``FP8RL_TRITON=0``), or on the CPU under Triton's interpreter (tests)."""
    interpreted = w.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    return (w.is_cuda or interpreted) and use_triton()
