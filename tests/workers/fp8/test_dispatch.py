"""The GEMM dispatch: device profiles, and the kernel of each GEMM on each, by hand.

The expected table is written from the rules in ``workers/fp8/dispatch.py``'s docstring (torch's
CUDA sources, and the kernel probe ``make gpu-check`` ran on an H100), not from the code.
"""

from __future__ import annotations

import pytest
import torch

from workers.fp8 import PROFILES, Fp8Linear, Fp8LinearConfig, parse_profile, plan_gemm, simulate
from workers.fp8.dispatch import CPU, OperandSpec
from workers.fp8.formats import E4M3, E5M2

E = "emulate"
B = "cublas_blockwise"
R = "scaled_mm_rowwise"
T = "scaled_mm_tensorwise"

HYBRID = Fp8LinearConfig.for_format("hybrid")  # E4M3 forward, E5M2 gradients, 1x128 / 128x128
ALL_E4M3 = Fp8LinearConfig()  # the default: E4M3 everywhere
TENSORWISE = Fp8LinearConfig(weight_block=None, activation_block=None, grad_block=None)

# profile -> config -> (fprop, dgrad, wgrad) for a 4096 -> 14336 layer
EXPECTED = {
    "cpu": {"hybrid": (E, E, E), "e4m3": (E, E, E), "tensorwise": (E, E, E)},
    "sm80-cuda12.8": {"hybrid": (E, E, E), "e4m3": (E, E, E), "tensorwise": (E, E, E)},
    "sm89-cuda12.8": {"hybrid": (E, E, E), "e4m3": (E, E, E), "tensorwise": (T, T, T)},
    "sm90-cuda12.4": {"hybrid": (E, E, E), "e4m3": (E, E, E), "tensorwise": (T, T, T)},
    "sm90-cuda12.9": {"hybrid": (B, R, R), "e4m3": (B, B, B), "tensorwise": (T, T, T)},
    "sm90-cuda13.0": {"hybrid": (B, R, R), "e4m3": (B, B, B), "tensorwise": (T, T, T)},
    "sm100-cuda12.9": {"hybrid": (E, E, E), "e4m3": (E, E, E), "tensorwise": (T, T, T)},
    "sm120-cuda12.9": {"hybrid": (E, E, E), "e4m3": (E, E, E), "tensorwise": (T, T, T)},
}
CONFIGS = {"hybrid": HYBRID, "e4m3": ALL_E4M3, "tensorwise": TENSORWISE}


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_kernel_of_each_gemm_on_each_profile(profile: str, config: str) -> None:
    layer = Fp8Linear(4096, 14336, bias=False, device="meta", config=CONFIGS[config])
    with simulate(profile):
        plans = layer.gemm_plans(tokens=4096)
    assert tuple(plans[g].kernel for g in ("fprop", "dgrad", "wgrad")) == EXPECTED[profile][config]
    assert all(p.reason for p in plans.values())  # every choice says why


def test_the_plan_never_depends_on_the_token_count() -> None:
    layer = Fp8Linear(2048, 8192, bias=False, device="meta")
    with simulate("sm90-cuda13.0"):
        plans = [layer.gemm_plans(tokens=m) for m in (1, 7, 64, 130, 4096)]
    assert all(p == plans[0] for p in plans)


