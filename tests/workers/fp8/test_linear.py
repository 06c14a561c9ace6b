"""Fp8Linear forward and gradients against float64, with bounds from the formats' precision.

The three GEMMs and the operands' quantization (see workers/fp8/linear.py), G the gradients'
format (E4M3 by default, E5M2 under ``fp8_format: hybrid``):
    y  = q(x; E4M3, 1x128)   @ q(W; E4M3, 128x128).T + b
    dx = q(dy; G, 1x128)     @ q(W; E4M3, 128x128)
    dW = q(dy; G, 128x1).T   @ q(x; E4M3, 128x1)
Each is bounded as in test_matmul.py: E_a @ |b| + |a| @ E_b + E_a @ E_b + gamma_{K+4} |a'| @ |b'|,
with E from reference.error_bound (u = 1/16 for E4M3, 1/8 for E5M2, plus half a subnormal step).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.workers.fp8 import reference as ref
from tests.workers.fp8.test_matmul import bound, gamma
from workers.fp8 import Fp8Linear, Fp8LinearConfig
from workers.fp8.formats import get_format
from workers.fp8.fp8_tensor import Fp8Tensor, TILE_1x128


def run_layer(
    m: int, k: int, n: int, bias: bool = True, fp8_format: str = "e4m3"
) -> tuple[Fp8Linear, torch.Tensor, torch.Tensor, torch.Tensor]:
    layer = Fp8Linear(k, n, bias=bias, config=Fp8LinearConfig.for_format(fp8_format))
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        if layer.bias is not None:
            layer.bias.normal_(0, 0.1)
    x = (torch.randn(m, k) * 2).requires_grad_(True)
    y = layer(x)
    dy = torch.randn(m, n) * 1e-3
    y.backward(dy)
    return layer, x, y, dy


@pytest.mark.parametrize("m,k,n", [(1, 16, 16), (7, 200, 48), (130, 256, 160), (64, 384, 96)])
def test_forward_within_bound(seed: int, m: int, k: int, n: int) -> None:
    layer, x, y, _ = run_layer(m, k, n)
    w = layer.weight.detach()
    expected = x.detach().double() @ w.double().t() + layer.bias.detach().double()  # type: ignore[union-attr]
    ex = ref.error_bound(x.detach(), (1, 128), "e4m3")
    ew = ref.error_bound(w, (128, 128), "e4m3").t()
    # + float32 rounding of the bias addition
    b = bound(x.detach(), ex, w.t(), ew) + 2.0**-23 * expected.abs()
    assert bool(((y.detach().double() - expected).abs() <= b).all())


@pytest.mark.parametrize("fp8_format,grad_fmt", [("e4m3", "e4m3"), ("hybrid", "e5m2")])
@pytest.mark.parametrize("m,k,n", [(1, 16, 16), (7, 200, 48), (130, 256, 160)])
def test_gradients_within_bound(seed: int, m: int, k: int, n: int, fp8_format: str, grad_fmt: str) -> None:
    layer, x, _, dy = run_layer(m, k, n, fp8_format=fp8_format)
    assert layer.config.grad_fmt == grad_fmt
    w, xd = layer.weight.detach(), x.detach()
    # dgrad
    expected_dx = dy.double() @ w.double()
    edy = ref.error_bound(dy, (1, 128), grad_fmt)
    ew = ref.error_bound(w, (128, 128), "e4m3")
    assert x.grad is not None
    assert bool(((x.grad.double() - expected_dx).abs() <= bound(dy, edy, w, ew)).all())
    # wgrad: operands tiled along tokens
    expected_dw = dy.double().t() @ xd.double()
    edy_col = ref.error_bound(dy, (128, 1), grad_fmt).t()
    ex_col = ref.error_bound(xd, (128, 1), "e4m3")
    assert layer.weight.grad is not None
    err_dw = (layer.weight.grad.double() - expected_dw).abs()
    assert bool((err_dw <= bound(dy.t(), edy_col, xd, ex_col)).all())
    # bias gradient: a float32 sum of M terms errs by at most gamma_M * sum |dy|
    assert layer.bias is not None and layer.bias.grad is not None
    err_db = (layer.bias.grad.double() - dy.double().sum(0)).abs()
    assert bool((err_db <= gamma(m) * dy.double().abs().sum(0)).all())


@pytest.mark.parametrize("fp8_format,unit", [("e4m3", 1 / 16), ("hybrid", 1 / 8)])
def test_gradients_are_fp8_not_high_precision(seed: int, fp8_format: str, unit: float) -> None:
    # The gradient quantization must be visible: exact BF16/FP32 gradients would mean the
    # backward silently ran in high precision. Its error is below the format's unit roundoff
    # (1/16 for E4M3's 3 mantissa bits, 1/8 for E5M2's 2).
    layer, x, _, dy = run_layer(64, 256, 128, fp8_format=fp8_format)
    exact_dx = dy.double() @ layer.weight.detach().double()
    assert x.grad is not None
    rel = float((x.grad.double() - exact_dx).norm() / exact_dx.norm())
    # over 20 seeds: rel 0.036-0.037 (e4m3, 0.58-0.60 of the bound), 0.056-0.059 (hybrid, 0.45-0.47)
    assert 1e-3 < rel < unit


def test_master_weights_stay_high_precision_and_fp8_copy_is_made_once_per_step(seed: int) -> None:
    layer = Fp8Linear(128, 64)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(3):
        for _micro in range(4):  # micro-batches of one step share the FP8 copy
            layer(torch.randn(8, 128)).square().mean().backward()
        assert layer.fp8_weight_updates == step + 1
        assert layer.weight.dtype == torch.float32 and layer.weight.grad is not None
        assert layer.weight.grad.dtype == torch.float32
        before = layer.weight.detach().clone()
        opt.step()
        opt.zero_grad()
        assert not torch.equal(before, layer.weight.detach())
    layer(torch.randn(2, 128))
    assert layer.fp8_weight_updates == 4


def test_from_linear_shares_parameters_and_handles_3d_input(seed: int) -> None:
    lin = nn.Linear(128, 48)
    fp8 = Fp8Linear.from_linear(lin)
    assert fp8.weight is lin.weight and fp8.bias is lin.bias
    x = torch.randn(2, 5, 128)
    y = fp8(x)
    assert y.shape == (2, 5, 48)
    ref_y = lin(x).detach().double()
    # over 20 seeds: 0.032-0.039, a third of the bound
    assert float((y.detach().double() - ref_y).norm() / ref_y.norm()) < 1 / 8


def test_bf16_master_weights(seed: int) -> None:
    layer = Fp8Linear(128, 32, dtype=torch.bfloat16)
    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad is not None and x.grad.dtype == torch.bfloat16
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.bfloat16


def test_tensorwise_config_and_power_of_two(seed: int) -> None:
    cfg = Fp8LinearConfig(weight_block=None, activation_block=None, grad_block=None, power_of_two_scales=True)
    layer = Fp8Linear(64, 32, config=cfg)
    x = torch.randn(8, 64, requires_grad=True)
    layer(x).sum().backward()
    w_q = layer.fp8_weight()
    assert w_q.block is None and float(torch.log2(w_q.scale)) == round(float(torch.log2(w_q.scale)))
    expected = x.detach().double() @ layer.weight.detach().double().t()
    got = layer(x).detach().double() - layer.bias.detach().double()  # type: ignore[union-attr]
    # over 20 seeds: 0.032-0.040, a third of the bound
    assert float((got - expected).norm() / expected.norm()) < 1 / 8


def test_nan_input_raises() -> None:
    layer = Fp8Linear(128, 16)
    x = torch.randn(3, 128)
    x[1, 5] = float("nan")
    with pytest.raises(ValueError, match=r"first at index \(1, 5\)"):
        layer(x)


def test_inference_quantizes_activations_once(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Under no_grad (generation) only the 1x128 activation copy is made: no wgrad copy of x.T.
    # Counted where every CPU quantization checks its input for NaN/inf, once per tensor made
    # (quantize_dual makes x's two layouts in one pass, but checks each).
    from workers.fp8.guard import check_input as real

    calls: list[tuple[tuple[int, ...], tuple[int, int] | None]] = []

    def counting(x: torch.Tensor, amax: torch.Tensor, block: tuple[int, int] | None, where: str) -> None:
        calls.append((tuple(x.shape), block))
        real(x, amax, block, where)

    layer = Fp8Linear(128, 16)
    layer.fp8_weight()
    monkeypatch.setattr("workers.fp8.quant.check_input", counting)
    with torch.no_grad():
        y = layer(torch.randn(3, 128))
    assert calls == [((3, 128), (1, 128))] and y.requires_grad is False
    calls.clear()
    x = torch.randn(3, 128, requires_grad=True)
    layer(x).sum().backward()  # training: x and x.T (wgrad) in the forward; dy and dy.T after
    tile = (1, 128)  # x.T and dy.T are tiled along tokens by quantizing the transposes in 1x128
    assert calls == [((3, 128), tile), ((128, 3), tile), ((3, 16), tile), ((16, 3), tile)]


def test_autocast_does_not_turn_the_fp8_gemm_into_bf16(seed: int) -> None:
    """A BF16-autocast trainer runs Fp8Linear inside autocast: the output and gradients must be
    the ones computed outside it (float32 accumulation), not a BF16 matmul's."""
    layer = Fp8Linear(256, 128)
    x = torch.randn(32, 256)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_plain = layer(x1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_auto = layer(x2)
    assert y_auto.dtype == torch.float32 and torch.equal(y_plain, y_auto)
    y_plain.sum().backward()
    y_auto.sum().backward()
    assert x1.grad is not None and x2.grad is not None and torch.equal(x1.grad, x2.grad)


@pytest.mark.gpu
def test_cuda_forward_and_backward(seed: int) -> None:
    layer = Fp8Linear(1024, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().mean().backward()
    ref_y = x.detach().double() @ layer.weight.detach().double().t() + layer.bias.detach().double()  # type: ignore[union-attr]
    # over 20 seeds on an H100: 0.0360-0.0364 (0.58 of the bound)
    assert float((y.detach().double() - ref_y).norm() / ref_y.norm()) < 1 / 16
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def _meta_rows(rows: int, cols: int) -> Fp8Tensor:
    """An E4M3 operand in 1x128 tiles along ``cols`` as the dual quantizer writes x.T and dy.T on a
    GPU: data row-major, scales with stride 1 along the rows (meta: shapes and strides only)."""
    data = torch.empty(rows, cols, device="meta", dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-cols // 128), rows, device="meta").t()
    return Fp8Tensor(data, scale, TILE_1x128, get_format("e4m3"))


def test_the_wgrad_gemm_plans_once_per_layout_and_calls_cublas_as_fp8_matmul_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On SM90 (simulated, meta operands, the kernel recorded instead of run): the bound wgrad
    hands cuBLAS blockwise the same operands, scale layouts, recipes and output dtype as the
    general fp8_matmul (a second path to the same call), plans once for repeated layouts, and
    plans again when the token count changes."""
    from workers.fp8 import linear_gemm, simulate
    from workers.fp8.linear_gemm import WgradGemm
    from workers.fp8.matmul import fp8_matmul

    seen: list[tuple[object, ...]] = []

    def record(*args: object, **kwargs: object) -> torch.Tensor:
        def shape(v: object) -> object:
            return (tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v

        seen.append(tuple(shape(v) for v in args) + tuple(sorted((k, shape(v)) for k, v in kwargs.items())))
        a, b = args[0], args[1]
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return torch.empty(a.shape[0], b.shape[1], device="meta", dtype=torch.float32)

    from workers.fp8.matmul import plan_for

    plans = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        plans.append(1)
        return plan_for(*args, **kwargs)

    monkeypatch.setattr(linear_gemm, "plan_for", counted)
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", record)

    def general_path(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the bound wgrad went through fp8_matmul")

    monkeypatch.setattr(linear_gemm, "fp8_matmul", general_path)  # the bound path calls the kernel
    cfg = Fp8LinearConfig.for_format("e4m3")
    wgrad = WgradGemm()
    with simulate("sm90-cuda13.0"):
        for tokens in (4096, 4096, 4736):
            g_t, x_t = _meta_rows(2048, tokens), _meta_rows(8192, tokens)  # dy.T [N, M], x.T [K, M]
            seen.clear()
            general = fp8_matmul(g_t, x_t.t(), out_dtype=torch.float32)
            bound = wgrad(g_t, x_t, cfg, torch.float32)
            assert len(seen) == 2 and seen[0] == seen[1], seen
            assert bound.shape == general.shape == (2048, 8192) and bound.dtype == torch.float32
    assert len(plans) == 2  # 4096 tokens once, then 4736
