"""Which kernel runs an FP8 GEMM, decided from the device, the CUDA version and the operands.

A GEMM ``a [M, K] @ b [K, N]`` of two :class:`~workers.fp8.fp8_tensor.Fp8Tensor` runs as one of:

``cublas_blockwise``      ``torch.nn.functional.scaled_mm`` with DeepSeek-style 1x128 / 128x128
                          scales (cuBLAS): one call, no chunking.
``scaled_mm_rowwise``     ``torch._scaled_mm`` once per 128-long K-chunk with one scale per row of
                          ``a`` and per column of ``b``, float32 partial sums added up.
``scaled_mm_tensorwise``  ``torch._scaled_mm`` once, one scale per operand.
``emulate``               dequantize both operands, one float32 GEMM: the same mathematical value.
``emulate_bf16``          (CPU, power-of-two scales) dequantize both operands to BF16, where every
                          value is exact, and one BF16 GEMM (:mod:`workers.fp8.cpu_bf16`): exact
                          products, float32 accumulation, the output rounded once to BF16. The
                          CPU's BF16 matrix unit where it has one (AVX512-BF16, AMX), 2-10x a
                          float32 GEMM's speed; see :func:`workers.fp8.matmul.matmul_bf16`.

What CUDA accepts (torch 2.11-2.13, read from ``ScaledBlas.cpp``/``CUDABlas.cpp`` and the meta
kernels; the meta kernels check shapes, layouts and scale layouts, not the device):

- ``torch._scaled_mm`` needs compute capability 8.9 or 9.0+ (SM80 has no FP8 tensor cores), the
  first operand row-major and the second column-major, K and N multiples of 16, and not both
  operands E5M2.
- Rowwise scales go to cuBLAS only on SM90 with CUDA >= 12.9, which can write float32. Elsewhere
  (SM89, SM100, SM120) a CUTLASS kernel runs them, with BF16/FP16 output only and ``b`` in E4M3:
  each 128-wide partial sum would be rounded to BF16, so those devices emulate instead.
- DeepSeek-style blockwise scaling needs SM90 exactly, CUDA >= 12.9, both operands E4M3, scale
  pairs (1x128, 128x128), (128x128, 1x128) or (1x128, 1x128) (fp8rl uses the first for fprop
  and dgrad and the last for wgrad), and K (and a 128x128 side's outer dimension) a multiple of
  128. It writes BF16 or float32 (both measured on an H100 with
  torch 2.11 / CUDA 13.0 by ``make gpu-check``'s kernel probe).

The executor (:func:`workers.fp8.matmul.fp8_matmul`) pads M to a multiple of 16 and the
contraction to a multiple of 16 (128 for blockwise) with zeros, and lays the operands out as
CUDA wants, so a plan never depends on the number of tokens.

A :class:`DeviceProfile` names a device without having it: ``plan_gemm`` answers "what would run
on an L40S with CUDA 12.8?" for tests, audits and ``fp8rl bench fp8 --profile``.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.util
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from workers.fp8.formats import Fp8Format

log = logging.getLogger(__name__)

Kernel = Literal["cublas_blockwise", "scaled_mm_rowwise", "scaled_mm_tensorwise", "emulate", "emulate_bf16"]
KERNELS: tuple[str, ...] = (
    "cublas_blockwise",
    "scaled_mm_rowwise",
    "scaled_mm_tensorwise",
    "emulate",
    "emulate_bf16",
)
Backend = Literal["auto", "emulate", "scaled_mm"]
BACKENDS: tuple[str, ...] = ("auto", "emulate", "scaled_mm")

_BLOCKWISE_PAIRS = {((1, 128), (128, 128)), ((1, 128), (128, 1))}


@dataclass(frozen=True)
class DeviceProfile:
    """A device as the dispatch sees it: compute capability and CUDA version (None on CPU)."""

    name: str
    capability: tuple[int, int] | None = None
    cuda: tuple[int, int] | None = None
    # torch.nn.functional.scaled_mm (the blockwise entry point) exists in this torch
    has_scaled_mm_v2: bool = True

    @property
    def is_cuda(self) -> bool:
        return self.capability is not None

    def describe(self) -> str:
        if self.capability is None:
            return "CPU"
        cuda = ".".join(map(str, self.cuda)) if self.cuda else "?"
        return f"SM{self.capability[0]}{self.capability[1]} (CUDA {cuda})"


def _profile(cap: tuple[int, int], cuda: tuple[int, int]) -> DeviceProfile:
    return DeviceProfile(f"sm{cap[0]}{cap[1]}-cuda{cuda[0]}.{cuda[1]}", cap, cuda)


CPU = DeviceProfile("cpu")
# One profile per case the rules tell apart, named after a GPU that has it.
PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        CPU,
        _profile((8, 0), (12, 8)),  # A100
        _profile((8, 9), (12, 8)),  # L40S, RTX 4090
        _profile((9, 0), (12, 4)),  # H100 with an older CUDA
        _profile((9, 0), (12, 9)),  # H100/H200
        _profile((9, 0), (13, 0)),  # H100/H200, the worker image's CUDA
        _profile((10, 0), (12, 9)),  # B200
        _profile((12, 0), (12, 9)),  # RTX 50xx / RTX PRO 6000
    )
}
_PROFILE_RE = re.compile(r"^sm(\d+?)(\d)(?:[-/]cuda(\d+)\.(\d+))?$")


def parse_profile(text: str) -> DeviceProfile:
    """``cpu`` or ``smXY[-cudaA.B]`` (e.g. ``sm90-cuda12.9``, ``sm89``; CUDA defaults to 13.0)."""
    key = text.strip().lower()
    if key == "cpu":
        return CPU
    m = _PROFILE_RE.match(key)
    if m is None:
        raise ValueError(
            f"device profile {text!r}: use cpu or smXY[-cudaA.B], e.g. sm90-cuda12.9, sm89-cuda12.8; "
            f"known: {', '.join(PROFILES)}"
        )
    cap = (int(m.group(1)), int(m.group(2)))
    cuda = (int(m.group(3)), int(m.group(4))) if m.group(3) else (13, 0)
    return _profile(cap, cuda)


def _cuda_version() -> tuple[int, int] | None:
    if torch.version.cuda is None:
        return None
    major, minor = torch.version.cuda.split(".")[:2]
    return int(major), int(minor)


_SIMULATED: contextvars.ContextVar[DeviceProfile | None] = contextvars.ContextVar(
    "fp8rl_device_profile", default=None
)


def profile_of(device: torch.device) -> DeviceProfile:
    """The profile GEMMs on ``device`` are planned for: a simulated one (see :func:`simulate`),
    else the device's own (CPU for ``cpu`` and ``meta``)."""
    simulated = _SIMULATED.get()
    if simulated is not None:
        return simulated
    if device.type != "cuda":
        return CPU
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEVICE_PROFILES:
        cap = torch.cuda.get_device_capability(index)
        cuda = _cuda_version() or (0, 0)
        _DEVICE_PROFILES[index] = DeviceProfile(
            f"sm{cap[0]}{cap[1]}-cuda{cuda[0]}.{cuda[1]}",
            (int(cap[0]), int(cap[1])),
            cuda,
            hasattr(torch.nn.functional, "scaled_mm"),
        )
    return _DEVICE_PROFILES[index]


