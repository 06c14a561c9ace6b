"""An input that carries its own 1x128 tiles (workers/fp8/linear_gemm.py: attach_input_tiles,
input_tiles): taken only where they are what the reading GEMM would quantize, and a layer that
takes them computes what it computes from the BF16 input."""

from __future__ import annotations

import dataclasses

import torch

from workers.fp8.fp8_tensor import BLOCK_128x128, TILE_1x128
from workers.fp8.linear import Fp8Linear
from workers.fp8.linear_config import Fp8LinearConfig
from workers.fp8.linear_gemm import attach_input_tiles, input_rows, input_tiles
from workers.fp8.quant import quantize

CFG = Fp8LinearConfig()


def test_rows_are_padded_as_the_gemm_pads_them() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # only the type is read
    assert input_rows(7, CFG, cpu) == 7
    assert input_rows(7, CFG, cuda) == 16  # the quantizing pass pads to 16 on CUDA
    sixteen = dataclasses.replace(CFG, rows_multiple=16)
    assert input_rows(17, sixteen, cpu) == 32 and input_rows(32, sixteen, cuda) == 32


def test_tiles_are_taken_only_where_they_are_the_gemms_own() -> None:
    x = torch.randn(2, 3, 256).bfloat16()
    q = quantize(x.reshape(6, 256), "e4m3", TILE_1x128)
    assert input_tiles(x, CFG) is None  # nothing attached
    attach_input_tiles(x, q, power_of_two=False)
    assert input_tiles(x, CFG) is q
    assert input_tiles(x, dataclasses.replace(CFG, power_of_two_scales=True)) is None  # another scale rule
    assert input_tiles(x, dataclasses.replace(CFG, forward_fmt="e5m2")) is None  # another format
    assert input_tiles(x, dataclasses.replace(CFG, activation_block=BLOCK_128x128)) is None
    assert input_tiles(x, dataclasses.replace(CFG, rows_multiple=16)) is None  # 6 rows, 16 needed
    assert input_tiles(x.reshape(6, 256), CFG) is None  # another tensor object: not carried
    x.mul_(2)  # an in-place write after the tiles were made voids them
    assert input_tiles(x, CFG) is None


def test_a_layer_reading_tiles_computes_what_it_computes_from_the_input() -> None:
    """Tiles equal to the layer's own quantization give the same output bit for bit; tiles of
    other values are what the layer reads (the output is theirs), so a reader really takes them."""
    g = torch.Generator().manual_seed(0)
    layer = Fp8Linear(256, 128, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(128, 256, generator=g) / 16)
    layer.requires_grad_(False)
    x = torch.randn(5, 256, generator=g).bfloat16()
    want = layer(x)
    same = x.clone()
    attach_input_tiles(same, quantize(same, "e4m3", TILE_1x128), power_of_two=False)
    assert torch.equal(layer(same), want)
    other = x.clone()
    attach_input_tiles(other, quantize(-x, "e4m3", TILE_1x128), power_of_two=False)
    assert torch.equal(layer(other), -want)
