"""Record the FP8 kernel calls a CPU run makes under a simulated GPU profile; replay them on ``meta``.

torch's meta kernels apply CUDA's preconditions (operand layouts, K and N multiples of 16, scale
shapes and strides) to tensors on the ``meta`` device, so replaying a recorded call with meta
tensors of the same shapes, strides and dtypes fails exactly when CUDA would refuse the call on
those grounds. What the meta kernels do not check (device capability, CUDA version, output
dtypes per kernel, E5M2 x E5M2) is checked by :func:`device_problem`, written from torch's CUDA
sources (``ScaledBlas.cpp``, ``CUDABlas.cpp``, torch 2.11-2.13), independently of the dispatch code.

While recording, each call is also *computed* on the CPU from its arguments as CUDA would read
them (scales expanded by the layout each scaling type means), so a run under a simulated profile
gives numbers that can be compared with the emulated GEMM: a wrong scale layout shows up as a
wrong result, not only as a rejected call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from workers.fp8.dispatch import DeviceProfile

ScalingType = F.ScalingType


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype)

    def meta(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")


@dataclass
class Call:
    """One ``torch._scaled_mm`` (``op="v1"``) or ``F.scaled_mm`` (``op="v2"``) call."""

    op: str
    a: TensorSpec
    b: TensorSpec
    scale_a: TensorSpec
    scale_b: TensorSpec
    out_dtype: torch.dtype
    recipes: tuple[int, int] = (-1, -1)  # v2: ScalingType values
    use_fast_accum: bool = False

    def replay_on_meta(self) -> torch.Tensor:
        if self.op == "v1":
            return torch._scaled_mm(
                self.a.meta(),
                self.b.meta(),
                self.scale_a.meta(),
                self.scale_b.meta(),
                out_dtype=self.out_dtype,
                use_fast_accum=self.use_fast_accum,
            )
        return F.scaled_mm(
            self.a.meta(),
            self.b.meta(),
            self.scale_a.meta(),
            ScalingType(self.recipes[0]),
            self.scale_b.meta(),
            ScalingType(self.recipes[1]),
            output_dtype=self.out_dtype,
            use_fast_accum=self.use_fast_accum,
        )

    def scaling(self) -> str:
        """tensorwise | rowwise | blockwise, as CUDA tells them apart."""
        if self.op == "v2":
            return "blockwise"
        if _numel(self.scale_a.shape) == 1 and _numel(self.scale_b.shape) == 1:
            return "tensorwise"
        return "rowwise"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def device_problem(call: Call, profile: DeviceProfile) -> str | None:
    """What CUDA on ``profile`` refuses in ``call`` beyond the meta kernels' checks (None: fine)."""
    cap, cuda = profile.capability, profile.cuda
    if cap is None:
        return "a CUDA kernel call on a CPU profile"
    if cap < (8, 9):
        return f"torch._scaled_mm needs compute capability 8.9 or 9.0+, the device has {cap}"
    if call.a.dtype == call.b.dtype == torch.float8_e5m2:
        return "Multiplication of two Float8_e5m2 matrices is not supported"
    kind = call.scaling()
    if kind == "rowwise":
        cublas = cap == (9, 0) and cuda is not None and cuda >= (12, 9)
        if not cublas:  # CUTLASS f8f8bf16_rowwise
            if call.out_dtype not in (torch.bfloat16, torch.float16):
                return f"CUTLASS rowwise on {cap} writes bf16/fp16 only, not {call.out_dtype}"
            if call.b.dtype != torch.float8_e4m3fn:
                return "CUTLASS rowwise needs b in float8_e4m3fn"
    if kind == "blockwise":
        if cap != (9, 0):
            return "DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90"
        if cuda is None or cuda < (12, 9):
            return "blockwise scaling is only supported for CUDA 12.9 and above"
        if not (call.a.dtype == call.b.dtype == torch.float8_e4m3fn):
            return "Invalid scaling configuration: blockwise needs float8_e4m3fn on both sides"
        if call.use_fast_accum:
            return "scaled_gemm doesn't support fast accum with 1x128 blockwise scaling"
        if call.out_dtype not in (torch.bfloat16, torch.float32):
            return f"blockwise output {call.out_dtype}: bfloat16 and float32 are the ones measured"
    return None


