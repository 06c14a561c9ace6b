"""Every FP8 kernel call fp8rl makes is one CUDA accepts, on every device profile; no host syncs.

For each profile in ``PROFILES`` an :class:`Fp8Linear` runs forward, backward and inference on the
CPU with the dispatch planning for that GPU (``simulate``). The kernel calls are recorded (and
computed on the CPU as CUDA would read their arguments), then replayed with ``meta`` tensors of
the same shapes, strides and dtypes through torch's own kernels, whose meta implementations
apply CUDA's preconditions. Capability rules the meta kernels do not check come from
``cuda_contract.device_problem``. Which scalings a profile *should* use is written out below by
hand from the rules in ``workers/fp8/dispatch.py``'s docstring, so a dispatch that quietly
emulated everywhere would fail too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.workers.fp8.cuda_contract import Recorder, device_problem, recording
from tests.workers.fp8.test_matmul import gamma
from workers.fp8 import PROFILES, Fp8Linear, Fp8LinearConfig, finite_guard, quantize, simulate
from workers.fp8.kv_cache import KvScaleCalibrator, quantize_kv

CONFIGS = {
    "blockwise": Fp8LinearConfig.for_format("hybrid"),  # 1x128 / 128x128 blocks, E5M2 gradients
    "blockwise-e4m3": Fp8LinearConfig(),  # the default, E4M3 gradients: blockwise on all three
    "tensorwise": Fp8LinearConfig(weight_block=None, activation_block=None, grad_block=None),
}
# (tokens, in, out): odd K and tokens (padding), partial blocks, all-128 dims, a single token, and
# rows already a multiple of 16 with K and N multiples of 128 (fprop and dgrad call cuBLAS directly)
SHAPES = [(7, 200, 48), (130, 256, 160), (200, 256, 384), (1, 128, 256), (32, 256, 384)]
# the benchmark's LLM shapes (Llama-3-8B MLP) at small token counts: calls recorded, not computed
LLM_SHAPES = [(1, 4096, 14336), (16, 14336, 4096)]

SM90_NEW = ("sm90-cuda12.9", "sm90-cuda13.0")


def expected_scalings(profile: str, config: str) -> set[str]:
    """What should run, by hand: blockwise and rowwise FP8 GEMMs on SM90 with CUDA >= 12.9,
    tensorwise wherever FP8 GEMMs exist, and nothing on CPU/SM80 or where only BF16-output
    rowwise kernels exist for block scales."""
    if profile in ("cpu", "sm80-cuda12.8"):
        return set()
    if config == "tensorwise":
        return {"tensorwise"}
    # SM90 with CUDA >= 12.9: blockwise where both operands are E4M3 and N is a multiple of 128,
    # rowwise for the other SHAPES (N = 48, 160) and for E5M2 gradients
    return {"blockwise", "rowwise"} if profile in SM90_NEW else set()


def run_layer(layer: Fp8Linear, m: int, seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    x = torch.randn(m, layer.in_features, requires_grad=True)
    y = layer(x)
    y.backward(torch.randn_like(y) * 1e-3)
    with torch.no_grad():
        y_inf = layer(x.detach())
    assert x.grad is not None and layer.weight.grad is not None
    out = (y.detach(), x.grad.clone(), layer.weight.grad.clone(), y_inf)
    x.grad, layer.weight.grad = None, None
    return out


def assert_replays(rec: Recorder, profile: str) -> None:
    for call in rec.calls:
        problem = device_problem(call, PROFILES[profile])
        assert problem is None, f"{profile} would refuse {call}: {problem}"
        call.replay_on_meta()  # raises what CUDA's checks raise


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_kernel_calls_are_accepted_and_compute_the_fp8_product(
    seed: int, profile: str, config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: set[str] = set()
    for m, k, n in SHAPES:
        torch.manual_seed(seed)
        layer = Fp8Linear(k, n, bias=False, config=CONFIGS[config])
        reference = run_layer(layer, m, seed)  # CPU profile: the emulated GEMMs
        with simulate(profile), recording(monkeypatch) as rec:
            simulated = run_layer(layer, m, seed)
        assert_replays(rec, profile)
        seen |= {c.scaling() for c in rec.calls}
        # same FP8 operands, other kernels: float32 summation order, and BF16 output where the
        # blockwise kernel writes BF16 (half an ulp of BF16, 2^-9, relative)
        bf16 = any(c.out_dtype == torch.bfloat16 for c in rec.calls)
        for got, want in zip(simulated, reference, strict=True):
            tol = 2 * gamma(max(k, m) + 4) * want.abs().max() + (2**-8 if bf16 else 0.0) * want.abs()
            assert bool(((got.double() - want.double()).abs() <= tol.double() + 1e-30).all())
    assert seen == expected_scalings(profile, config)


@pytest.mark.parametrize("profile", sorted(p for p in PROFILES if p not in ("cpu", "sm80-cuda12.8")))
def test_llm_shapes_calls_are_accepted(profile: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = "blockwise" if profile in SM90_NEW else "tensorwise"
    for m, k, n in LLM_SHAPES:
        layer = Fp8Linear(k, n, bias=False, config=CONFIGS[config])
        with simulate(profile), recording(monkeypatch, compute=False) as rec:
            x = torch.randn(m, k, requires_grad=True)
            layer(x).sum().backward()
            with torch.no_grad():
                layer(x.detach())
        assert rec.calls, "no kernel call recorded: the plan emulated"
        assert_replays(rec, profile)


def test_the_harness_catches_what_cuda_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    # the old wgrad: a column-major first operand (dy tiled 128x1, transposed as a view)
    from workers.fp8.matmul import _rowwise

    g = quantize(torch.randn(256, 64), "e5m2", (128, 1)).t()  # [64, 256] column-major
    x = quantize(torch.randn(256, 128), "e4m3", (128, 1))  # [256, 128] row-major
    with recording(monkeypatch) as rec:
        _rowwise(g, x)
    with pytest.raises(RuntimeError, match="row_major"):
        rec.calls[0].replay_on_meta()
    assert device_problem(rec.calls[0], PROFILES["sm89-cuda12.8"]) is not None  # float32 out


# -- no host sync: these must run on meta tensors ------------------------------------------------


def test_quantize_runs_on_meta_inside_and_outside_a_guard() -> None:
    x = torch.empty(300, 260, device="meta")
    for block in (None, (1, 128), (128, 128)):
        q = quantize(x, "e4m3", block)
        assert q.data.device.type == "meta" and q.data.dtype == torch.float8_e4m3fn
        with finite_guard() as guard:
            quantize(x, "e5m2", block)
        assert guard.calls == 1


@pytest.mark.parametrize("profile", ["cpu", "sm90-cuda12.9", "sm89-cuda12.8"])
def test_fp8_linear_inference_runs_on_meta(profile: str) -> None:
    # on meta, torch's real kernels run their meta implementations: CUDA's checks, no data
    layer = Fp8Linear(256, 384, device="meta", dtype=torch.bfloat16)
    layer.requires_grad_(False)
    with simulate(profile), finite_guard():
        y = layer(torch.empty(5, 3, 256, device="meta", dtype=torch.bfloat16))
    assert y.shape == (5, 3, 384) and y.dtype == torch.bfloat16 and y.device.type == "meta"


def test_kv_cache_quantizer_runs_on_meta() -> None:
    cal = KvScaleCalibrator(num_layers=2)
    k = torch.empty(4, 2, 17, 64, device="meta", dtype=torch.bfloat16)
    with finite_guard():
        cal.observe(1, k, k)
        k_scale, _ = cal.layer_scales(1)
        q = quantize_kv(k, k_scale)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.device.type == "meta"


# -- the forward GEMM's hot path: bound once per weight ------------------------------------------


def test_the_forward_gemm_is_planned_once_per_weight_and_follows_in_place_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On SM90 the FP8 linear's forward calls cuBLAS blockwise directly, with the plan and the
    weight's scale layout decided at its first call, not per call; a weight loaded in place (the
    generator's sync under a captured graph) keeps that binding and the next call uses the new
    bytes and scales. The product is checked against float64 of the dequantized operands."""
    from workers.fp8.dispatch import plan_gemm as real_plan

    plans: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        plans.append(1)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr("workers.fp8.linear_gemm.plan_gemm", counted)
    profile = PROFILES["sm90-cuda13.0"]
    torch.manual_seed(0)
    layer = Fp8Linear(256, 384, bias=False)
    layer.requires_grad_(False)
    layer.drop_master_weight()
    x = torch.randn(32, 256)

    def want() -> torch.Tensor:
        x_q = quantize(x, "e4m3", (1, 128)).dequantize(torch.float64)
        return x_q @ layer.fp8_weight().dequantize(torch.float64).t()

    def close(got: torch.Tensor, ref: torch.Tensor) -> bool:
        return bool(((got.double() - ref).abs() <= 2 * gamma(256) * ref.abs().max()).all())

    with simulate(profile), recording(monkeypatch) as rec:
        outs = [layer(x) for _ in range(3)]
    assert len(plans) == 1, "planned per call"
    assert [(c.op, c.scaling()) for c in rec.calls] == [("v2", "blockwise")] * 3
    assert_replays(rec, "sm90-cuda13.0")
    assert all(close(y, want()) for y in outs)

    held = layer.fp8_weight()
    ptr, scale_ptr = held.data.data_ptr(), held._memo["cublas_scale_t"].data_ptr()
    layer.load_fp8_weight(quantize(torch.randn(384, 256) * 0.05, "e4m3", (128, 128)))
    assert layer.fp8_weight() is held and held.data.data_ptr() == ptr  # loaded in place
    with simulate(profile), recording(monkeypatch) as rec:
        y = layer(x)
    assert len(plans) == 1 and held._memo["cublas_scale_t"].data_ptr() == scale_ptr
    assert close(y, want()), "the bound GEMM read stale weights or scales after the load"


