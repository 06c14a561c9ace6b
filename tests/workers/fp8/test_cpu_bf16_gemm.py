"""The FP8 GEMM in BF16 on a CPU (kernel ``emulate_bf16``, ``workers.fp8.matmul.matmul_bf16``):
when it is planned, and the bound of ``matmul_bf16``'s docstring held against a float64 product of
the dequantized operands (an independent reference), for both ways this CPU may run a BF16 GEMM.
The bound is not vacuous: the same GEMM on operands whose scales are not powers of two (so their
BF16 copies are rounded) breaks it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from workers.fp8.cpu_bf16 import CPU_BF16_GEMM_ENV, detect_cpu_bf16_gemm
from workers.fp8.dispatch import CPU, OperandSpec, parse_profile, plan_gemm
from workers.fp8.formats import get_format
from workers.fp8.fp8_tensor import BLOCK_128x128, Fp8Tensor, TILE_1x128
from workers.fp8.linear import Fp8Linear
from workers.fp8.linear_config import Fp8LinearConfig
from workers.fp8.matmul import fp8_matmul, matmul_bf16, matmul_emulated
from workers.fp8.quant import quantize

U = 2.0**-24


@pytest.fixture(params=["native", "float32"])
def gemm_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv(CPU_BF16_GEMM_ENV, request.param)
    detect_cpu_bf16_gemm.cache_clear()
    yield str(request.param)
    detect_cpu_bf16_gemm.cache_clear()


def operands(
    m: int, k: int, n: int, pow2: bool, seed: int = 0, fmt: str = "e4m3"
) -> tuple[Fp8Tensor, Fp8Tensor]:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over several binades, and signs, so sums cancel
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-4, 4, (m, k), generator=g).float())
    w = torch.randn(k, n, generator=g) * 0.05
    a = quantize(x, fmt, TILE_1x128, power_of_two=pow2)
    b = quantize(w.t().contiguous(), "e4m3", BLOCK_128x128, power_of_two=pow2).t()
    return a, b


def bound(a: Fp8Tensor, b: Fp8Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``s = a @ b`` of the dequantized operands and the docstring's bound for each entry."""
    ad, bd = a.dequantize().double(), b.dequantize().double()
    s = ad @ bd
    k = ad.shape[1]
    g = k * U / (1 - k * U)
    return s, 2.0**-8 * s.abs() + 2 * g * (ad.abs() @ bd.abs())


@pytest.mark.parametrize("shape", [(64, 576, 1536), (37, 1536, 576), (16, 200, 96)])
def test_bf16_gemm_of_power_of_two_scales_is_within_the_bound(
    gemm_mode: str, shape: tuple[int, int, int]
) -> None:
    a, b = operands(*shape, pow2=True)
    out = matmul_bf16(a, b)
    assert out.dtype == torch.bfloat16
    s, tol = bound(a, b)
    err = (out.double() - s).abs()
    assert bool((err <= tol).all()), float((err - tol).max())
    # and the float32 reference, the other kernel, within twice the bound of it
    ref = matmul_emulated(a, b).double()
    assert bool(((out.double() - ref).abs() <= 2 * tol).all())


def test_the_bound_is_not_vacuous_without_power_of_two_scales(gemm_mode: str) -> None:
    a, b = operands(64, 1536, 576, pow2=False)
    out = matmul_bf16(a, b)  # misused: these operands are rounded on their way to BF16
    s, tol = bound(a, b)
    assert bool(((out.double() - s).abs() > tol).any())


def test_e5m2_gradients_are_exact_in_bf16_too(gemm_mode: str) -> None:
    a, b = operands(48, 384, 256, pow2=True, fmt="e5m2")
    s, tol = bound(a, b)
    assert bool(((matmul_bf16(a, b).double() - s).abs() <= tol).all())


def test_the_plan_takes_bf16_only_for_power_of_two_scales_on_a_cpu() -> None:
    e4m3 = get_format("e4m3")
    a = OperandSpec((16, 576), TILE_1x128, e4m3)
    b = OperandSpec((576, 1536), (128, 128), e4m3)
    assert plan_gemm(a, b, CPU, bf16_exact=True).kernel == "emulate_bf16"
    assert plan_gemm(a, b, CPU).kernel == "emulate"
    assert (
        plan_gemm(a, b, CPU, backend="emulate", bf16_exact=True).kernel == "emulate"
    )  # the reference, asked for
    assert plan_gemm(a, b, CPU, bf16_exact=True).out_dtype == torch.bfloat16
    # a GPU keeps its FP8 kernels
    assert plan_gemm(a, b, parse_profile("sm90-cuda13.0"), bf16_exact=True).kernel == "cublas_blockwise"
    cfg = Fp8LinearConfig(power_of_two_scales=True)
    assert cfg.bf16_exact and not Fp8LinearConfig().bf16_exact
    assert not Fp8LinearConfig(power_of_two_scales=True, rows_multiple=16).bf16_exact  # precision.exact


def test_fp8_matmul_follows_the_plan(gemm_mode: str) -> None:
    a, b = operands(32, 256, 128, pow2=True)
    assert torch.equal(fp8_matmul(a, b, bf16_exact=True), matmul_bf16(a, b).float())
    assert torch.equal(fp8_matmul(a, b), matmul_emulated(a, b))


def test_an_fp8_linear_with_power_of_two_scales_trains_in_bf16(gemm_mode: str) -> None:
    """fprop, dgrad and wgrad of one layer all run the BF16 kernel (its plans say so) and agree
    with the same layer forced onto the float32 reference: the same FP8 operands, so the results
    differ by BF16 roundings and the order of float32 sums only (the elementwise bound is held
    above, on the GEMM itself); a wrong layout or scale would be off by far more."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 384, bias=False)
    layer = Fp8Linear.from_linear(lin, Fp8LinearConfig(power_of_two_scales=True), name="l")
    assert {p.kernel for p in layer.gemm_plans().values()} == {"emulate_bf16"}
    cfg = Fp8LinearConfig(power_of_two_scales=True, backend="emulate")
    reference = Fp8Linear.from_linear(lin, cfg, name="r")
    assert {p.kernel for p in reference.gemm_plans().values()} == {"emulate"}
    x = torch.randn(48, 256, dtype=torch.bfloat16)
    dy = torch.randn(48, 384, dtype=torch.bfloat16)
    outs = []
    for mod in (layer, reference):
        xi = x.clone().requires_grad_(True)
        y = mod(xi)
        y.backward(dy)
        outs.append([y.detach(), xi.grad, next(mod.parameters()).grad])
    for got, want in zip(outs[0], outs[1], strict=True):
        assert got is not None and want is not None
        w = want.double()
        torch.testing.assert_close(got.double(), w, rtol=2.0**-7, atol=2.0**-7 * float(w.abs().max()))