_DEVICE_PROFILES: dict[int, DeviceProfile] = {}


def multiprocessors(device: torch.device, elsewhere: int) -> int:
    """The streaming multiprocessors of a CUDA ``device`` (asked once per GPU), by which kernels
    size their grids; ``elsewhere`` for any other device (Triton's interpreter on the CPU)."""
    if device.type != "cuda":
        return elsewhere
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


@contextmanager
def simulate(profile: DeviceProfile | str) -> Iterator[DeviceProfile]:
    """Plan every GEMM in the block as if it ran on ``profile`` (the tensors stay where they are).

    For contract tests and ``--profile`` plans on a machine without that GPU; a CPU cannot run
    the CUDA kernels, so the test harness records the calls and computes them another way.
    """
    p = parse_profile(profile) if isinstance(profile, str) else profile
    token = _SIMULATED.set(p)
    try:
        yield p
    finally:
        _SIMULATED.reset(token)


class Operand(Protocol):
    """What planning needs of an operand: an Fp8Tensor, or an :class:`OperandSpec`."""

    @property
    def shape(self) -> torch.Size | tuple[int, ...]: ...

    @property
    def block(self) -> tuple[int, int] | None: ...

    @property
    def fmt(self) -> Fp8Format: ...


@dataclass(frozen=True)
class OperandSpec:
    """An operand described without data: shape ``[rows, cols]`` as used in the GEMM."""

    shape: tuple[int, int]
    block: tuple[int, int] | None
    fmt: Fp8Format