def test_dgrad_is_planned_once_per_weight_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer's dgrad GEMM (the column-major weight copy, plan and scale layout) is bound at the
    first backward after a weight update and reused until the next one; an optimizer step binds
    it again, and the gradient then follows the new weight (float64 of the dequantized operands)."""
    from workers.fp8.dispatch import plan_gemm as real_plan

    plans: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        plans.append(1)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr("workers.fp8.linear_gemm.plan_gemm", counted)
    torch.manual_seed(0)
    layer = Fp8Linear(256, 384, bias=False)
    x = torch.randn(32, 256, requires_grad=True)
    dy = torch.randn(32, 384)

    def dgrad_ok() -> bool:
        g = quantize(dy, "e4m3", (1, 128)).dequantize(torch.float64)
        want = g @ layer.fp8_weight().dequantize(torch.float64)
        assert x.grad is not None
        return bool(((x.grad.double() - want).abs() <= 2 * gamma(384) * want.abs().max()).all())

    with simulate(PROFILES["sm90-cuda13.0"]), recording(monkeypatch) as rec:
        for _ in range(3):
            x.grad = None
            layer(x).backward(dy)
        assert len(plans) == 2  # fprop and dgrad, once each
        assert dgrad_ok()
        with torch.no_grad():
            layer.weight.mul_(-0.5)  # an optimizer step: in place, the version counter moves
        x.grad = None
        layer(x).backward(dy)
        assert len(plans) == 4 and dgrad_ok()
    assert {c.scaling() for c in rec.calls} == {"blockwise"}
    assert_replays(rec, "sm90-cuda13.0")
