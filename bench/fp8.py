"""``fp8rl bench fp8``: FP8 linear layers against BF16 linear layers, measured in the same run.

Each shape ``(tokens, in, out)`` times ``nn.Linear`` in BF16 and :class:`Fp8Linear` sharing the same
weight. The FP8 time includes quantizing the activations (1x128 tiles) and, in ``train`` mode,
the gradients; the weight's FP8 copy is made once beforehand, as after a weight sync (it is
reused until the next optimizer step). The ratio ``bf16 / fp8`` above 1 means FP8 is faster.

On CUDA, times come from CUDA events after warm-up; on CPU from ``perf_counter``. On CPU the FP8
path is an emulation (dequantize + float32 GEMM), so CPU ratios are below 1 by design: the CPU
numbers check that the benchmark runs, the GPU numbers are the ones that matter.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from workers.fp8.dispatch import simulate
from workers.fp8.linear import Fp8Linear
from workers.fp8.matmul import plan_for
from workers.fp8.quant import quantize

# LLM shapes (Llama-3-8B MLP): tokens x (hidden -> ffn) and (ffn -> hidden), then one square GEMM.
LLM_SHAPES: list[tuple[int, int, int]] = [
    (m, k, n) for m in (1, 64, 4096) for k, n in ((4096, 14336), (14336, 4096))
]
SQUARE_SHAPES: list[tuple[int, int, int]] = [(8192, 8192, 8192)]
QUICK_SHAPES: list[tuple[int, int, int]] = [
    (1, 1024, 3584),
    (64, 1024, 3584),
    (512, 3584, 1024),
    (1024, 1024, 1024),
]


@dataclass(frozen=True)
class BenchRow:
    tokens: int
    in_features: int
    out_features: int
    mode: str
    bf16_ms: float
    fp8_ms: float
    kernels: str = ""  # fprop[/dgrad/wgrad] kernels, e.g. "cublas_blockwise/scaled_mm_rowwise/..."

    @property
    def speedup(self) -> float:
        return self.bf16_ms / self.fp8_ms

    @property
    def tflops_bf16(self) -> float:
        return self._flops() / (self.bf16_ms * 1e-3) / 1e12

    @property
    def tflops_fp8(self) -> float:
        return self._flops() / (self.fp8_ms * 1e-3) / 1e12

    def _flops(self) -> float:
        gemms = 3 if self.mode == "train" else 1
        return 2.0 * self.tokens * self.in_features * self.out_features * gemms


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"llm"``, ``"square"``, ``"all"``, ``"quick"`` or ``"MxKxN,MxKxN"``."""
    named = {
        "llm": LLM_SHAPES,
        "square": SQUARE_SHAPES,
        "all": LLM_SHAPES + SQUARE_SHAPES,
        "quick": QUICK_SHAPES,
    }
    if text in named:
        return named[text]
    shapes = []
    for part in text.split(","):
        dims = part.lower().split("x")
        if len(dims) != 3 or not all(d.strip().isdigit() and int(d) > 0 for d in dims):
            raise ValueError(
                f"--shapes: {part!r} is not TOKENSxINxOUT (e.g. 64x4096x14336); or use one of {sorted(named)}"
            )
        m, k, n = (int(d) for d in dims)
        shapes.append((m, k, n))
    return shapes


