"""``fp8rl bench decode-attention`` (bench/decode_attention.py): its columns worked by hand, and a
run of the real kernel under Triton's interpreter (the GPU session runs it on CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import decode_attention as bda

ROOT = Path(__file__).resolve().parents[2]


def test_per_head_errors_and_rates_by_hand() -> None:
    ref = torch.zeros(2, 3, 4, dtype=torch.float64)
    out = torch.zeros(2, 3, 4)
    out[1, 0, 2] = 0.5  # head 0's worst
    out[0, 2, 3] = -0.25  # head 2's
    assert bda.per_head_max_err(out, ref) == [0.5, 0.0, 0.25]
    row = bda.Row(
        (1, 3, 1, 8), "bf16", us=2.0, cache_bytes=4000, kernel_err=[0.5, 0.0, 0.25], sdpa_err=[0.4, 0.1, 0.25]
    )
    assert row.gbs == pytest.approx(2.0)  # 4000 bytes in 2 us
    assert row.worse_heads == 1  # only head 0: 0.5 > 0.4 (a tie is not worse)


def test_the_e4m3_cache_uses_a_power_of_two_scale_above_the_amax() -> None:
    x = torch.tensor([[-3.0, 1.0, 0.5]]).bfloat16()
    data, scale = bda.e4m3(x)
    assert float(scale) == 2.0**-7  # 3 / 448 = 0.0067 -> the next power of two up: 2^-7 = 0.0078
    assert data.dtype == torch.float8_e4m3fn
    assert torch.equal(data.float() * scale, torch.tensor([[-3.0, 1.0, 0.5]]))  # exact in E4M3


@pytest.mark.slow  # the interpreter runs every program: ~6 s on 2 idle cores
def test_the_kernel_under_the_interpreter_is_within_bf16_rounding_of_float64() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "fp8rl.cli",
        "bench",
        "decode-attention",
        "--device",
        "cpu",
        "--shapes",
        "2x4x2x40",
    ]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["2"]]
    assert [r[3] for r in rows] == ["bf16", "e4m3"]
    for r in rows:  # outputs of N(0, 1) values: BF16 rounding is ~4e-3; a wrong key or scale is ~0.1-1
        assert float(r[7]) < 1e-2 and float(r[8]) < 1e-2, r