@dataclass(frozen=True)
class GemmPlan:
    """The kernel for one GEMM and why; ``out_dtype`` is what the kernel itself writes."""

    kernel: Kernel
    reason: str
    out_dtype: torch.dtype = torch.float32
    k_multiple: int = 16  # the contraction is padded with zeros to a multiple of this


def _blockwise_problem(a: Operand, b: Operand, profile: DeviceProfile) -> str | None:
    """None when cuBLAS blockwise takes these operands on ``profile``, else why not."""
    if profile.capability != (9, 0):
        return "blockwise scaling runs on SM90 only"
    if profile.cuda is None or profile.cuda < (12, 9):
        return "blockwise scaling needs CUDA >= 12.9"
    if not profile.has_scaled_mm_v2:
        return "this torch has no torch.nn.functional.scaled_mm"
    if a.fmt.name != "e4m3" or b.fmt.name != "e4m3":
        return f"blockwise scaling needs E4M3 on both sides ({a.fmt.name} x {b.fmt.name})"
    if (a.block, b.block) not in _BLOCKWISE_PAIRS:
        return f"scales {a.block} x {b.block} are not a blockwise pair cuBLAS has"
    n = b.shape[1]
    if b.block == (128, 128) and n % 128:
        return f"N={n} is not a multiple of 128 (128x128 weight blocks)"
    if a.block == (128, 128):
        return "128x128 blocks on the first operand are not used here"
    return None  # the contraction is padded to a multiple of 128


def plan_gemm(
    a: Operand,
    b: Operand,
    profile: DeviceProfile,
    backend: str = "auto",
    out_dtype: torch.dtype = torch.float32,
    bf16_exact: bool = False,
) -> GemmPlan:
    """The kernel for ``a [M, K] @ b [K, N]`` on ``profile`` (see the module docstring).
    ``bf16_exact``: the caller vouches that both operands' dequantized values are exact in BF16
    (power-of-two scales) and that no row-invariance is asked of the GEMM (``precision.exact``).

    Plans depend on K, N, the scales, formats, device and output dtype, never on M (rows are
    padded), so they are cached: planning costs a dictionary lookup per GEMM.
    """
    a_spec = OperandSpec((16, int(a.shape[1])), a.block, a.fmt)
    b_spec = OperandSpec((int(b.shape[0]), int(b.shape[1])), b.block, b.fmt)
    return _plan(a_spec, b_spec, profile, backend, out_dtype, cublas_blockwise_disabled(), bf16_exact)


