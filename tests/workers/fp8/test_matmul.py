"""fp8_matmul against float64, a hand-worked example, and the two CPU backends against each other.

Error bound used throughout (derived, not measured). Let E_a, E_b be the per-element quantization
error bounds of the operands (reference.error_bound: u|x| in the normal range, half a subnormal
step below it). Then for every output element

    |deq(a) @ deq(b) - a @ b| <= E_a @ |b| + |a| @ E_b + E_a @ E_b            (quantization)
                               + gamma_{K+4} * |deq(a)| @ |deq(b)|          (float32 accumulation)

with gamma_n = n * 2^-24 / (1 - n * 2^-24): a float32 sum of n rounded terms (the +4 covers the
rounded products and the per-chunk scale multiplications of the chunked backend).
"""

from __future__ import annotations

import pytest
import torch

from tests.workers.fp8 import reference as ref
from workers.fp8 import fp8_matmul, matmul_emulated, matmul_scaled_mm, plan_for, quantize
from workers.fp8.matmul import blockwise_scales_for_cublas, chunk_size

SHAPES = [(1, 1, 1), (3, 200, 70), (16, 128, 16), (130, 257, 129), (64, 384, 96), (5, 576, 200)]


def gamma(n: int) -> float:
    return n * 2.0**-24 / (1 - n * 2.0**-24)


def bound(
    a: torch.Tensor,
    ea: torch.Tensor,
    b: torch.Tensor,
    eb: torch.Tensor,
) -> torch.Tensor:
    a, b = a.double().abs(), b.double().abs()
    k = a.shape[1]
    return ea @ b + a @ eb + ea @ eb + gamma(k + 4) * ((a + ea) @ (b + eb))


