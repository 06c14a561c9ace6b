"""build_policy's CPU details: the BF16 GEMM as float32 on BF16 values, float32 RoPE frequencies,
and the trainer's BF16 compute parameters."""

from __future__ import annotations

import math

import torch
from torch import nn

from rljob.spec import parse_spec
from workers.engines.models import CpuBf16Linear, build_policy, compute_params
from workers.fp8.linear import Fp8Linear


def test_cpu_bf16_linear_is_a_bf16_gemm_within_its_rounding(seed: int) -> None:
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


def test_build_policy_swaps_linears_on_cpu_only_and_keeps_names() -> None:
    spec = parse_spec({"model": {"tiny": {"hidden_size": 64, "intermediate_size": 128}}})
    model = build_policy(spec, 259, torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is CpuBf16Linear for m in linears)
    assert all("CpuBf16" not in name for name in model.state_dict())
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