def _timer(device: torch.device, fn: Callable[[], object], warmup: int, repeat: int) -> float:
    """Median milliseconds of ``fn`` over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    for _ in range(repeat):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(float(start.elapsed_time(end)))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def bench_shape(
    m: int, k: int, n: int, device: torch.device, mode: str, warmup: int, repeat: int
) -> BenchRow:
    bf16 = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    fp8 = Fp8Linear.from_linear(bf16)
    fp8.fp8_weight()  # made once per optimizer step / weight sync, not per call
    train = mode == "train"
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=train)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)

    def step(layer: nn.Module) -> Callable[[], object]:
        if not train:

            def fwd() -> object:
                with torch.no_grad():
                    return layer(x)

            return fwd

        def fwd_bwd() -> object:
            y = layer(x)
            y.backward(dy)
            return y

        return fwd_bwd

    bf16_ms = _timer(device, step(bf16), warmup, repeat)
    fp8_ms = _timer(device, step(fp8), warmup, repeat)
    return BenchRow(m, k, n, mode, bf16_ms, fp8_ms, kernel_names(fp8, m, mode))


def kernel_names(layer: Fp8Linear, tokens: int, mode: str) -> str:
    plans = layer.gemm_plans(tokens)
    gemms = ("fprop", "dgrad", "wgrad") if mode == "train" else ("fprop",)
    return "/".join(plans[g].kernel for g in gemms)


def plan_table(shapes: Sequence[tuple[int, int, int]], profile: str) -> str:
    """Which kernel each GEMM of an FP8 linear would use on ``profile``, and why (no GPU needed)."""
    with simulate(profile) as p:
        lines = [f"device profile: {p.describe()} ({p.name})"]
        lines.append(f"{'tokens':>7} {'in':>6} {'out':>6} {'gemm':<6} {'kernel':<21} why")
        for m, k, n in shapes:
            layer = Fp8Linear(k, n, bias=False, device="meta")
            for gemm, plan in layer.gemm_plans(m).items():
                lines.append(f"{m:>7} {k:>6} {n:>6} {gemm:<6} {plan.kernel:<21} {plan.reason}")
    return "\n".join(lines)


def device_info(device: torch.device) -> dict[str, str]:
    probe_a = quantize(torch.ones(16, 128, device=device), "e4m3", (1, 128))
    probe_b = quantize(torch.ones(128, 128, device=device), "e4m3", (128, 128))
    info = {
        "device": (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"
        ),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "fp8_backend": plan_for(probe_a, probe_b).kernel,
    }
    return info


def run(
    shapes: Sequence[tuple[int, int, int]],
    device: str = "auto",
    mode: str = "fwd",
    warmup: int | None = None,
    repeat: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, str], list[BenchRow]]:
    """Benchmark every shape; returns (device info, rows)."""
    if mode not in ("fwd", "train"):
        raise ValueError(f"mode={mode!r}: use 'fwd' (forward) or 'train' (forward + backward)")
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    warmup = warmup if warmup is not None else (5 if dev.type == "cuda" else 1)
    repeat = repeat if repeat is not None else (20 if dev.type == "cuda" else 3)
    rows = []
    for i, (m, k, n) in enumerate(shapes):
        if progress:
            progress(f"[{i + 1}/{len(shapes)}] {m}x{k}x{n} ({mode})")
        rows.append(bench_shape(m, k, n, dev, mode, warmup, repeat))
    return device_info(dev), rows


def format_table(info: dict[str, str], rows: Sequence[BenchRow]) -> str:
    lines = [
        f"device: {info['device']}   torch {info['torch']}   cuda {info['cuda']}   "
        f"fp8 backend: {info['fp8_backend']}",
        f"{'tokens':>7} {'in':>6} {'out':>6} {'mode':>5} {'bf16 ms':>10} {'fp8 ms':>10} "
        f"{'bf16 TFLOP/s':>13} {'fp8 TFLOP/s':>12} {'bf16/fp8':>9}  fp8 kernels",
    ]
    for r in rows:
        lines.append(
            f"{r.tokens:>7} {r.in_features:>6} {r.out_features:>6} {r.mode:>5} {r.bf16_ms:>10.3f} "
            f"{r.fp8_ms:>10.3f} {r.tflops_bf16:>13.3f} {r.tflops_fp8:>12.3f} {r.speedup:>8.2f}x  "
            f"{r.kernels}"
        )
    return "\n".join(lines)


def to_json(info: dict[str, str], rows: Sequence[BenchRow]) -> str:
    return json.dumps({"info": info, "rows": [asdict(r) | {"speedup": r.speedup} for r in rows]}, indent=2)
