"""The kernel microbenchmark (bench/kernels.py): what each row means, on the CPU (the GPU runs it
in ``make gpu-check``)."""

from __future__ import annotations

import pytest
import torch

from bench import kernels


def test_rates_are_computed_from_the_bytes_and_flops_by_hand() -> None:
    q = kernels.KernelRow(128, 256, 512, "quantize", us=10.0)
    # BF16 in (2 bytes), E4M3 out (1 byte), one float32 scale per 128 elements: 99,328 bytes
    assert q.quantizer_gbs == pytest.approx((128 * 256 * 3 + 128 * 2 * 4) / 10e-6 / 1e9)
    assert q.tflops is None
    mm = kernels.KernelRow(128, 256, 512, "bf16", us=10.0)
    assert mm.tflops == pytest.approx(2 * 128 * 256 * 512 / 10e-6 / 1e12) and mm.quantizer_gbs is None
    assert kernels.KernelRow(1, 256, 512, "bf16", us=None).tflops is None
    # the dual quantizer: BF16 in once, two E4M3 layouts and their scales out: 133,120 bytes
    dual = kernels.KernelRow(128, 256, 512, "quantize_dual", us=10.0)
    assert dual.quantizer_gbs == pytest.approx((128 * 256 * 2 + 2 * (128 * 256 + 256 * 4)) / 10e-6 / 1e9)
    assert dual.tflops is None
    # the split pass writes the same two layouts: the same bytes to move, whatever it reads twice
    split = kernels.KernelRow(128, 256, 512, "quantize_dual_split", us=10.0)
    assert split.quantizer_gbs == dual.quantizer_gbs


@pytest.mark.slow
def test_every_kind_gets_a_row_and_refusals_say_why() -> None:
    rows = kernels.run("cpu", tokens=(1, 128), shapes=((256, 256),), replays=1)
    got = {(r.tokens, r.kind): r for r in rows}
    assert set(got) == {(m, k) for m in (1, 128) for k in kernels.KINDS}
    assert got[(1, "wgrad")].us is None and "multiple of 128" in got[(1, "wgrad")].note
    for kind in ("bf16", "rowwise", "tensorwise", "quantize", "quantize_dual", "quantize_dual_pow2"):
        assert all((got[(m, kind)].us or 0.0) > 0 for m in (1, 128))
    # the dual Triton kernel's other transpose and the split pass exist on CUDA only: refused here, saying so
    for kind in ("quantize_dual_f32t", "quantize_dual_split"):
        assert got[(128, kind)].note == "refused: ValueError: the dual-layout Triton kernel runs on CUDA only"
    assert got[(1, "wgrad_triton")].note == "refused: ValueError: the Triton wgrad GEMM runs on CUDA only"
    assert got[(1, "silu_mul")].note == "refused: ValueError: the fused SiLU*mul kernel runs on CUDA only"
    assert all((got[(m, "silu_mul_torch")].us or 0.0) > 0 for m in (1, 128))
    # cuBLAS's blockwise scaling exists on CUDA only: refused here, with torch's message
    assert got[(128, "blockwise")].us is None and got[(128, "blockwise")].note.startswith("refused: ")
    table = kernels.format_table(rows)
    assert table.splitlines()[1].split()[:3] == ["256", "256", "1"]
    assert "blockwise: refused: " in table


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="kind 'int4'"):
        kernels._calls("int4", 16, 128, 128, torch.device("cpu"))


def test_the_small_m_gemm_is_compared_with_quantize_plus_blockwise_and_kept_to_few_tokens() -> None:
    row = {
        "blockwise": kernels.KernelRow(16, 256, 256, "blockwise", us=10.0),
        "quantize": kernels.KernelRow(16, 256, 256, "quantize", us=2.0),
        "small_m": kernels.KernelRow(16, 256, 256, "small_m", us=6.0),
    }
    assert kernels._small_m_ratio(row) == "2.00x"  # (10 + 2) / 6, by hand
    assert kernels._small_m_ratio({**row, "small_m": kernels.KernelRow(16, 256, 256, "small_m", None)}) == "-"
    rows = kernels.run("cpu", tokens=(128,), shapes=((256, 256),), kinds=("small_m",), replays=1)
    assert rows[0].us is None and rows[0].note == "M over 64"


def test_weight_quantization_times_both_ways_on_the_tiny_preset() -> None:
    text = kernels.weight_quantization("tiny", "cpu", repeats=1)
    head, times = text.splitlines()
    assert head.startswith("tiny: 14 FP8 weights") and head.endswith("cpu")  # 2 layers x 7 linears
    parts = times.split()
    each, batched, ratio = float(parts[2]), float(parts[5]), float(parts[-1].rstrip("x"))
    assert each > 0 and batched > 0 and ratio == pytest.approx(each / batched, abs=0.01)


def test_the_triton_wgrad_gemm_is_compared_with_bf16_and_cublas_wgrad() -> None:
    row = {
        "bf16": kernels.KernelRow(4096, 256, 256, "bf16", us=9.0),
        "wgrad": kernels.KernelRow(4096, 256, 256, "wgrad", us=7.5),
        "wgrad_triton": kernels.KernelRow(4096, 256, 256, "wgrad_triton", us=6.0),
    }
    assert kernels._wgrad_ratios(row) == "1.50x 1.25x"  # 9 / 6 and 7.5 / 6, by hand
    assert (
        kernels._wgrad_ratios({**row, "wgrad": kernels.KernelRow(4096, 256, 256, "wgrad", None)}) == "1.50x -"
    )
    assert kernels._wgrad_ratios({"bf16": row["bf16"]}) == "-"


def test_the_fused_silu_mul_is_compared_with_torchs_activation_path() -> None:
    row = {
        "silu_mul_torch": kernels.KernelRow(64, 14336, 4096, "silu_mul_torch", us=12.0),
        "silu_mul": kernels.KernelRow(64, 14336, 4096, "silu_mul", us=5.0),
    }
    assert kernels._silu_ratio(row) == "2.40x"  # 12 / 5, by hand
    assert kernels._silu_ratio({"silu_mul_torch": row["silu_mul_torch"]}) == "-"
