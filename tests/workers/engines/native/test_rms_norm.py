"""The one-kernel RMSNorm (workers/engines/native/rms_norm.py): its arithmetic, gradient, and the
generator and trainer both taking it, under Triton's interpreter (in a fresh interpreter:
``norm_checks.py``); its switch; its compilation for SM90. Its speed only a GPU shows."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engines.native.test_native import TOK, spec_for
from tests.workers.interpreter import run_under_interpreter
from tests.workers.switches import assert_off_by_default_and_checked
from tests.workers.triton_sm90 import compile_sm90
from workers.engines.models import build_policy
from workers.engines.native import rms_norm

pytestmark = pytest.mark.timeout(660)  # above the subprocess's wait (tests/test_timeouts.py)


@pytest.mark.slow  # every row of short decodes and a trainer pass, interpreted: ~130 s (2026-12-02)
def test_the_norm_kernel_under_the_interpreter() -> None:
    out = run_under_interpreter("tests.workers.engines.native.norm_checks", timeout=600)
    assert out.count("ok ") == 7


def test_the_switch_is_off_by_default_checked_and_leaves_hugging_faces_norm_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert_off_by_default_and_checked(monkeypatch, "FP8RL_RMS_NORM", rms_norm.enabled)
    model = build_policy(spec_for("bf16", 0), TOK.vocab_size, torch.bfloat16)
    assert rms_norm.fuse_norms(model, torch.device("cpu")) == 0  # the CPU: Hugging Face's


@pytest.mark.parametrize("block", [1024, 4096])
def test_the_norm_compiles_for_sm90_with_ieee_sqrt_and_no_spills(block: int) -> None:
    from workers.engines.native import triton_norm

    sig = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "out_ptr": "*bf16"}
    sig |= {"rstd_ptr": "*fp32", "stride_x": "i32", "stride_r": "i32", "dim": "i32", "eps": "fp32"}
    sig |= {"rows": "i32", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "code_ptr": "*i64", "rows_out": "i32"}
    sig |= {"n_tiles": "i32", "call_code": "i64"}
    fmt = {"FMT_MAX": 448.0, "E4M3": True, "POW2": False, "CHECK": True}
    warps = 8 if block >= 4096 else 4
    for residual, emit in ((False, False), (True, False), (True, True)):
        consts = {"BLOCK_D": block, "RESIDUAL": residual, "HW": True, "EMIT": emit} | fmt
        ptx = compile_sm90(triton_norm._rms_norm, sig, consts, num_warps=warps, fp_fusion=False)
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx  # not the approximate rsqrt
        assert "st.local" not in ptx
        # the tiles: the hardware's E4M3 conversion and the guard's atomic, only where emitting
        assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == emit and ("atom.global" in ptx) == emit