def operands(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation-like x [M, K] and weight w [N, K]."""
    return torch.randn(m, k) * 2, torch.randn(n, k) * 0.05


@pytest.mark.parametrize("backend", ["emulate", "scaled_mm", "auto"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_blockwise_1x128_by_128x128_within_bound(seed: int, backend: str, m: int, k: int, n: int) -> None:
    x, w = operands(m, k, n)
    xq = quantize(x, "e4m3", (1, 128))
    wq = quantize(w, "e4m3", (128, 128))
    out = fp8_matmul(xq, wq.t(), backend=backend)  # type: ignore[arg-type]
    assert out.dtype == torch.float32 and out.shape == (m, n)
    expected = x.double() @ w.double().t()
    ex = ref.error_bound(x, (1, 128), "e4m3")
    ew = ref.error_bound(w, (128, 128), "e4m3").t()
    err = (out.double() - expected).abs()
    assert bool((err <= bound(x, ex, w.t(), ew)).all())


@pytest.mark.parametrize("m,k,n", [(3, 200, 70), (130, 257, 129), (200, 576, 192)])
def test_wgrad_layout_128x1_operands_within_bound(seed: int, m: int, k: int, n: int) -> None:
    # dW = dy^T @ x contracts over tokens: both operands tiled 128 x 1 along M.
    dy = torch.randn(m, n) * 1e-3
    x = torch.randn(m, k)
    dyq = quantize(dy, "e5m2", (128, 1))
    xq = quantize(x, "e4m3", (128, 1))
    out = fp8_matmul(dyq.t(), xq)
    expected = dy.double().t() @ x.double()
    edy = ref.error_bound(dy, (128, 1), "e5m2").t()
    ex = ref.error_bound(x, (128, 1), "e4m3")
    assert bool(((out.double() - expected).abs() <= bound(dy.t(), edy, x, ex)).all())


def pow2_reference(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """E4M3 with power-of-two block scales, dequantized, in float64 from reference.py alone: the
    scale is the smallest power of two >= amax / 448 of the block, so x / s is exact."""
    s = torch.pow(2.0, torch.ceil(torch.log2(ref.block_scales(x, block, "e4m3"))))
    s = ref.expand(s, block, x.shape)
    return ref.round_to_fp8(x.double() / s, "e4m3") * s


@pytest.mark.parametrize("backend", ["emulate", "scaled_mm", "auto"])
@pytest.mark.parametrize("m,k,n", [(3, 576, 200), (17, 200, 576), (33, 576, 1536)])
def test_partial_blocks_match_a_float64_dequantized_reference(
    seed: int, backend: str, m: int, k: int, n: int
) -> None:
    # K = 576 is 4.5 blocks of 128 and 200 is 1.56: the last 1x128 tile of each row of x and the
    # last 128x128 blocks of w (along K and along N) are partial. With power-of-two scales both
    # quantizations are exact functions of the data, so the GEMM must equal the float64 product
    # of the reference's dequantized operands up to float32 accumulation (gamma_{K+4}).
    x, w = operands(m, k, n)
    x[:, -1] *= 30  # the partial tiles hold each row's amax
    xq = quantize(x, "e4m3", (1, 128), power_of_two=True)
    wq = quantize(w, "e4m3", (128, 128), power_of_two=True)
    assert tuple(xq.scale.shape) == (m, -(-k // 128)) and tuple(wq.scale.shape) == (
        -(-n // 128),
        -(-k // 128),
    )
    x_ref, w_ref = pow2_reference(x, (1, 128)), pow2_reference(w, (128, 128))
    assert torch.equal(xq.dequantize().double(), x_ref) and torch.equal(wq.dequantize().double(), w_ref)
    out = fp8_matmul(xq, wq.t(), backend=backend).double()  # type: ignore[arg-type]
    expected = x_ref @ w_ref.t()
    assert bool(((out - expected).abs() <= gamma(k + 4) * (x_ref.abs() @ w_ref.abs().t())).all())


def test_hand_worked_two_tile_example() -> None:
    # a = [1 x 128 ones | 128 x 1024]: its two 1x128 tiles get power-of-two scales 2^-8 and 4,
    # so both tiles quantize exactly (1 -> 256 * 2^-8, 1024 -> 256 * 4). b = 0.5 everywhere,
    # exact in E4M3. a @ b = 128 * 1 * 0.5 + 128 * 1024 * 0.5 = 64 + 65536 = 65600.
    a = torch.cat([torch.ones(1, 128), torch.full((1, 128), 1024.0)], dim=1)
    b = torch.full((256, 1), 0.5)
    aq = quantize(a, "e4m3", (1, 128), power_of_two=True)
    assert aq.scale.tolist() == [[2.0**-8, 4.0]]
    bq = quantize(b, "e4m3", (128, 128), power_of_two=True)
    for backend in ("emulate", "scaled_mm"):
        assert fp8_matmul(aq, bq, backend=backend).item() == 65600.0


@pytest.mark.parametrize(
    "blocks", [(None, None), ((1, 128), (128, 128)), ((1, 64), (128, 128)), ((1, 128), None)]
)
@pytest.mark.parametrize("m,k,n", [(5, 300, 40), (33, 128, 17)])
def test_cpu_scaled_mm_and_emulation_agree(
    seed: int, blocks: tuple[tuple[int, int] | None, tuple[int, int] | None], m: int, k: int, n: int
) -> None:
    # Both compute deq(a) @ deq(b) in float32; each is within gamma_{K+4} of the exact value.
    x, w = operands(m, k, n)
    xq = quantize(x, "e4m3", blocks[0])
    wq = quantize(w, "e4m3", blocks[1])
    emulated = matmul_emulated(xq, wq.t()).double()
    chunked = matmul_scaled_mm(xq, wq.t()).double()
    scale = xq.dequantize().double().abs() @ wq.t().dequantize().double().abs()
    assert bool(((emulated - chunked).abs() <= 2 * gamma(k + 4) * scale).all())


def test_e5m2_times_e4m3(seed: int) -> None:
    g = torch.randn(40, 256) * 1e-4
    w = torch.randn(256, 64)
    gq, wq = quantize(g, "e5m2", (1, 128)), quantize(w, "e4m3", (128, 128))
    expected = g.double() @ w.double()
    eg, ew = ref.error_bound(g, (1, 128), "e5m2"), ref.error_bound(w, (128, 128), "e4m3")
    for backend in ("emulate", "scaled_mm"):
        out = fp8_matmul(gq, wq, backend=backend).double()
        assert bool(((out - expected).abs() <= bound(g, eg, w, ew)).all())


def test_out_dtype_and_backend_choice() -> None:
    xq = quantize(torch.randn(4, 128), "e4m3", (1, 128))
    wq = quantize(torch.randn(16, 128), "e4m3", (128, 128))
    assert fp8_matmul(xq, wq.t(), out_dtype=torch.bfloat16).dtype == torch.bfloat16
    assert plan_for(xq, wq.t()).kernel == "emulate"  # CPU default
    with pytest.raises(ValueError, match="backend"):
        plan_for(xq, wq.t(), "cutlass")


def test_mismatched_operands_raise() -> None:
    a = quantize(torch.randn(4, 128), "e4m3", (1, 128))
    with pytest.raises(ValueError, match="do not agree on K"):
        fp8_matmul(a, quantize(torch.randn(64, 8), "e4m3"))
    with pytest.raises(ValueError, match="do not nest"):
        fp8_matmul(
            quantize(torch.randn(4, 300), "e4m3", (1, 96)), quantize(torch.randn(300, 8), "e4m3", (128, 128))
        )
    with pytest.raises(ValueError, match="2-D"):
        fp8_matmul(quantize(torch.randn(2, 4, 128), "e4m3"), quantize(torch.randn(128, 8), "e4m3"))


def test_chunk_size_rules() -> None:
    a = quantize(torch.randn(4, 512), "e4m3", (1, 128))
    assert chunk_size(a, quantize(torch.randn(512, 8), "e4m3", (128, 128))) == 128
    assert chunk_size(a, quantize(torch.randn(512, 8), "e4m3", (256, 128))) == 128
    assert chunk_size(a, quantize(torch.randn(512, 8), "e4m3")) == 128
    assert chunk_size(quantize(torch.randn(4, 512), "e4m3"), quantize(torch.randn(512, 8), "e4m3")) == 512


def test_cublas_blockwise_scale_layouts() -> None:
    # cuBLAS (SM90) wants 1x128 scales outer-dim-major and 128x128 scales as [K/128 padded to a
    # multiple of 4, N/128] with a contiguous transpose. Checked here on CPU; used on GPUs.
    m, k, n = 256, 640, 384  # K/128 = 5 -> padded to 8
    xq = quantize(torch.randn(m, k), "e4m3", (1, 128))
    wq = quantize(torch.randn(n, k), "e4m3", (128, 128))
    sa, sb = blockwise_scales_for_cublas(xq, wq.t())
    assert sa.shape == (m, 5) and sa.stride() == (1, m) and torch.equal(sa, xq.scale)
    assert sb.shape == (8, 3) and sb.t().is_contiguous()
    assert torch.equal(sb[:5], wq.scale.t()) and bool((sb[5:] == 0).all())
    # K = 576: 4.5 blocks, so 5 scales per row, the last for a half block (the operand is
    # zero-padded to 640 for the kernel); N = 1536 = 12 blocks
    xq = quantize(torch.randn(m, 576), "e4m3", (1, 128))
    wq = quantize(torch.randn(1536, 576), "e4m3", (128, 128))
    sa, sb = blockwise_scales_for_cublas(xq, wq.t())
    assert sa.shape == (m, 5) and torch.equal(sa, xq.scale)
    assert sb.shape == (8, 12) and torch.equal(sb[:5], wq.scale.t()) and bool((sb[5:] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(256, 512, 384), (64, 4096, 1024), (33, 300, 70)])
def test_cuda_matches_emulation(seed: int, m: int, k: int, n: int) -> None:
    x, w = operands(m, k, n)
    xq = quantize(x.cuda(), "e4m3", (1, 128))
    wq = quantize(w.cuda(), "e4m3", (128, 128))
    out = fp8_matmul(xq, wq.t()).double().cpu()
    emulated = matmul_emulated(xq.to("cpu"), wq.t().to("cpu")).double()
    # FP8 tensor cores keep ~14 bits of each partial sum (not float32): see test_gpu_data_plane.py.
    # Over 20 seeds on an H100: 1.26e-4-1.29e-4 (3.1e-7-3.4e-7 for 33x300x70), margin 7.8
    assert float((out - emulated).norm() / emulated.norm()) < 1e-3