@functools.lru_cache(maxsize=4096)
def _plan(
    a: OperandSpec,
    b: OperandSpec,
    profile: DeviceProfile,
    backend: str,
    out_dtype: torch.dtype,
    blockwise_off: bool,
    bf16_exact: bool = False,
) -> GemmPlan:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "emulate":
        return GemmPlan("emulate", "backend=emulate asked for")
    tensorwise = a.block is None and b.block is None
    scaled: Kernel = "scaled_mm_tensorwise" if tensorwise else "scaled_mm_rowwise"
    n = b.shape[1]
    if not profile.is_cuda:
        if backend == "scaled_mm":
            return GemmPlan(scaled, "backend=scaled_mm asked for (torch's CPU reference kernel)")
        if bf16_exact:
            return GemmPlan(
                "emulate_bf16",
                "CPU, power-of-two scales: the dequantized operands are exact in BF16, so one BF16 "
                "GEMM (float32 accumulation, BF16 output) on the CPU's BF16 matrix unit",
                torch.bfloat16,
            )
        return GemmPlan(
            "emulate",
            "CPU: torch's CPU _scaled_mm is a reference kernel, ~600x slower than dequantizing "
            "to a float32 GEMM",
        )
    assert profile.capability is not None
    if profile.capability < (8, 9):
        return GemmPlan("emulate", f"{profile.describe()} has no FP8 tensor cores (needs SM89+)")
    if n % 16:
        return GemmPlan("emulate", f"_scaled_mm needs N to be a multiple of 16 (N={n})")
    if a.fmt.name == "e5m2" and b.fmt.name == "e5m2":
        return GemmPlan("emulate", "_scaled_mm has no E5M2 x E5M2 product")
    if tensorwise:
        return GemmPlan("scaled_mm_tensorwise", "one scale per operand", out_dtype)
    why_not_blockwise = _blockwise_problem(a, b, profile)
    if why_not_blockwise is None and blockwise_off:
        why_not_blockwise = "FP8RL_CUBLAS_BLOCKWISE=0"
    if backend == "auto" and why_not_blockwise is None:
        out = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.float32
        return GemmPlan("cublas_blockwise", "SM90, CUDA >= 12.9, E4M3 blocks", out, 128)
    rowwise_fp32 = profile.capability == (9, 0) and profile.cuda is not None and profile.cuda >= (12, 9)
    if not rowwise_fp32:
        return GemmPlan(
            "emulate",
            f"rowwise _scaled_mm on {profile.describe()} writes BF16 only (float32 needs SM90 with "
            f"CUDA >= 12.9), and {why_not_blockwise}",
        )
    reason = "rowwise per 128-long K-chunk, float32 partial sums"
    if why_not_blockwise is not None:
        reason += f" ({why_not_blockwise})"
    return GemmPlan("scaled_mm_rowwise", reason)


def cublas_blockwise_disabled() -> bool:
    """``FP8RL_CUBLAS_BLOCKWISE=0`` turns the blockwise kernel off (rowwise instead), for A/B runs."""
    return os.environ.get("FP8RL_CUBLAS_BLOCKWISE", "1") == "0"


def triton_switch(
    variable: str,
    default: str,
    triton_value: str,
    device: torch.device,
    instead: str,
    on_cuda_when_unset: bool = False,
) -> bool:
    """A Triton kernel's environment switch: ``variable`` is ``default`` (off) or
    ``triton_value``/``"triton"`` (on); on only for a CUDA device, or a CPU under Triton's
    interpreter (tests), with Triton installed. Anything else is refused, naming the variable.
    Asked for where it cannot run, it logs a warning once per process and cause, saying that
    ``instead`` runs. ``on_cuda_when_unset``: a kernel a GPU run has measured (bit for bit and
    faster) is on, unset, for CUDA tensors where Triton is installed, and silently off elsewhere."""
    if variable not in os.environ and on_cuda_when_unset:
        return device.type == "cuda" and _triton_problem(device) is None
    wanted = os.environ.get(variable, default)
    if wanted not in (default, triton_value):
        shown = f"{default} (the default off CUDA)" if on_cuda_when_unset else f"{default} (default)"
        raise ValueError(f"{variable}={wanted!r}: use {shown} or {triton_value}")
    if wanted != triton_value:
        return False
    why = _triton_problem(device)
    if why is not None:
        _warn_fallback(variable, wanted, why, instead)
    return why is None


def _triton_problem(device: torch.device) -> str | None:
    """Why a Triton kernel cannot run on ``device`` here, or None."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        no_cuda = "" if torch.cuda.is_available() else " (no CUDA device is visible)"
        return f"the tensors are on the CPU{no_cuda}"
    if device.type not in ("cpu", "cuda"):
        return f"the tensors are on {device.type}, not a CUDA device"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (not importable)"
    return None


@functools.cache
def _warn_fallback(variable: str, value: str, why: str, instead: str) -> None:
    # once per process and cause: the switch is read at every weight bind / generator build
    log.warning("%s=%s is set, but %s: %s runs instead", variable, value, why, instead)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor to ``device`` without making the host wait: pinned + non-blocking on CUDA."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
