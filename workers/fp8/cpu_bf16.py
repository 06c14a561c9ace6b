"""BF16 GEMMs on a CPU: how fast this CPU runs one (:func:`cpu_bf16_gemm`), and one at that speed
(:func:`bf16_matmul`). The BF16 linears of both engines on CPU (``workers.engines.models``) and
the FP8 GEMM of operands that are exact in BF16 (``workers.fp8.matmul``, kernel ``emulate_bf16``)
run through it, so a trainer and a generator on one host compute the same function."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

CPU_BF16_GEMM_ENV = "FP8RL_CPU_BF16_GEMM"


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]  # compiled: the answer, no file read
def cpu_bf16_gemm() -> str:
    """:func:`detect_cpu_bf16_gemm`, once per process."""
    return detect_cpu_bf16_gemm()


@functools.cache
def detect_cpu_bf16_gemm() -> str:
    """How a BF16 GEMM runs on this CPU: ``native`` (torch's own BF16 GEMM, oneDNN on BF16 matrix
    instructions: AMX-BF16 or AVX512-BF16) or ``float32`` (a float32 GEMM on the BF16 values).

    Both compute what a BF16 GEMM computes (exact products of BF16 values, float32 accumulation,
    one rounding of the output to BF16); they differ only in the order of the float32 sums, as
    any two GEMM kernels do. Which is faster depends on the CPU, measured on 2 cores at SmolLM2's
    shapes (``[3648, 576] x [576, 1536]``): with AMX-BF16 the native GEMM ran ~2300 GFLOP/s
    against ~250 for float32 (10x); on an AVX2 host without BF16 instructions torch's BF16 GEMM
    was 8-13x *slower* than float32. Decided once per process from ``/proc/cpuinfo``'s flags, so
    a trainer and a generator on one host compute the same function; ``FP8RL_CPU_BF16_GEMM=native
    |float32`` forces one (read on first use)."""
    forced = os.environ.get(CPU_BF16_GEMM_ENV, "").strip().lower()
    if forced in ("native", "float32"):
        return forced
    if forced:
        raise ValueError(f"{CPU_BF16_GEMM_ENV}={forced!r}: use native, float32 or leave it unset")
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux: keep the float32 GEMM, right on any CPU
        return "float32"
    return "native" if flags & {"amx_bf16", "avx512_bf16"} else "float32"


def bf16_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two BF16 matrices on the CPU as a BF16 GEMM computes it (exact products,
    float32 accumulation, the output rounded once to BF16), by :func:`cpu_bf16_gemm`'s way."""
    if cpu_bf16_gemm() == "native":
        return a @ b
    return (a.float() @ b.float()).to(torch.bfloat16)
