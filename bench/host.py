"""Host time of the FP8 linear's forward GEMM (``fp8rl bench host``): the Python fp8rl runs around
the kernel per call, which eager decode pays ~100 times per token step.

Runs without a GPU: the operands are ``meta`` tensors, the dispatch plans for a simulated device
profile (SM90 by default, where cuBLAS blockwise runs), and ``torch.nn.functional.scaled_mm`` is
replaced by a function that returns a preallocated result, so what is timed is fp8rl's own code
(planning, layout checks, scale layouts, objects made per call), not the kernel or torch's meta
checks. Two ways of issuing the same GEMM, measured in one run, interleaved:

- ``fp8_matmul``: the general entry point, which plans and lays out its operands per call;
- ``bound``: the ``Fp8Linear``'s forward GEMM bound once per weight (``BoundGemm``).

And training's weight gradient (:data:`WGRAD_SHAPES`), whose operands are both activations laid
out as the dual quantizer writes them on a GPU: ``fp8_matmul`` against :class:`WgradGemm`
(planned once per operand layout).

On a GPU, ``make gpu-check``'s ``overhead`` section measures the real calls' host and GPU time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch

from workers.fp8 import Fp8Linear, simulate
from workers.fp8.dispatch import PROFILES, DeviceProfile
from workers.fp8.formats import get_format
from workers.fp8.fp8_tensor import Fp8Tensor, TILE_1x128
from workers.fp8.linear_config import Fp8LinearConfig
from workers.fp8.linear_gemm import WgradGemm
from workers.fp8.matmul import fp8_matmul, plan_for

SHAPES: tuple[tuple[int, int, int], ...] = ((1, 2048, 8192), (256, 2048, 8192), (4096, 8192, 2048))
# wgrad (tokens, out N, in K): dW [N, K] = dy.T [N, tokens] @ x [tokens, K]; 4736 tokens: the 1B's
# micro-batch of the GPU plan
WGRAD_SHAPES: tuple[tuple[int, int, int], ...] = ((4096, 2048, 8192), (4736, 8192, 2048))


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(calls // 10 + 1):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def run(
    profile: str = "sm90-cuda13.0", calls: int = 2000, rounds: int = 5
) -> list[tuple[str, float, float, str]]:
    """``(shape, fp8_matmul us, bound us, kernel)`` per shape: medians over ``rounds`` interleaved rounds."""
    return [_measure(m, k, n, _profile(profile), calls, rounds) for m, k, n in SHAPES]


def _profile(name: str) -> DeviceProfile:
    if name not in PROFILES:
        raise ValueError(f"--profile {name!r}: one of {', '.join(PROFILES)}")
    return PROFILES[name]


def _interleaved(
    general: Callable[[], object], bound: Callable[[], object], calls: int, rounds: int
) -> tuple[float, float]:
    """Median microseconds per call of each, over ``rounds`` rounds that alternate them."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        times[0].append(_per_call_us(general, calls))
        times[1].append(_per_call_us(bound, calls))
    return statistics.median(times[0]), statistics.median(times[1])


def _measure(
    m: int, k: int, n: int, profile: DeviceProfile, calls: int, rounds: int
) -> tuple[str, float, float, str]:
    layer = Fp8Linear(k, n, bias=False, device="meta", dtype=torch.bfloat16).requires_grad_(False)
    device = torch.device("meta")
    rows = -(-m // 16) * 16  # the input as the Triton quantizer writes it on a GPU: rows padded
    # to 16, scales M-major (strides (1, rows))
    x_q = Fp8Tensor(
        torch.empty(rows, k, device=device, dtype=torch.float8_e4m3fn),
        torch.empty(-(-k // 128), rows, device=device).t(),
        TILE_1x128,
        get_format("e4m3"),
    )
    out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
    stub = mock.patch.object(torch.nn.functional, "scaled_mm", lambda *a, **kw: out)
    with simulate(profile), stub:
        layer.drop_master_weight()
        w, cfg, gemm = layer.fp8_weight(), layer.config, layer.fprop_gemm

        def general() -> object:
            return fp8_matmul(x_q, w.t(), out_dtype=torch.bfloat16)

        def bound() -> object:
            return gemm.bound(w, cfg, device, torch.bfloat16)(x_q)

        kernel = gemm.bound(w, cfg, device, torch.bfloat16).plan.kernel
        general_us, bound_us = _interleaved(general, bound, calls, rounds)
    return f"{m}x{k}x{n}", general_us, bound_us, kernel


def _tokens_major(rows: int, tokens: int) -> Fp8Tensor:
    """x.T or dy.T as the dual quantizer writes them on a GPU: ``[rows, tokens]`` row-major, tokens
    padded to 128, 1x128 tiles along the tokens, scales with stride 1 along the rows."""
    padded = -(-tokens // 128) * 128
    data = torch.empty(rows, padded, device="meta", dtype=torch.float8_e4m3fn)
    scale = torch.empty(padded // 128, rows, device="meta").t()
    return Fp8Tensor(data, scale, TILE_1x128, get_format("e4m3"))


def run_wgrad(
    profile: str = "sm90-cuda13.0", calls: int = 2000, rounds: int = 5
) -> list[tuple[str, float, float, str]]:
    """``(shape, fp8_matmul us, WgradGemm us, kernel)`` per :data:`WGRAD_SHAPES` row (medians)."""
    return [_measure_wgrad(t, n, k, _profile(profile), calls, rounds) for t, n, k in WGRAD_SHAPES]


def _measure_wgrad(
    tokens: int, n: int, k: int, profile: DeviceProfile, calls: int, rounds: int
) -> tuple[str, float, float, str]:
    g_t, x_t = _tokens_major(n, tokens), _tokens_major(k, tokens)
    out = torch.empty(n, k, device="meta", dtype=torch.float32)
    cfg, wgrad = Fp8LinearConfig.for_format("e4m3"), WgradGemm()
    stub = mock.patch.object(torch.nn.functional, "scaled_mm", lambda *a, **kw: out)
    with simulate(profile), stub:
        kernel = plan_for(g_t, x_t.t(), out_dtype=torch.float32).kernel

        def general() -> object:
            return fp8_matmul(g_t, x_t.t(), out_dtype=torch.float32)

        def bound() -> object:
            return wgrad(g_t, x_t, cfg, torch.float32)

        general_us, bound_us = _interleaved(general, bound, calls, rounds)
    return f"{tokens}x{n}x{k}", general_us, bound_us, kernel


def report(profile: str = "sm90-cuda13.0", calls: int = 2000, rounds: int = 5) -> str:
    lines = [
        f"host time per forward GEMM call, kernel stubbed (meta tensors, profile {profile})",
        "| tokens x in x out | kernel | fp8_matmul us | bound us | fp8_matmul / bound |",
        "|---|---|---|---|---|",
    ]
    for shape, general, held, kernel in run(profile, calls, rounds):
        lines.append(f"| {shape} | {kernel} | {general:.1f} | {held:.1f} | {general / held:.2f}x |")
    lines += [
        "",
        f"host time per wgrad GEMM call, kernel stubbed (meta tensors, profile {profile})",
        "| tokens x out x in | kernel | fp8_matmul us | WgradGemm us | fp8_matmul / WgradGemm |",
        "|---|---|---|---|---|",
    ]
    for shape, general, held, kernel in run_wgrad(profile, calls, rounds):
        lines.append(f"| {shape} | {kernel} | {general:.1f} | {held:.1f} | {general / held:.2f}x |")
    return "\n".join(lines)
