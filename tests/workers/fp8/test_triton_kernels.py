"""The Triton quantizers (workers/fp8/triton_quant.py, triton_dual.py), the small-M GEMM
(triton_gemm.py) and the wgrad GEMM (triton_wgrad.py) on the CPU: their arithmetic under Triton's
interpreter (in a fresh interpreter: ``triton_kernel_checks.py``), and their compilation for SM90
(``tests/workers/triton_sm90.py``). Their speed only a GPU shows (``make gpu-check``, kernels)."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from tests.workers.interpreter import run_under_interpreter
from tests.workers.switches import assert_off_by_default_and_checked
from tests.workers.triton_sm90 import compile_sm90, resources_sm90
from workers.fp8 import triton_dual as td
from workers.fp8 import triton_quant as tq
from workers.fp8.quant import quantize_dual, quantize_rows

# above its longest wait (pyproject's timeout of 300 s would cut that short: tests/test_timeouts.py)
pytestmark = pytest.mark.timeout(660)


@pytest.mark.slow  # over 3 s on 2 idle cores (tests/conftest.py: tiers)
def test_kernels_under_the_interpreter() -> None:
    env = {"FP8RL_SMALL_M_GEMM": "triton", "FP8RL_WGRAD_GEMM": "triton"}
    out = run_under_interpreter("tests.workers.fp8.triton_kernel_checks", timeout=600, env=env)
    assert out.count("ok ") == 12


COMMON = {"rows": "i32", "rows_out": "i32", "cols": "i32", "stride_r": "i32", "stride_c": "i32"}
COMMON |= {"n_tiles_c": "i32", "call_code": "i64"}


@pytest.mark.slow  # five SM90 compilations a case: 11 s with an empty Triton cache
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("check", [True, False])
def test_quantizers_compile_for_sm90_without_spilling(fmt: str, check: bool) -> None:
    fp8 = "*fp8e4nv" if fmt == "e4m3" else "*fp8e5"
    consts = {"FMT_MAX": 448.0 if fmt == "e4m3" else 57344.0, "E4M3": fmt == "e4m3", "POW2": False}
    consts |= {"CHECK": check, "TILE": 128}
    one = {"x_ptr": "*bf16", "data_ptr": fp8, "scale_ptr": "*fp32", "code_ptr": "*i64", **COMMON}
    ptx = compile_sm90(tq._quantize_1x128, one, {**consts, "BLOCK_R": 32})
    assert ("atom.global" in ptx) == check  # the guard's atomic exists only when checking
    dual = {
        "x_ptr": "*bf16",
        "data_ptr": fp8,
        "scale_ptr": "*fp32",
        "data_t_ptr": fp8,
        "scale_t_ptr": "*fp32",
    }
    dual |= {"code_ptr": "*i64", "rows_t_out": "i32", **COMMON}
    for t32 in (False, True):  # x.T's tile transposed after the cast (FP8 bytes) or before (float32)
        ptx = compile_sm90(td._quantize_1x128_dual, dual, {**consts, "T32": t32}, num_warps=8)
        assert "st.local" not in ptx and "ld.local" not in ptx, "Triton itself keeps the tile in local memory"
    ptx = compile_sm90(td._quantize_1x128_split, dual, {**consts, "STRIP": td._STRIP})
    assert ("atom.global" in ptx) == check


DUAL_SIG = {"x_ptr": "*bf16", "data_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "data_t_ptr": "*fp8e4nv"}
DUAL_SIG |= {"scale_t_ptr": "*fp32", "code_ptr": "*i64", "rows_t_out": "i32", **COMMON}


@pytest.mark.slow  # three SM90 compilations
def test_the_dual_layout_tile_spills_and_fills_an_sm_alone_where_the_split_pass_does_not() -> None:
    """Why ``FP8RL_DUAL_QUANT=split`` exists, from ptxas's own allocation for SM90: the dual
    kernel's 128x128 float32 tile takes all 255 registers a thread may have at 8 warps and spills
    past them (a stack frame), so a multiprocessor holds one such program, 8 warps, to hide the
    memory's latency with; the split pass's strips spill nothing and fit two programs of 4
    warps, as the one-layout kernel (2.2-2.9 TB/s on an H200, 2026-11-29) does."""
    consts = {"FMT_MAX": 448.0, "E4M3": True, "POW2": False, "CHECK": True, "TILE": 128}
    dual = resources_sm90(td._quantize_1x128_dual, DUAL_SIG, {**consts, "T32": False}, num_warps=8)
    assert dual.registers == 255 and dual.stack > 0 and dual.programs_per_sm == 1, dual
    split = resources_sm90(td._quantize_1x128_split, DUAL_SIG, {**consts, "STRIP": td._STRIP})
    one_sig = {"x_ptr": "*bf16", "data_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "code_ptr": "*i64", **COMMON}
    one = resources_sm90(tq._quantize_1x128, one_sig, {**consts, "BLOCK_R": 32})
    assert split.stack == 0 and split.programs_per_sm >= 2 and split.warps == 4, split
    assert split.programs_per_sm == one.programs_per_sm, (split, one)


@pytest.mark.parametrize(("check", "src", "pow2"), [(True, 1, False), (False, 0, True), (True, 2, False)])
def test_grouped_weight_pass_compiles_for_sm90_without_spilling(check: bool, src: int, pow2: bool) -> None:
    """One program per 128x128 block of any weight: addresses read from the table (int64 to
    pointer; BF16, float32 and FP16 masters), the whole block in registers without spilling, the
    guard's atomic only when checking."""
    sig = {"table_ptr": "*i64", "owner_ptr": "*i32", "data_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    sig |= {"cublas_ptr": "*fp32", "code_ptr": "*i64", "call_code": "i64"}
    consts = {"SRC": src, "FIELDS": len(tq.WEIGHT_FIELDS), "FMT_MAX": 448.0, "E4M3": True, "POW2": pow2}
    consts |= {"CHECK": check, "CUBLAS": True, "TILE": 128}
    ptx = compile_sm90(tq._quantize_128x128_many, sig, consts, num_warps=8)
    assert "st.local" not in ptx and "ld.local" not in ptx, "the 128x128 block spills registers"
    assert ("atom.global" in ptx) == check
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # the hardware's saturating E4M3 conversion


def test_dual_layout_off_the_gpu_is_the_two_calls() -> None:
    """On a CPU (and on meta) quantize_dual is quantize_rows of x and quantize of x.T: same bytes."""
    x = torch.randn(70, 300) * 3
    rows, cols = quantize_dual(x, "e4m3")
    want = quantize_rows(x, "e4m3")
    assert torch.equal(rows.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(cols.data.view(torch.uint8), quantize_rows(x.t(), "e4m3").data.view(torch.uint8))
    assert cols.shape == (300, 70) and cols.block == (1, 128)
    meta_rows, meta_cols = quantize_dual(torch.empty(70, 300, device="meta"), "e5m2")
    assert meta_rows.data.device.type == "meta" and meta_cols.shape == (300, 70)


@pytest.mark.parametrize("block_m", [16, 64])
def test_small_m_gemm_compiles_for_sm90_on_the_tensor_cores(block_m: int) -> None:
    """E4M3 tiles multiplied on the tensor cores: Hopper's FP8 wgmma for 64-row tiles; below 64
    rows Triton takes FP16 MMAs of the E4M3 values (exact: every E4M3 value is an FP16 value)."""
    import re

    from workers.fp8 import triton_gemm

    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "part_ptr": "*fp32", "code_ptr": "*i64"}
    ints = ("m_rows", "n_cols", "k_len", "stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_sn")
    sig |= dict.fromkeys((*ints, "stride_sk", "blocks_per_split", "n_kblocks"), "i32") | {"call_code": "i64"}
    consts = {"FMT_MAX": 448.0, "CHECK": True, "BLOCK_M": block_m, "BLOCK": 128}
    ptx = compile_sm90(triton_gemm._small_m_kernel, sig, consts)
    fp8_wgmma = re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx)
    f16_mma = re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", ptx)
    assert fp8_wgmma if block_m == 64 else f16_mma, "not the tensor-core product expected"
    assert "st.local" not in ptx


