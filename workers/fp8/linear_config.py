"""How an :class:`~workers.fp8.linear.Fp8Linear` quantizes (:class:`Fp8LinearConfig`): the
blocks and formats of its three GEMMs' operands, and how its weight becomes FP8. Its own module
because both the layer (:mod:`workers.fp8.linear`) and its GEMMs (:mod:`workers.fp8.linear_gemm`)
read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workers.fp8.fp8_tensor import Block, BLOCK_128x128, Fp8Tensor, TILE_1x128
from workers.fp8.matmul import Backend
from workers.fp8.quant import quantize

# precision.fp8_format -> the gradients' FP8 format (activations and weights are always E4M3)
GRAD_FORMATS = {"e4m3": "e4m3", "hybrid": "e5m2"}


@dataclass(frozen=True)
class Fp8LinearConfig:
    """How an :class:`~workers.fp8.linear.Fp8Linear` quantizes. Defaults: blockwise E4M3 on all
    three GEMMs (the anchors' recipe, see :mod:`workers.fp8.linear`); :meth:`for_format` builds
    one from a job's ``precision.fp8_format``."""

    weight_block: Block = BLOCK_128x128
    activation_block: Block = TILE_1x128
    grad_block: Block = TILE_1x128
    forward_fmt: str = "e4m3"
    grad_fmt: str = "e4m3"
    power_of_two_scales: bool = False
    backend: Backend = "auto"
    # fprop pads its rows with zeros to a multiple of this: 16 makes the float32 GEMM's result
    # for a row independent of M (``precision.exact``, see workers.engines.exact); 1 = no padding
    rows_multiple: int = 1

    @property
    def bf16_exact(self) -> bool:
        """Every operand's dequantized values are exact in BF16 (power-of-two scales) and no GEMM
        must be row-invariant (``rows_multiple`` 1): a CPU may run the GEMMs in BF16
        (``workers.fp8.matmul.matmul_bf16``)."""
        return self.power_of_two_scales and self.rows_multiple == 1

    @classmethod
    def for_format(cls, fp8_format: str, **kwargs: Any) -> Fp8LinearConfig:
        """``e4m3``: E4M3 everywhere; ``hybrid``: E4M3 forward, E5M2 gradients."""
        if fp8_format not in GRAD_FORMATS:
            raise ValueError(f"fp8_format must be one of {sorted(GRAD_FORMATS)}, got {fp8_format!r}")
        return cls(grad_fmt=GRAD_FORMATS[fp8_format], **kwargs)

    def transposed(self, block: Block) -> Block:
        """``block`` of a tensor seen through its transpose."""
        return None if block is None else (block[1], block[0])

    def quantize_weight(self, w: torch.Tensor, where: str = "weight") -> Fp8Tensor:
        """A weight as every FP8 path of fp8rl holds it (an FP8 layer's own copy, an exported or
        synced weight): ``forward_fmt`` in ``weight_block`` blocks, with this config's scales."""
        return quantize(
            w.detach(),
            self.forward_fmt,
            self.weight_block,
            power_of_two=self.power_of_two_scales,
            where=where,
        )
