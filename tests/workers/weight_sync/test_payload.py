"""Weight-sync export/load: a generator runs the trainer's FP8 weights bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.workers.fp8 import reference as ref
from tests.workers.fp8.models import tiny_model
from workers.fp8 import Fp8Linear, Fp8Tensor, convert_model
from workers.weight_sync.payload import export_weights, fp8_weight_names, load_weights, payload_bytes


def trained_fp8_model(seed: int) -> Any:
    """A converted model after one optimizer step, so its weights differ from any fresh init."""
    model = tiny_model("llama", layers=2, seed=seed)
    convert_model(model, "fp8-e2e", keep_bf16=(0, 1))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 10))
    model(ids, labels=ids).loss.backward()
    opt.step()
    return model.eval()


def test_generator_runs_trainer_fp8_weights_bit_for_bit(seed: int) -> None:
    trainer = trained_fp8_model(seed)
    generator = tiny_model("llama", layers=2, seed=seed + 1)  # different init
    convert_model(generator, "fp8-e2e", keep_bf16=(0, 1))
    payload = export_weights(trainer)
    load_weights(generator, payload)
    fp8_checked = 0
    for name, value in payload.items():
        if isinstance(value, Fp8Tensor):
            mod = generator.get_submodule(name.rsplit(".", 1)[0])
            assert isinstance(mod, Fp8Linear)
            got = mod.fp8_weight()
            assert torch.equal(got.data.view(torch.uint8), value.data.view(torch.uint8))
            assert torch.equal(got.scale, value.scale)
            fp8_checked += 1
    assert fp8_checked == 7  # layer 0's seven linears (layer 1 kept in BF16): the loop checked them
    ids = torch.randint(0, 128, (3, 9))
    with torch.no_grad():
        assert torch.equal(trainer(ids).logits, generator(ids).logits)


def test_payload_kinds_and_bytes(seed: int) -> None:
    trainer = trained_fp8_model(seed)
    payload = export_weights(trainer)
    fp8 = {n for n, v in payload.items() if isinstance(v, Fp8Tensor)}
    assert fp8 == set(fp8_weight_names(trainer)) and len(fp8) == 7  # layer 1 kept in BF16
    # hand count for the FP8 part: per layer q,o 64x64; k,v 32x64; gate,up 128x64; down 64x128,
    # each one 128x128 block scale (4 bytes)
    fp8_bytes = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64 + 7 * 4
    other = sum(v.numel() * v.element_size() for v in payload.values() if isinstance(v, torch.Tensor))
    assert payload_bytes(payload) == fp8_bytes + other


def test_fp8_gen_quantizes_bf16_trainer_weights_for_the_generator(seed: int) -> None:
    trainer = tiny_model("llama", layers=2, seed=seed)  # recipe fp8-gen: trainer stays high precision
    generator = tiny_model("llama", layers=2, seed=seed + 1)
    convert_model(generator, "fp8-gen")
    load_weights(generator, export_weights(trainer, fp8_names=fp8_weight_names(generator)))
    w = trainer.model.layers[0].mlp.up_proj.weight.detach()
    got = generator.model.layers[0].mlp.up_proj.fp8_weight()
    # independent check: the FP8 values are the float64 rounding of w / scale
    expected_scale = ref.block_scales(w, (128, 128), "e4m3")
    torch.testing.assert_close(got.scale.double(), expected_scale, rtol=2**-23, atol=0)
    err = (got.dequantize().double() - w.double()).abs()
    assert bool((err <= ref.error_bound(w, (128, 128), "e4m3")).all())


def test_load_errors_name_the_parameter(seed: int) -> None:
    trainer = trained_fp8_model(seed)
    plain = tiny_model("llama", layers=2)
    with pytest.raises(ValueError, match=r"model\.layers\.0\..*arrives in FP8.*convert_model"):
        load_weights(plain, export_weights(trainer))
    payload = export_weights(trainer)
    payload.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing"):
        load_weights(trainer, payload)
    converted = tiny_model("llama", layers=2)
    convert_model(converted, "fp8-gen")
    with pytest.raises(ValueError, match="fp8_names"):
        load_weights(converted, export_weights(tiny_model("llama", layers=2)))
