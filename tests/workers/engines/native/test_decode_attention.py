"""The Triton decode attention (workers/engines/native/decode_attention.py) on the CPU, under Triton's
interpreter: its arithmetic against a float64 reference (GQA groups, lengths inside the buffer,
several key ranges), an FP8 cache dequantized in registers to exactly the materialized values,
nothing read at or past the length, masked keys without effect, and the static decode loop through
it against the trainer. The interpreter must be on before Triton is imported, so those checks run
in a fresh interpreter (``decode_attention_checks.py``). Its speed, and its compilation for a GPU,
only a GPU shows (``make gpu-check``)."""

from __future__ import annotations

import logging

import pytest
import torch
import triton  # noqa: F401  # comes with the engines install (make test runs it): missing is an error

from tests.workers.engines.native.decode_attention_checks import case, fp8
from tests.workers.interpreter import run_under_interpreter
from tests.workers.switches import assert_off_by_default_and_checked
from workers.engines.native import decode_attention as da

# above its longest wait (pyproject's timeout of 300 s would cut that short: tests/test_timeouts.py)
pytestmark = pytest.mark.timeout(660)


def run_checks(name: str) -> None:
    run_under_interpreter("tests.workers.engines.native.decode_attention_checks", name, timeout=600)


@pytest.mark.slow  # over 3 s on 2 idle cores (tests/conftest.py: tiers)
def test_kernel_arithmetic_under_the_interpreter() -> None:
    run_checks("arithmetic")


@pytest.mark.slow  # the interpreter runs every program of every layer's attention: ~30 s
def test_static_decode_through_the_kernel_samples_what_the_trainer_scores() -> None:
    """FP8 weights and an FP8 KV cache, the decode steps' attention in the kernel: the samples'
    log-probs agree with the trainer's as the eager loop's do (CPU, eager: 1.0081; bound 1.02,
    where a wrong key, position or scale gives far more)."""
    run_checks("decode")


@pytest.mark.slow  # two decodes of 32 sequences under the interpreter: ~25 s
def test_the_gpu_tests_misses_are_fp8_amplification_not_the_kernel() -> None:
    """The GPU test's model with fp8-e2e weights: the float64 attention rounded once to BF16 scores
    above the SDPA loop's 1.02 too, and the kernel within 1.25x its excess: the bound the GPU tests
    take from the same run's exact attention (tests/workers/test_gpu_data_plane.py)."""
    run_checks("amplification")


@pytest.mark.slow  # the kernel over four shapes, then short decodes, interpreted: ~90 s (2026-12-02)
def test_fused_rope_and_kv_write_under_the_interpreter() -> None:
    """``FP8RL_KV_WRITE=triton`` beside the Triton attention: RoPE and the K/V write in one launch,
    Hugging Face's rotated values bit for bit, the decode loop's samples unchanged by it, and with
    the fused SiLU·mul and the one-kernel RMSNorm too, the samples' log-probs still the trainer's
    (token_mult_prob_error 1.0080 observed, bound 1.02)."""
    run_checks("rope")


def test_fuse_rope_takes_each_attention_module_once_and_leaves_other_forwards_alone() -> None:
    """Outside a fused decode step (the prefill, the eager loop, the trainer) the model computes
    what it computed before: the same logits, bit for bit."""
    from tests.workers.engines.native.test_static_decode import TOK, spec
    from workers.engines.models import build_policy

    model = build_policy(spec("bf16"), TOK.vocab_size, torch.bfloat16)
    ids = torch.tensor([TOK.encode("Calculate 2 + 7. ")])
    before = model(input_ids=ids).logits
    assert da.fuse_rope(model) == 2 and da.fuse_rope(model) == 0  # 2 layers, then none left
    assert torch.equal(model(input_ids=ids).logits, before)


def test_bad_shapes_and_missing_scales_are_refused() -> None:
    q, k, v, seen = case(1, 3, 2, 16, 32, seed=3)
    with pytest.raises(ValueError, match="3 query heads over 2 KV heads"):
        da.decode_attention(q, k, v, seen, torch.tensor([4]), 1.0)
    q, k, v, seen = case(1, 2, 1, 16, 32, seed=3)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        da.decode_attention(q, fp8(k, 0.02), fp8(v, 0.02), seen, torch.tensor([4]), 1.0)


def test_the_switch_is_off_by_default_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_off_by_default_and_checked(monkeypatch, "FP8RL_DECODE_ATTENTION", da.enabled, bad="flash")


def test_the_switch_on_the_cpu_says_once_that_sdpa_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Asked for where it cannot run, the kernel is not silently skipped: one warning per process
    (the switch is read at every generator build), naming the variable, the cause and SDPA."""
    from workers.fp8 import dispatch

    monkeypatch.setenv("FP8RL_DECODE_ATTENTION", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dispatch._warn_fallback.cache_clear()
    caplog.set_level(logging.WARNING, logger=dispatch.__name__)
    assert not da.enabled(torch.device("cpu")) and not da.enabled(torch.device("cpu"))
    [message] = [r.getMessage() for r in caplog.records if "FP8RL_DECODE_ATTENTION" in r.getMessage()]
    assert message.startswith("FP8RL_DECODE_ATTENTION=triton is set, but the tensors are on the CPU")
    assert message.endswith(": torch SDPA over the whole masked cache runs instead")


@pytest.mark.parametrize("cache", ["bf16", "e4m3"])
def test_on_a_gpu_the_kernel_multiplies_bf16_tiles_on_the_tensor_cores(cache: str) -> None:
    """Compiled for SM90 (no GPU needed), the GPU branch's two products are BF16 MMAs with float32
    accumulation, BF16 or an E4M3 cache alike: no TF32 (the interpreter's branch, which the CPU
    checks, is float32 and compiles to TF32 MMAs at half the rate) and no register spills."""
    import re

    from tests.workers.triton_sm90 import compile_sm90
    from workers.engines.native import triton_decode

    kv = "*fp8e4nv" if cache == "e4m3" else "*bf16"
    sig = {"q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "seen_ptr": "*i1", "len_ptr": "*i64"}
    sig |= {"ks_ptr": "*fp32", "vs_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32"}
    sig |= {"out_ptr": "*bf16"}
    strides = ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_kt", "stride_vb", "stride_vh")
    sig |= {"scaling": "fp32"} | dict.fromkeys((*strides, "stride_vt", "stride_sb", "chunk"), "i32")
    consts = {"HQ": 32, "SPLITS": 4, "GROUP": 4, "BLOCK_G": 16, "D": 128, "BLOCK_N": da.BLOCK_N}  # 8B's D
    for hw, kind, direct in ((True, "bf16", False), (False, "tf32", False), (True, "bf16", True)):
        fixed = {**consts, "FP8": cache == "e4m3", "HW": hw, "DIRECT": direct}
        ptx = compile_sm90(triton_decode._split_kernel, sig, fixed)
        mmas = set(re.findall(r"mma\.sync\.aligned\.\w+\.row\.col\.f32\.(\w+)\.\w+\.f32", ptx))
        assert mmas == {kind}, (hw, mmas)
        assert "st.local" not in ptx, "register spills"
        # one split: the BF16 output (2-byte stores) written here; else only float32 partials
        assert bool(re.search(r"st\.global(\.\w+)*\.b16", ptx)) == direct, direct
    combine = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16"}
    ptx = compile_sm90(
        triton_decode._combine_kernel, combine, {"SPLITS": 4, "BLOCK_S": 4, "D": 64, "HW": True}
    )
    assert "cvt.rn.bf16.f32" in ptx  # the hardware's round to nearest even
