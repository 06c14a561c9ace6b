"""build_policy's CPU details: the BF16 GEMMs (linear layers and attention) as torch's BF16 GEMM or
as float32 on BF16 values (whichever the CPU runs faster), float32 RoPE frequencies, and the
trainer's BF16 compute parameters."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from rljob.spec import parse_spec
from workers.engines.models import (
    CPU_ATTENTION,
    CpuBf16Linear,
    attention_mask_4d,
    build_policy,
    compute_params,
    cpu_attention,
)
from workers.fp8.cpu_bf16 import CPU_BF16_GEMM_ENV, cpu_bf16_gemm, detect_cpu_bf16_gemm
from workers.fp8.linear import Fp8Linear


@pytest.fixture(params=["native", "float32"])
def gemm_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each way a BF16 GEMM may run on a CPU (:func:`cpu_bf16_gemm`), forced for one test."""
    monkeypatch.setenv(CPU_BF16_GEMM_ENV, request.param)
    detect_cpu_bf16_gemm.cache_clear()
    yield request.param
    monkeypatch.undo()
    detect_cpu_bf16_gemm.cache_clear()


def test_cpu_bf16_gemm_is_forced_by_the_environment_and_refuses_other_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    try:
        monkeypatch.setenv(CPU_BF16_GEMM_ENV, "Float32")
        detect_cpu_bf16_gemm.cache_clear()
        assert cpu_bf16_gemm() == "float32"
        monkeypatch.setenv(CPU_BF16_GEMM_ENV, "amx")
        detect_cpu_bf16_gemm.cache_clear()
        with pytest.raises(ValueError, match="FP8RL_CPU_BF16_GEMM='amx': use native, float32"):
            cpu_bf16_gemm()
    finally:
        monkeypatch.undo()
        detect_cpu_bf16_gemm.cache_clear()
    assert cpu_bf16_gemm() in ("native", "float32")


def test_cpu_bf16_linear_is_a_bf16_gemm_within_its_rounding(seed: int, gemm_mode: str) -> None:
    layer = nn.Linear(200, 48).to(torch.bfloat16)
    x = torch.randn(37, 200).to(torch.bfloat16)
    native = layer(x)
    layer.__class__ = CpuBf16Linear
    out = layer(x)
    assert out.dtype == torch.bfloat16
    # float64 reference on the same BF16 values: the products are exact, the float32 sum of 200
    # terms errs by at most 200 * 2^-24 * sum |x w|, and the final rounding to BF16 by 2^-8 |y|
    w, b = layer.weight.double(), layer.bias.double()
    ref = x.double() @ w.t() + b
    bound = 2.0**-8 * ref.abs() + 201 * 2.0**-24 * (x.double().abs() @ w.abs().t() + b.abs())
    assert bool(((out.double() - ref).abs() <= bound).all())
    # a second method: torch's own BF16 GEMM agrees to within one rounding of the output each
    assert bool(((out.double() - native.double()).abs() <= 2 * bound).all())
    # float32 layers and inputs: nn.Linear's own forward, unchanged
    layer32 = nn.Linear(200, 48)
    x32 = torch.randn(3, 200)
    expected = layer32(x32)
    layer32.__class__ = CpuBf16Linear
    assert torch.equal(layer32(x32), expected)