def test_reasons_say_what_is_missing() -> None:
    a = OperandSpec((64, 4096), (1, 128), E4M3)
    b = OperandSpec((4096, 14336), (128, 128), E4M3)
    assert "SM89+" in plan_gemm(a, b, PROFILES["sm80-cuda12.8"]).reason
    assert "CUDA >= 12.9" in plan_gemm(a, b, PROFILES["sm90-cuda12.4"]).reason
    assert "SM90 only" in plan_gemm(a, b, PROFILES["sm100-cuda12.9"]).reason
    odd = OperandSpec((4096, 200), (128, 128), E4M3)
    assert "multiple of 16" in plan_gemm(a, odd, PROFILES["sm90-cuda13.0"]).reason
    e5 = OperandSpec((64, 4096), None, E5M2)
    e5b = OperandSpec((4096, 128), None, E5M2)
    assert "E5M2 x E5M2" in plan_gemm(e5, e5b, PROFILES["sm90-cuda13.0"]).reason
    cpu = plan_gemm(a, b, CPU)
    assert cpu.kernel == E and "CPU" in cpu.reason
    assert plan_gemm(a, b, CPU, backend="scaled_mm").kernel == R  # forced: torch's CPU kernel


def test_blockwise_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    a = OperandSpec((64, 4096), (1, 128), E4M3)
    b = OperandSpec((4096, 14336), (128, 128), E4M3)
    monkeypatch.setenv("FP8RL_CUBLAS_BLOCKWISE", "0")
    plan = plan_gemm(a, b, PROFILES["sm90-cuda13.0"])
    assert plan.kernel == R and "FP8RL_CUBLAS_BLOCKWISE=0" in plan.reason


def test_blockwise_writes_what_is_asked() -> None:
    a = OperandSpec((64, 4096), (1, 128), E4M3)
    b = OperandSpec((4096, 14336), (128, 128), E4M3)
    for dtype in (torch.bfloat16, torch.float32):
        assert plan_gemm(a, b, PROFILES["sm90-cuda13.0"], out_dtype=dtype).out_dtype == dtype


@pytest.mark.parametrize(
    "text,cap,cuda",
    [("sm90-cuda12.9", (9, 0), (12, 9)), ("SM89", (8, 9), (13, 0)), ("sm100/cuda12.9", (10, 0), (12, 9))],
)
def test_parse_profile(text: str, cap: tuple[int, int], cuda: tuple[int, int]) -> None:
    p = parse_profile(text)
    assert p.capability == cap and p.cuda == cuda
    assert parse_profile("cpu") is CPU


def test_parse_profile_says_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=r"smXY\[-cudaA.B\].*sm90-cuda12.9"):
        parse_profile("h100")


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_audit_shows_the_kernels_formats_and_why(fp8_format: str) -> None:
    from workers.fp8 import convert_model

    model = torch.nn.Sequential()
    model.add_module("layers", torch.nn.ModuleList([torch.nn.Linear(256, 384)]))
    with simulate("sm90-cuda13.0"):
        audit = convert_model(model, "fp8-e2e", config=Fp8LinearConfig.for_format(fp8_format))
    text = audit.format()
    assert "SM90 (CUDA 13.0)" in text
    if fp8_format == "e4m3":  # E4M3 everywhere: cuBLAS blockwise on all three GEMMs
        assert "blockwise/blockwise/blockwise" in text and "E4M3 gradients (1x128 tiles)" in text
        assert audit.rows[0].kernels == {"fprop": B, "dgrad": B, "wgrad": B}
    else:  # E5M2 gradients: no blockwise kernel takes them
        assert "blockwise/rowwise/rowwise" in text and "E5M2 gradients (1x128 tiles)" in text
        assert "dgrad: scaled_mm_rowwise: rowwise per 128-long K-chunk" in text
        assert audit.rows[0].kernels == {"fprop": B, "dgrad": R, "wgrad": R}


def test_bench_fp8_prints_the_plan_for_a_profile() -> None:
    from typer.testing import CliRunner

    from fp8rl.cli import app

    out = CliRunner().invoke(app, ["bench", "fp8", "--profile", "sm89-cuda12.8", "--shapes", "64x4096x14336"])
    assert out.exit_code == 0, out.output
    assert "SM89 (CUDA 12.8)" in out.output and "writes BF16 only" in out.output
    bad = CliRunner().invoke(app, ["bench", "fp8", "--profile", "a100"])
    assert bad.exit_code == 2 and "smXY" in bad.output
