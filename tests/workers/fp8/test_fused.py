"""Fused q/k/v and gate/up projections of an FP8 generator (workers/fp8/fused.py): the same FP8
bytes per 128x128 block, the same outputs as the separate layers, one GEMM per group, and weight
loads that write into the group's storage."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from rljob import parse_spec
from workers.engines.batching import left_pad, positions
from workers.engines.native.generator import NativeGenerator
from workers.engines.native.trainer import NativeTrainer
from workers.fp8 import fused as fused_mod
from workers.fp8 import linear as linear_mod
from workers.fp8 import linear_gemm
from workers.fp8.fused import fuse_projections
from workers.fp8.linear import Fp8Linear
from workers.models.tokenizer import ByteTokenizer
from workers.weight_sync.payload import export_weights, fp8_weight_names

TOK = ByteTokenizer()
# head_dim 128, one KV head: q 256 rows, k and v 128 each, gate and up 512: whole 128-row blocks
SPEC = parse_spec(
    {
        "model": {"tiny": {"hidden_size": 256, "intermediate_size": 512, "num_heads": 2, "num_kv_heads": 1}},
        "precision": {"recipe": "fp8-e2e"},
    }
)


def generator() -> NativeGenerator:
    gen = NativeGenerator(SPEC, TOK.vocab_size, TOK.eos_id, TOK.pad_id, "cpu")
    assert gen.fused_groups == 0  # the CPU path keeps separate layers; the tests fuse by hand
    return gen


def logits(model: Any) -> torch.Tensor:
    ids, mask = left_pad([TOK.encode("12 + 30 = "), TOK.encode("7 + 5 = ")], TOK.pad_id)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits.float()


def test_fused_groups_keep_the_bytes_and_give_the_separate_layers_outputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = generator()
    before = copy.deepcopy(gen.model)
    layers = {n: m for n, m in gen.model.named_modules() if isinstance(m, Fp8Linear)}
    bytes_before = {
        n: (m.fp8_weight().data.view(torch.uint8).clone(), m.fp8_weight().scale.clone())
        for n, m in layers.items()
    }
    assert fuse_projections(gen.model) == 2 * 2  # two decoder layers: q/k/v and gate/up each
    for n, m in layers.items():
        data, scale = bytes_before[n]
        assert torch.equal(m.fp8_weight().data.view(torch.uint8), data) and torch.equal(
            m.fp8_weight().scale, scale
        )
    attn = gen.model.model.layers[0].self_attn
    group = attn.q_proj.fused[0]
    # each member's weight is a view of its rows of the group's one weight
    assert attn.k_proj.fp8_weight().data.data_ptr() == group.weight.data[256:384].data_ptr()
    calls = []
    real = linear_gemm.fprop_gemm

    def counting(*args: Any) -> Any:
        calls.append(args[5])  # the name (x_q may follow)
        return real(*args)

    monkeypatch.setattr(fused_mod, "fprop_gemm", counting)
    monkeypatch.setattr(linear_mod, "fprop_gemm", counting)
    got = logits(gen.model)
    # per decoder layer: q+k+v, o, gate+up, down: 4 GEMMs instead of 7
    assert len(calls) == 2 * 4 and calls[0] == "q_proj+k_proj+v_proj"
    # the same products, one wider GEMM: float32 emulation on the CPU, rounding at most
    torch.testing.assert_close(got, logits(before), rtol=1e-5, atol=1e-5)


def test_weights_loaded_into_a_fused_group_land_in_its_storage() -> None:
    gen, plain = generator(), generator()
    fuse_projections(gen.model)
    group = gen.model.model.layers[1].mlp.gate_proj.fused[0]
    address = group.weight.data.data_ptr()
    trainer = NativeTrainer(SPEC, TOK.vocab_size, "cpu")
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    payload = trainer.export_weights(fp8_weight_names(gen.model))
    gen.load_weights(payload)
    plain.load_weights(payload)
    assert group.weight.data.data_ptr() == address
    up = payload["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(group.weight.data[512:].view(torch.uint8), up.data.view(torch.uint8))
    torch.testing.assert_close(logits(gen.model), logits(plain.model), rtol=1e-5, atol=1e-5)


def test_groups_that_are_not_whole_blocks_stay_separate() -> None:
    spec = parse_spec(
        {
            "model": {"tiny": {"hidden_size": 128, "intermediate_size": 256}},
            "precision": {"recipe": "fp8-e2e"},
        }
    )
    gen = NativeGenerator(spec, TOK.vocab_size, TOK.eos_id, TOK.pad_id, "cpu")
    # 4 heads of 32, 2 KV heads: k and v have 64 rows, half a block; gate/up (256 rows) fuse
    assert fuse_projections(gen.model) == 2
    assert gen.model.model.layers[0].self_attn.q_proj.fused is None


def test_a_member_asking_twice_gets_a_fresh_product() -> None:
    """The group's one GEMM is shared only among different members for the same input: the same
    member called again (its input may have changed in place) computes again."""
    gen = generator()
    fuse_projections(gen.model)
    mlp = gen.model.model.layers[0].mlp
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        first = mlp.gate_proj(x).clone()
        x.mul_(2)
        again = mlp.gate_proj(x)
        up = mlp.up_proj(x)
        plain = [
            torch.nn.functional.linear(x.float(), m.fp8_weight().dequantize())
            for m in (mlp.gate_proj, mlp.up_proj)
        ]
    assert not torch.equal(first, again)
    # FP8 activations against the float32 product of the dequantized weight: E4M3's 2^-4 step
    for got, want in zip((again, up), plain, strict=True):
        assert float((got.float() - want).norm() / want.norm()) < 0.05


def test_fused_groups_pass_cudas_checks_in_the_static_decode_loop() -> None:
    """On ``meta`` under the SM90 profile (torch's meta kernels apply CUDA's preconditions to every
    ``scaled_mm``), with the group weights, in the graph loop's static step: no call CUDA would
    refuse, and nothing read back."""
    from workers.engines.native.sampling import log_softmax
    from workers.engines.native.static_decode import StaticDecoder
    from workers.fp8 import simulate

    gen = NativeGenerator(SPEC, TOK.vocab_size, TOK.eos_id, TOK.pad_id, "meta")
    gen.model.config._attn_implementation = "sdpa"
    assert fuse_projections(gen.model) == 4
    decoder = StaticDecoder(gen.model, gen.device, False, True, log_softmax)
    ids, mask = left_pad([TOK.encode("12 + 30 = "), TOK.encode("7 + 5 = ")] * 2, TOK.pad_id)
    with simulate("sm90-cuda13.0"):
        tokens, _, logps = decoder.generate(
            ids.to("meta"), mask.to("meta"), 4, 1.0, 1.0, 0, TOK.eos_id, TOK.pad_id
        )
    assert tokens.shape == logps.shape == (4, 4) and tokens.device.type == "meta"


# -- trainers ---------------------------------------------------------------------------------


def train_loss(model: Any) -> torch.Tensor:
    ids, mask = left_pad([TOK.encode("12 + 30 = 42"), TOK.encode("7 + 5 = 12")], TOK.pad_id)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits.float()
    return out.square().mean()


def test_a_trainers_fused_groups_give_the_separate_layers_gradients_with_fewer_gemms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """q/k/v and gate/up fused in a trainer: one quantization of x and one GEMM per group in
    forward, one of dy and one dgrad and one wgrad in backward; the loss and every parameter's
    gradient are the separate layers' (float32 emulation: rounding at most), the members' FP8
    bytes their own, and after an optimizer step the group takes the members' new weights."""
    trainer = NativeTrainer(SPEC, TOK.vocab_size, "cpu")
    assert trainer.fused_groups == 0  # the CPU keeps separate layers; the test fuses by hand
    fused, plain = trainer.model, copy.deepcopy(trainer.model)
    assert fused_mod.fuse_for_training(fused) == 2 * 2
    from workers.fp8.matmul import fp8_matmul as real

    gemms: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        gemms.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("workers.fp8.linear_gemm.fp8_matmul", counting)
    losses = []
    for model in (plain, fused):
        gemms.clear()
        loss = train_loss(model)
        loss.backward()
        losses.append((float(loss.detach()), len(gemms)))
    # per decoder layer 7 GEMMs of each kind separately, 4 fused: 2 layers x 3 kinds x 3 fewer
    assert losses[0][1] >= 2 * 7 * 3 and losses[1][1] == losses[0][1] - 2 * 3 * 3
    assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-5)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        err = float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30))
        assert err < 1e-4, (name, err)
    attn = fused.model.layers[0].self_attn
    group = attn.q_proj.fused_train[0]
    assert attn.v_proj.fp8_weight().data.data_ptr() == group.fp8_weight().data[384:].data_ptr()
    own = attn.v_proj.config.quantize_weight(attn.v_proj.weight)
    assert torch.equal(attn.v_proj.fp8_weight().data.view(torch.uint8), own.data.view(torch.uint8))
    for model in (plain, fused):  # the same optimizer step on both
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        torch.testing.assert_close(logits(fused), logits(plain), rtol=1e-4, atol=1e-4)
    # what a weight sync sends: every FP8 weight the member's own quantization of its new weight
    names = fp8_weight_names(fused)
    params = dict(fused.named_parameters())
    payload = export_weights(fused, names)
    assert set(names) >= {"model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    for name in names:
        own = attn.q_proj.config.quantize_weight(params[name])
        assert torch.equal(payload[name].data.view(torch.uint8), own.data.view(torch.uint8)), name