def test_cpu_attention_is_bf16_eager_attention_within_its_rounding(seed: int, gemm_mode: str) -> None:
    """GQA (4 query heads on 2 kv heads), left padding and a causal mask, in BF16."""
    b, h, hkv, q, t, d = 3, 4, 2, 5, 7, 16
    query = torch.randn(b, h, q, d).to(torch.bfloat16)
    key, value = (torch.randn(b, hkv, t, d).to(torch.bfloat16) for _ in range(2))
    real = torch.ones(b, t, dtype=torch.long)
    real[1, :2] = 0  # row 1 is left-padded by two
    mask = attention_mask_4d(real, q, torch.bfloat16, "eager")  # [B, 1, q, T] additive
    module = nn.Module().eval()
    out, weights = cpu_attention(module, query, key, value, mask, d**-0.5)
    assert out.shape == (b, q, h, d) and out.dtype == torch.bfloat16

    # float64 reference on the same BF16 values, with the same roundings to BF16 where eager
    # attention rounds (scores, scaled scores, softmax weights), then the weighted sum
    def bf(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).double()

    k64 = key.double().repeat_interleave(h // hkv, dim=1)  # query head i reads kv head i // 2
    v64 = value.double().repeat_interleave(h // hkv, dim=1)
    scores = bf(bf(query.double() @ k64.transpose(2, 3)) * d**-0.5) + mask.double()
    w = bf(torch.softmax(scores, dim=-1))
    ref = (w @ v64).transpose(1, 2)  # [B, q, H, D]
    # each GEMM sums <= 16 exact products in float32 (error <= 17 * 2^-24 * sum |.|); scores and
    # weights may land one BF16 step apart where float32 and float64 round a tie differently, which
    # moves the output by at most 2^-8 of sum |w v| per step; the output's own rounding is 2^-8
    assert torch.equal(weights.double(), bf(weights.double()))  # weights are BF16 values
    bound = 2.0**-8 * ref.abs() + 2 * 2.0**-8 * (w.abs() @ v64.abs()).transpose(1, 2)
    assert bool(((out.double() - ref).abs() <= bound).all())
    # masked keys get no weight: padding keys and keys after the query
    assert float(weights[1, :, :, :2].abs().max()) == 0.0
    assert float(weights[0, :, 0, t - q + 1 :].abs().max()) == 0.0
    # a second method: Hugging Face's eager attention with torch's BF16 matmul agrees as closely
    from transformers.models.llama.modeling_llama import eager_attention_forward

    module.num_key_value_groups = h // hkv  # type: ignore[assignment]  # eager reads it from the layer
    hf_out, _ = eager_attention_forward(module, query, key, value, mask, d**-0.5)
    assert bool(((out.double() - hf_out.double()).abs() <= 2 * bound).all())
    # float32 inputs: the same arithmetic as Hugging Face's (no widening to do)
    q32, k32, v32 = query.float(), key.float(), value.float()
    mask32 = attention_mask_4d(real, q, torch.float32, "eager")
    out32, _ = cpu_attention(module, q32, k32, v32, mask32, d**-0.5)
    hf32, _ = eager_attention_forward(module, q32, k32, v32, mask32, d**-0.5)
    torch.testing.assert_close(out32, hf32, rtol=1e-6, atol=1e-6)


def test_a_model_called_without_a_mask_is_causal_with_cpu_attention() -> None:
    """Hugging Face builds the causal mask itself when none is passed: the same function as eager."""
    spec = parse_spec({"model": {"tiny": {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2}}})
    model = build_policy(spec, 259, torch.bfloat16)
    ids = torch.randint(0, 259, (3, 9))
    ours = model(input_ids=ids).logits
    model.config._attn_implementation = "eager"
    theirs = model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=2**-7, atol=2**-7)
    # causal: the first position's logits do not depend on what follows it
    changed = ids.clone()
    changed[:, 1:] = (changed[:, 1:] + 1) % 259
    model.config._attn_implementation = CPU_ATTENTION
    torch.testing.assert_close(model(input_ids=changed).logits[:, 0], ours[:, 0], rtol=0, atol=0)


def test_build_policy_swaps_linears_on_cpu_only_and_keeps_names() -> None:
    spec = parse_spec({"model": {"tiny": {"hidden_size": 64, "intermediate_size": 128}}})
    model = build_policy(spec, 259, torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is CpuBf16Linear for m in linears)
    assert all("CpuBf16" not in name for name in model.state_dict())
    assert model.config._attn_implementation == CPU_ATTENTION
    meta = build_policy(spec, 259, torch.bfloat16, "meta")
    assert all(type(m) is nn.Linear for m in meta.modules() if isinstance(m, nn.Linear))


def test_rope_frequencies_stay_float32_in_a_bf16_model() -> None:
    spec = parse_spec({"model": {"tiny": {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2}}})
    model = build_policy(spec, 259, torch.bfloat16)
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32
    # RoPE: 1 / 10000^(2i / d), head dim d = 16, computed here in float64
    expected = torch.tensor([1.0 / 10000 ** (2 * i / 16) for i in range(8)], dtype=torch.float64)
    assert torch.allclose(inv_freq.double(), expected, rtol=1e-6, atol=0)
    # in BF16 the largest frequency error would be up to 2^-9 relative: check we are far below
    assert float((inv_freq.double() / expected - 1).abs().max()) < 2.0**-20


def test_compute_params_cast_everything_but_fp8_weights() -> None:
    spec = parse_spec({"model": {"tiny": {"hidden_size": 128, "intermediate_size": 256}}})
    model = build_policy(spec, 259, torch.float32)
    q = model.model.layers[0].self_attn.q_proj
    model.model.layers[0].self_attn.q_proj = Fp8Linear.from_linear(q, name="q")
    params = compute_params(model)
    names = {n for n, _ in model.named_parameters()}
    assert set(params) == names - {"model.layers.0.self_attn.q_proj.weight"}
    assert all(p.dtype == torch.bfloat16 and p.requires_grad for p in params.values())
    # the cast is differentiable: a gradient reaches the float32 master parameter
    emb = dict(model.named_parameters())["model.embed_tokens.weight"]
    params["model.embed_tokens.weight"].float().sum().backward()
    assert emb.grad is not None and emb.grad.dtype == torch.float32
    assert math.isclose(float(emb.grad.sum()), emb.numel())


def test_a_random_init_model_is_built_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On meta (and a GPU) the model is created under that device, not on the host and copied;
    on the CPU nothing changes: the same weights as a from_config seeded by hand."""
    from transformers import AutoModelForCausalLM

    seen: list[torch.device] = []
    real = AutoModelForCausalLM.from_config

    def recording(config: object) -> object:
        seen.append(torch.get_default_device())
        return real(config)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", recording)
    spec = parse_spec({"model": {"tiny": {"hidden_size": 64, "intermediate_size": 128}}})
    meta = build_policy(spec, 259, torch.float32, "meta")
    cpu = build_policy(spec, 259, torch.float32, "cpu")
    on_host = build_policy(spec, 259, torch.float32, "meta", init_on_host=True)  # data-parallel trainers
    assert [d.type for d in seen] == ["meta", "cpu", "cpu"]
    assert {p.device.type for p in on_host.parameters()} == {"meta"}
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    # RoPE frequencies stay the host's float32 ones wherever the model is built
    assert meta.model.rotary_emb.inv_freq.dtype == torch.float32
    torch.manual_seed(spec.model.init_seed)
    reference = real(cpu.config)
    for (name, got), want in zip(cpu.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
