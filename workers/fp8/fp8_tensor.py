"""The FP8 tensor: float8 bytes with their float32 scales (:class:`Fp8Tensor`), and the kind whose
bytes are made on first read from the BF16 values the CPU's compiled quantizer keeps
(:class:`LazyBytesFp8Tensor`). :mod:`workers.fp8.quant` makes both and re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.fp8.block_ops import apply_block_scale, dequantize_blocks_cpu, scaled_cast_cpu
from workers.fp8.formats import Fp8Format, to_float32

Block = tuple[int, int] | None

TILE_1x128: tuple[int, int] = (1, 128)
BLOCK_128x128: tuple[int, int] = (128, 128)


@dataclass(frozen=True, eq=False)
class Fp8Tensor:
    """An FP8 tensor with its float32 scales.

    Attributes:
        data: float8 tensor with the shape of the source tensor.
        scale: float32. Tensorwise (``block is None``): a 0-d tensor. Blockwise: shape
            ``[*lead, ceil(R / block[0]), ceil(C / block[1])]`` for a source ``[*lead, R, C]``.
        block: ``(rows, cols)`` of one scaling block, or ``None`` for one scale per tensor.
        fmt: the FP8 format of ``data``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None
    fmt: Fp8Format
    # Weights set this: on CPU their dequantization (float32, or BF16 for the emulate_bf16 GEMM of
    # power-of-two scales) is kept for the emulated GEMM, since
    # the same FP8 weight is used for every call until the next optimizer step. Never on a GPU:
    # there FP8 weights hold only their FP8 data and scales (4 bytes per parameter would defeat
    # FP8's purpose), and a GPU without FP8 GEMMs dequantizes per call.
    cache_dequantized: bool = False
    _memo: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    _transpose_of: Fp8Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes of payload: one per element plus four per scale."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4

    @property
    def allocated_bytes(self) -> int:
        """Bytes this tensor holds in memory: :attr:`nbytes` plus a cached dequantization (CPU)."""
        return self.nbytes + sum(t.numel() * t.element_size() for t in self._memo.values())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale`` in ``dtype`` (computed in float32)."""
        if self._transpose_of is not None:  # a cached weight's transpose shares its memo
            return self._transpose_of.dequantize(dtype).t()
        cache = self.cache_dequantized and self.device.type == "cpu"
        key = "f32" if dtype == torch.float32 else str(dtype)  # kept per dtype asked for
        if cache and key in self._memo:
            return self._memo[key]
        if cache and "f32" in self._memo:
            out = self._memo["f32"]
        elif self.block is not None and self.device.type == "cpu":
            out = dequantize_blocks_cpu(self.data, self.scale, self.block)
        else:
            out = apply_block_scale(to_float32(self.data), self.scale, self.block, divide=False)
        out = out.to(dtype)
        if cache:
            self._memo[key] = out
        return out

    def t(self) -> Fp8Tensor:
        """Transpose of a 2-D tensor: a view of ``data`` (column-major), scales transposed."""
        if self.data.dim() != 2:
            raise ValueError(f"Fp8Tensor.t() needs a 2-D tensor, got shape {tuple(self.data.shape)}")
        block = None if self.block is None else (self.block[1], self.block[0])
        scale = self.scale if self.block is None else self.scale.t()
        parent = self if self.cache_dequantized else None
        return Fp8Tensor(self.data.t(), scale, block, self.fmt, self.cache_dequantized, {}, parent)

    def to(self, device: torch.device | str) -> Fp8Tensor:
        return Fp8Tensor(
            self.data.to(device), self.scale.to(device), self.block, self.fmt, self.cache_dequantized
        )

    def with_dequant_cache(self) -> Fp8Tensor:
        """The same tensor, keeping its float32 dequantization once computed (for weights)."""
        return Fp8Tensor(self.data, self.scale, self.block, self.fmt, True)


class LazyBytesFp8Tensor(Fp8Tensor):
    """An :class:`Fp8Tensor` from the CPU's compiled quantizer (the compiled path of
    :func:`workers.fp8.quant.quantize_dual`) whose FP8 bytes are made on first read, from the BF16
    values it keeps for the ``emulate_bf16`` GEMMs (which never read the bytes): ``bf16 / scale``
    cast to the format (:func:`scaled_cast_cpu`, as the eager quantizer), its bytes since the
    compiled call checked that every nonzero value times its scale is a finite BF16 normal
    (exact). Shape, device and size need no bytes (the shape is the BF16 values', or the
    transposed parent's); ``t()`` is the same kind of tensor, reading its parent's values."""

    _bytes: torch.Tensor | None

    def __init__(
        self,
        scale: torch.Tensor,
        fmt: Fp8Format,
        memo: dict[str, torch.Tensor],
        parent: LazyBytesFp8Tensor | None = None,
    ) -> None:
        object.__setattr__(self, "_bytes", None)
        super().__init__(None, scale, TILE_1x128, fmt, True, memo, parent)  # type: ignore[arg-type]

    @property
    def data(self) -> torch.Tensor:
        if self._bytes is None:
            if self._transpose_of is not None:
                made = self._transpose_of.data.t()
            else:
                d = self._memo[str(torch.bfloat16)]
                made = scaled_cast_cpu(d, self.scale, TILE_1x128, self.fmt, saturate=False)
            object.__setattr__(self, "_bytes", made)
        assert self._bytes is not None
        return self._bytes

    @data.setter
    def data(self, value: torch.Tensor | None) -> None:  # the dataclass's __init__ (None)
        object.__setattr__(self, "_bytes", value)

    @property
    def shape(self) -> torch.Size:
        if self._transpose_of is not None:
            rows, cols = self._transpose_of.shape
            return torch.Size((cols, rows))
        return self._memo[str(torch.bfloat16)].shape

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return self.shape.numel() + self.scale.numel() * 4

    def t(self) -> Fp8Tensor:
        return LazyBytesFp8Tensor(self.scale.t(), self.fmt, {}, self)