def _rowwise_ref(
    a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    # v1 scales: scalars (tensorwise) or [M, 1] and [1, N] (rowwise), broadcast as they stand
    return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)


def _expand_blockwise(scale: torch.Tensor, recipe: int, rows: int, cols: int, operand: str) -> torch.Tensor:
    """A v2 blockwise scale tensor as a full ``[rows, cols]`` grid of the operand it scales."""
    if recipe == ScalingType.BlockWise1x128.value:
        if operand == "a":  # [M, K/128]: one scale per row and K-block
            return scale.repeat_interleave(128, dim=1)[:, :cols]
        # b [K, N]: [N, K/128], one scale per column and K-block
        return scale.t().repeat_interleave(128, dim=0)[:rows]
    assert recipe == ScalingType.BlockWise128x128.value
    # b [K, N]: [L4 >= K/128, N/128]; a [M, K]: [L4 >= K/128, M/128]
    s = scale[: rows // 128] if operand == "b" else scale[: cols // 128].t()
    return s.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:rows, :cols]


@dataclass
class Recorder:
    """Stands in for the CUDA kernels during a CPU run; keeps every call."""

    calls: list[Call] = field(default_factory=list)
    compute: bool = True  # False: return zeros of the right shape (contract only, big shapes)

    def scaled_mm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        scale_a: torch.Tensor,
        scale_b: torch.Tensor,
        bias: torch.Tensor | None = None,
        scale_result: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        use_fast_accum: bool = False,
    ) -> torch.Tensor:
        assert bias is None and scale_result is None
        dtype = out_dtype or a.dtype
        spec = TensorSpec.of
        self.calls.append(
            Call("v1", spec(a), spec(b), spec(scale_a), spec(scale_b), dtype, use_fast_accum=use_fast_accum)
        )
        if not self.compute:
            return torch.zeros(a.shape[0], b.shape[1], dtype=dtype)
        return _rowwise_ref(a, b, scale_a, scale_b, dtype)

    def scaled_mm_v2(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        scale_a: torch.Tensor,
        recipe_a: Any,
        scale_b: torch.Tensor,
        recipe_b: Any,
        swizzle_a: Any = None,
        swizzle_b: Any = None,
        bias: torch.Tensor | None = None,
        output_dtype: torch.dtype | None = torch.bfloat16,
        contraction_dim: Any = (),
        use_fast_accum: bool = False,
    ) -> torch.Tensor:
        assert bias is None and swizzle_a is None and swizzle_b is None
        dtype = output_dtype or torch.bfloat16
        ra, rb = int(recipe_a.value), int(recipe_b.value)
        spec = TensorSpec.of
        self.calls.append(
            Call("v2", spec(a), spec(b), spec(scale_a), spec(scale_b), dtype, (ra, rb), use_fast_accum)
        )
        if not self.compute:
            return torch.zeros(a.shape[0], b.shape[1], dtype=dtype)
        m, k = a.shape
        n = b.shape[1]
        full_a = a.float() * _expand_blockwise(scale_a, ra, m, k, "a")
        full_b = b.float() * _expand_blockwise(scale_b, rb, k, n, "b")
        return (full_a @ full_b).to(dtype)


@contextmanager
def recording(monkeypatch: pytest.MonkeyPatch, compute: bool = True) -> Iterator[Recorder]:
    """Replace the FP8 kernels by a :class:`Recorder` for the block."""
    rec = Recorder(compute=compute)
    with monkeypatch.context() as m:
        m.setattr(torch, "_scaled_mm", rec.scaled_mm)
        m.setattr(F, "scaled_mm", rec.scaled_mm_v2)
        yield rec