@pytest.mark.parametrize("variable", ["FP8RL_SMALL_M_GEMM", "FP8RL_WGRAD_GEMM"])
def test_the_gemm_switches_are_off_by_default_and_checked(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    from workers.fp8.linear_gemm import small_m_gemm_enabled, wgrad_gemm_enabled

    enabled = small_m_gemm_enabled if variable == "FP8RL_SMALL_M_GEMM" else wgrad_gemm_enabled
    monkeypatch.delenv(variable, raising=False)
    assert not enabled(torch.device("cuda"))
    monkeypatch.setenv(variable, "cutlass")
    with pytest.raises(ValueError, match=f"{variable}='cutlass'"):
        enabled(torch.device("cuda"))


def test_the_small_m_switch_says_once_per_cause_why_it_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Read at every weight bind: each cause (CPU tensors, no Triton) is logged once, not per layer."""
    from workers.fp8 import dispatch
    from workers.fp8.linear_gemm import small_m_gemm_enabled

    monkeypatch.setenv("FP8RL_SMALL_M_GEMM", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dispatch._warn_fallback.cache_clear()
    caplog.set_level(logging.WARNING, logger=dispatch.__name__)
    assert not small_m_gemm_enabled(torch.device("cpu")) and not small_m_gemm_enabled(torch.device("cpu"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a)
    )
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    assert not small_m_gemm_enabled(cuda) and not small_m_gemm_enabled(cuda)
    on_cpu, no_triton = [r.getMessage() for r in caplog.records if "FP8RL_SMALL_M_GEMM" in r.getMessage()]
    assert on_cpu.startswith("FP8RL_SMALL_M_GEMM=triton is set, but the tensors are on the CPU")
    assert no_triton.startswith("FP8RL_SMALL_M_GEMM=triton is set, but Triton is not installed")
    assert all(
        m.endswith(": the dispatch's GEMM (workers.fp8.dispatch.plan_gemm) runs instead")
        for m in (on_cpu, no_triton)
    )


def test_the_kv_write_compiles_for_sm90_to_byte_stores_without_spilling() -> None:
    from workers.fp8 import triton_kv

    sig = {"x_ptr": "*bf16", "scale_ptr": "*fp32", "pos_ptr": "*i64", "buf_ptr": "*fp8e4nv"}
    sig |= dict.fromkeys(("rows", "heads", "dim", "length", "stride_b", "stride_h", "stride_d"), "i32")
    consts = {"FMT_MAX": 448.0, "E4M3": True, "BLOCK_R": 16, "BLOCK_D": 128}
    ptx = compile_sm90(triton_kv._write_kv, sig, consts)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, "not the hardware's round-to-nearest E4M3 cast"
    assert "div.rn.f32" in ptx and "st.local" not in ptx


@pytest.mark.parametrize("cache", ["*fp8e4nv", "*bf16"])
def test_the_rope_kv_write_compiles_for_sm90_with_rounded_bf16_and_no_spills(cache: str) -> None:
    """The fused RoPE + K/V write's GPU branch: BF16 rounded to nearest by the hardware (the
    interpreter's checks use bit operations instead), IEEE division and the E4M3 cast for an FP8
    cache, no register spills at head_dim 128 with 16 heads a program."""
    from workers.fp8 import triton_kv

    ptrs = ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr")
    sig = dict.fromkeys(ptrs, "*bf16") | {"ks_ptr": "*fp32", "vs_ptr": "*fp32", "pos_ptr": "*i64"}
    sig |= {"q_out_ptr": "*bf16", "k_buf_ptr": cache, "v_buf_ptr": cache}
    ints = ("length", "stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_vb", "stride_vh")
    sig |= dict.fromkeys((*ints, "stride_cb", "stride_sb"), "i32")
    fp8 = cache == "*fp8e4nv"
    consts: dict[str, object] = {"HQ": 32, "HKV": 8, "HALF": 64, "BLOCK_H": 16, "BLOCK_HALF": 64, "FP8": fp8}
    consts |= {"FMT_MAX": 448.0, "E4M3": True, "HW": True}
    fused = compile_sm90(triton_kv._rope_write_kv, sig, consts)  # what a default launch would build
    assert "fma.rn.bf16" in fused, "the contraction the launch's enable_fp_fusion=False is there to stop"
    ptx = compile_sm90(triton_kv._rope_write_kv, sig, consts, fp_fusion=False)  # as rope_write_kv launches
    # each product rounded to BF16 on its own (mul.rn.bf16: the exact product, rounded to nearest
    # even), then the sum (add/sub.rn.bf16: the exact sum, rounded; torch's float32 sum of two BF16
    # values rounds to the same BF16): torch's three roundings, no fused multiply-add skipping one
    assert "fma" not in ptx and "mul.rn.bf16" in ptx and "add.rn.bf16" in ptx
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx) == fp8
    assert "st.local" not in ptx


@pytest.mark.parametrize("fusion", [True, False])
def test_the_silu_mul_quantizer_compiles_for_sm90_with_cudas_expf(fusion: bool) -> None:
    """The fused MLP activation's GPU branch: libdevice's expf (its range reduction and
    ``ex2.approx``, what CUDA's expf is), IEEE division, the E4M3 cast, the guard's atomic, no
    spills; with contraction the "1 +" joins exp's last product in one fma (nvcc's default builds
    torch's SiLU so), without it the sum is its own add (triton_act.FP_FUSION picks)."""
    from workers.fp8 import triton_act

    sig = {"gu_ptr": "*bf16", "data_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "code_ptr": "*i64"}
    sig |= dict.fromkeys(("rows", "rows_out", "inter", "stride_r", "stride_c", "n_tiles_c"), "i32")
    sig |= {"call_code": "i64"}
    consts = {"FMT_MAX": 448.0, "E4M3": True, "POW2": False, "CHECK": True, "BLOCK_R": 32, "TILE": 128}
    ptx = compile_sm90(triton_act._silu_mul_1x128, sig, {**consts, "HW": True}, fp_fusion=fusion)
    assert "ex2.approx" in ptx and "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "atom.global" in ptx and "st.local" not in ptx
    assert ("add.rn.f32" in ptx) == (not fusion)


def test_the_silu_mul_switch_is_off_by_default_and_takes_only_fused_gate_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off unless asked; a wrong value is refused by name; and an MLP whose gate/up are separate
    GEMMs (a CPU generator, which does not fuse them) keeps Hugging Face's forward."""
    from tests.workers.engines.native.test_static_decode import TOK, spec
    from workers.engines.models import apply_recipe, build_policy
    from workers.fp8.convert import drop_master_weights
    from workers.fp8.fused import fuse_silu_mul, silu_mul_enabled

    assert_off_by_default_and_checked(monkeypatch, "FP8RL_SILU_MUL", silu_mul_enabled)
    s = spec("fp8-e2e")
    model = build_policy(s, TOK.vocab_size, torch.bfloat16).requires_grad_(False)
    apply_recipe(model, s.precision, "generator")
    drop_master_weights(model)
    assert fuse_silu_mul(model) == 0


def test_the_rope_kv_write_refuses_what_it_cannot_write() -> None:
    from workers.fp8.triton_kv import rope_write_kv

    def call(d: int = 8, dtype: torch.dtype = torch.bfloat16, buf: torch.dtype = torch.bfloat16) -> None:
        q, k = torch.zeros(2, 4, d, dtype=dtype), torch.zeros(2, 2, d, dtype=dtype)
        cos = torch.zeros(2, d, dtype=dtype)
        cache = torch.zeros(2, 2, 5, d, dtype=buf)
        one = torch.tensor(1.0)
        rope_write_kv(q, k, k, cos, cos, one, one, torch.tensor([0]), cache, cache.clone())

    with pytest.raises(ValueError, match="even D"):
        call(d=7)
    with pytest.raises(ValueError, match="must be BF16"):
        call(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"contiguous BF16 or FP8, got torch\.float32"):
        call(buf=torch.float32)


def test_the_kv_write_switch_is_on_for_cuda_by_default_and_checked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Unset: on for CUDA tensors (Triton is installed here), off for CPU ones without a word (the
    interpreter is the tests' to ask for); ``torch`` turns it off; anything else is refused."""
    from workers.engines.native.static_decode import fused_kv_write
    from workers.fp8 import dispatch

    monkeypatch.delenv("FP8RL_KV_WRITE", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch._warn_fallback.cache_clear()
    caplog.set_level(logging.WARNING, logger=dispatch.__name__)
    assert fused_kv_write(torch.device("cuda")) and not fused_kv_write(torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert fused_kv_write(torch.device("cuda")) and not fused_kv_write(torch.device("cpu"))
    assert not [r for r in caplog.records if "FP8RL_KV_WRITE" in r.getMessage()]
    with monkeypatch.context() as m:
        m.setattr(importlib.util, "find_spec", lambda name: None)  # no Triton
        assert not fused_kv_write(torch.device("cuda"))
    monkeypatch.setenv("FP8RL_KV_WRITE", "torch")
    assert not fused_kv_write(torch.device("cuda"))
    monkeypatch.setenv("FP8RL_KV_WRITE", "fused")
    with pytest.raises(
        ValueError, match=r"FP8RL_KV_WRITE='fused': use torch \(the default off CUDA\) or triton"
    ):
        fused_kv_write(torch.device("cuda"))
    monkeypatch.setenv("FP8RL_KV_WRITE", "triton")
    dispatch._warn_fallback.cache_clear()
    caplog.set_level(logging.WARNING, logger=dispatch.__name__)
    assert not fused_kv_write(torch.device("cpu"))
    (said,) = [r.getMessage() for r in caplog.records if "FP8RL_KV_WRITE" in r.getMessage()]
    assert said.startswith("FP8RL_KV_WRITE=triton is set, but the tensors are on the CPU")
    assert said.endswith("the torch KV-cache write runs instead")


@pytest.mark.parametrize("out", ["*fp32", "*bf16"])
def test_the_wgrad_gemm_compiles_for_sm90_to_fp8_wgmma_without_spilling(out: str) -> None:
    """E4M3 by E4M3 on Hopper's FP8 tensor cores (both operands K-major: the tokens contiguous),
    a 128x128 float32 accumulator without spills, and a BF16 output rounded to nearest."""
    import re

    from workers.fp8 import triton_wgrad

    sig = {"g_ptr": "*fp8e4nv", "gs_ptr": "*fp32", "x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "out_ptr": out}
    ints = ("n_rows", "k_cols", "m_len", "n_chunks", "stride_gn", "stride_gm", "stride_gsn", "stride_gsc")
    sig |= dict.fromkeys(
        (*ints, "stride_xk", "stride_xm", "stride_xsk", "stride_xsc", "stride_on", "stride_ok"), "i32"
    )
    consts = {"BLOCK_N": 128, "BLOCK_K": 128, "CHUNK": triton_wgrad.CHUNK}
    ptx = compile_sm90(triton_wgrad._wgrad_kernel, sig, consts, num_warps=8)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx), "no FP8 wgmma"
    assert "st.local" not in ptx and "ld.local" not in ptx
    assert ("cvt.rn.bf16x2.f32" in ptx) == (out == "*bf16")
