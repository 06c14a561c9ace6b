"""Kernel microbenchmark (``make gpu-check``'s ``kernels`` section, ``fp8rl bench kernels``): the
time of one call of each GEMM kind an FP8 linear may use, and of the activation quantizer, per
token count M, against BF16's ``mm`` at the same shape.

Each kernel is called on operands made beforehand (quantized once), so the column is the kernel
alone. On CUDA the calls are captured in a CUDA graph and the graph is replayed: the time per call
is GPU time without Python's launch cost (what a graph-captured decode step pays), cycling over
``SETS`` independent operand sets so that repeated calls do not just read the L2 cache. On CPU
the calls run eagerly (``perf_counter``); CPU rows only show that the section runs.

Kernels (``a [M, K]`` activations, ``w [N, K]`` a weight, ``out = a @ w.T``):

- ``bf16``: ``torch.mm`` in BF16, the baseline;
- ``blockwise``: cuBLAS's 1x128 x 128x128 scaled GEMM (the anchor recipe's fprop), BF16 out;
- ``rowwise``: one scale per row of ``a`` and per column of ``w`` (torchao's float8 rowwise);
- ``tensorwise``: one scale per operand;
- ``wgrad``: the weight gradient ``dy.T @ x`` (contraction over the M tokens), 1x128 x 1x128
  blockwise, for M a multiple of 128; ``wgrad_triton`` the same product by the Triton kernel
  (``workers/fp8/triton_wgrad.py``, float32 promotion per 128 tokens; CUDA only, any M), which
  training takes with ``FP8RL_WGRAD_GEMM=triton`` (the table's ``wgrad ratios``: BF16's ``mm``
  and cuBLAS's wgrad over it);
- ``quantize``: the 1x128 activation quantizer (Triton on CUDA), reported as GB/s of bytes read
  plus written;
- ``quantize_dual``: training's quantizer of both layouts (``x`` tiled 1x128 along K and ``x.T``
  along M, one read of ``x``; Triton on CUDA), GB/s of bytes read plus written: what fp8-e2e
  training pays per linear input and output gradient beyond BF16's GEMMs; ``quantize_dual_f32t``
  the same kernel with ``x.T``'s tile transposed in float32 before the cast (CUDA only);
  ``quantize_dual_split`` the same bytes by eight programs of 32-wide strips per 128x128 tile in
  one launch, which training takes with ``FP8RL_DUAL_QUANT=split`` (CUDA only);
  ``quantize_dual_pow2`` the same call with power-of-two scales (``precision.power_of_two_scales``):
  on a CPU the compiled quantizer (``workers/fp8/cpu_compiled.py``, unless ``FP8RL_CPU_COMPILE=0``),
  which writes both layouts' BF16 values instead of bytes (its GB/s counts the bytes all the same);
- ``small_m``: the Triton block-FP8 GEMM for at most 64 tokens (``workers/fp8/triton_gemm.py``,
  split-K), BF16 activation in: its time *includes* the activation's quantization, so compare it
  with ``blockwise`` + ``quantize`` (the table's ``small_m`` ratio does);
- ``silu_mul_torch``: an FP8 generator MLP's activation as Hugging Face runs it, for an
  intermediate size of K: ``silu(g) * u`` from the gate/up GEMM's ``[M, 2K]`` output, then the
  down projection's 1x128 quantizer; ``silu_mul`` the one-pass Triton kernel that
  ``FP8RL_SILU_MUL=triton`` takes (``workers/fp8/triton_act.py``; CUDA only); the table's last
  ratio is torch's time over the kernel's.

A kind that this device refuses is reported as refused, with the first line of the error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from workers.fp8.linear_gemm import SMALL_M_MAX
from workers.fp8.matmul import blockwise_scaled_mm, lay_out
from workers.fp8.quant import quantize, quantize_dual, quantize_rows

TOKENS: tuple[int, ...] = (1, 16, 64, 256, 1024, 4096)
# the 1B preset's MLP (hidden 2048 -> 8192 -> 2048) and Llama-3-8B's (4096 -> 14336)
SHAPES: tuple[tuple[int, int], ...] = ((2048, 8192), (8192, 2048), (4096, 14336))
KINDS: tuple[str, ...] = (
    "bf16", "blockwise", "rowwise", "tensorwise", "wgrad", "wgrad_triton", "quantize", "quantize_dual",
    "quantize_dual_f32t", "quantize_dual_split", "quantize_dual_pow2", "small_m", "silu_mul_torch",
    "silu_mul",
)  # fmt: skip
QUANTIZERS = ("quantize", "quantize_dual", "quantize_dual_f32t", "quantize_dual_split", "quantize_dual_pow2")
SETS = 4  # operand sets cycled through (more bytes than the L2 holds at the larger shapes)


@dataclass(frozen=True)
class KernelRow:
    tokens: int
    in_features: int
    out_features: int
    kind: str
    us: float | None  # time per call; None when refused or not applicable
    note: str = ""

    @property
    def flops(self) -> float:
        return 2.0 * self.tokens * self.in_features * self.out_features

    @property
    def tflops(self) -> float | None:
        if self.us is None or self.kind in QUANTIZERS:
            return None
        return self.flops / (self.us * 1e-6) / 1e12

    @property
    def quantizer_gbs(self) -> float | None:
        """Bytes the quantizer must move (BF16 in, E4M3 out, one float32 scale per 128; the dual
        quantizer writes two layouts and their scales) per second."""
        if self.us is None or self.kind not in QUANTIZERS:
            return None
        elems = self.tokens * self.in_features
        layouts = 1 if self.kind == "quantize" else 2
        return (elems * 2 + layouts * (elems + elems // 128 * 4)) / (self.us * 1e-6) / 1e9


def time_calls(device: torch.device, calls: Sequence[Callable[[], object]], replays: int) -> float:
    """Microseconds per call of ``calls`` (one per operand set), GPU time from graph replay on CUDA."""
    for fn in calls:  # warm-up: module load, handles, autotuning, cuBLAS's heuristics
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(replays):
            for fn in calls:
                fn()
        return (time.perf_counter() - t0) / (replays * len(calls)) * 1e6
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for fn in calls:  # a warm-up on the capture stream too
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    times = []
    for _ in range(3):  # median of three timed series
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        times.append(float(start.elapsed_time(end)) * 1e3 / (replays * len(calls)))
    return float(sorted(times)[1])


def _calls(kind: str, m: int, k: int, n: int, device: torch.device) -> list[Callable[[], object]]:
    """One zero-argument call per operand set for ``kind`` at ``[m, k] @ [k, n]``."""
    calls: list[Callable[[], object]] = []
    for _ in range(SETS):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        if kind == "bf16":
            wt = w.t()
            calls.append(partial(torch.mm, x, wt))
        elif kind == "blockwise":
            xq, wq = quantize_rows(x, "e4m3", rows_multiple=16), quantize(w, "e4m3", (128, 128))
            a, b = lay_out(xq, wq.t(), 128)
            calls.append(partial(blockwise_scaled_mm, a, b, torch.bfloat16))
        elif kind in ("rowwise", "tensorwise"):
            block = (1, k) if kind == "rowwise" else None
            a, b = lay_out(quantize(x, "e4m3", block), quantize(w, "e4m3", block).t())
            sa, sb = a.scale.contiguous(), b.scale.contiguous()

            calls.append(partial(torch._scaled_mm, a.data, b.data, sa, sb, out_dtype=torch.bfloat16))
        elif kind == "wgrad":  # dW [N, K] = dy.T [N, M] @ x [M, K], both tiled 1x128 along M
            dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
            a = quantize(dy.t().contiguous(), "e4m3", (1, 128))  # [N, M]
            b = quantize(x.t().contiguous(), "e4m3", (1, 128)).t()  # [M, K] in 128x1 tiles
            a, b = lay_out(a, b, 128)
            calls.append(partial(blockwise_scaled_mm, a, b, torch.bfloat16))
        elif kind == "wgrad_triton":  # the same product from training's layouts: dy.T and x.T, 1x128
            if device.type != "cuda":
                raise ValueError("the Triton wgrad GEMM runs on CUDA only")
            from workers.fp8.triton_wgrad import wgrad_gemm

            dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
            a = quantize(dy.t().contiguous(), "e4m3", (1, 128))  # [N, M]
            b = quantize(x.t().contiguous(), "e4m3", (1, 128))  # [K, M]
            calls.append(partial(wgrad_gemm, a.data, a.scale, b.data, b.scale, torch.bfloat16))
        elif kind == "quantize":
            calls.append(partial(quantize_rows, x, "e4m3", rows_multiple=16))
        elif kind == "quantize_dual":  # as training calls it (linear_gemm.train_forward)
            calls.append(partial(quantize_dual, x, "e4m3", rows_multiple=16, pad_tokens=True))
        elif kind == "quantize_dual_pow2":  # power-of-two scales: on a CPU the compiled path
            calls.append(
                partial(quantize_dual, x, "e4m3", power_of_two=True, rows_multiple=16, pad_tokens=True)
            )
        elif kind in ("quantize_dual_f32t", "quantize_dual_split"):  # the same bytes, made otherwise
            if device.type != "cuda":
                raise ValueError("the dual-layout Triton kernel runs on CUDA only")
            from workers.fp8.triton_dual import quantize_1x128_dual

            pad = -(-m // 128) * 128
            f = ("e4m3", 448.0, torch.float8_e4m3fn)
            transpose = "f32" if kind == "quantize_dual_f32t" else "split"
            calls.append(partial(quantize_1x128_dual, x, *f, False, None, -(-m // 16) * 16, pad, transpose))
        elif kind == "small_m":
            from workers.fp8.triton_gemm import small_m_gemm

            wq = quantize(w, "e4m3", (128, 128))
            calls.append(partial(small_m_gemm, x, wq.data, wq.scale, torch.bfloat16, None))
        elif kind in ("silu_mul_torch", "silu_mul"):  # gate|up [M, 2K] -> h [M, K] in 1x128 tiles
            gu = torch.randn(m, 2 * k, device=device, dtype=torch.bfloat16)
            if kind == "silu_mul_torch":
                calls.append(partial(_silu_mul_torch, gu, k))
            else:
                if device.type != "cuda":
                    raise ValueError("the fused SiLU*mul kernel runs on CUDA only")
                from workers.fp8.formats import get_format
                from workers.fp8.triton_act import silu_mul_rows

                calls.append(partial(silu_mul_rows, gu, get_format("e4m3"), False, "bench"))
        else:
            raise ValueError(f"kind {kind!r}: choose from {KINDS}")
    return calls


def _silu_mul_torch(gu: torch.Tensor, k: int) -> object:
    return quantize_rows(torch.nn.functional.silu(gu[:, :k]) * gu[:, k:], "e4m3", rows_multiple=16)


def run(
    device: str = "cuda",
    tokens: Sequence[int] = TOKENS,
    shapes: Sequence[tuple[int, int]] = SHAPES,
    kinds: Sequence[str] = KINDS,
    replays: int = 20,
) -> list[KernelRow]:
    dev = torch.device(device)
    rows = []
    for k, n in shapes:
        for m in tokens:
            for kind in kinds:
                if kind == "wgrad" and m % 128:
                    rows.append(KernelRow(m, k, n, kind, None, "M not a multiple of 128"))
                    continue
                if kind == "small_m" and m > SMALL_M_MAX:
                    rows.append(KernelRow(m, k, n, kind, None, f"M over {SMALL_M_MAX}"))
                    continue
                try:
                    us = time_calls(dev, _calls(kind, m, k, n, dev), replays)
                    rows.append(KernelRow(m, k, n, kind, us))
                except Exception as err:  # a kind this device refuses: say so, go on
                    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:100]
                    rows.append(KernelRow(m, k, n, kind, None, f"refused: {type(err).__name__}: {first}"))
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def format_table(rows: Sequence[KernelRow]) -> str:
    """One line per (shape, M): each kind's microseconds per call and its speed against BF16."""
    kinds = list(dict.fromkeys(r.kind for r in rows))
    by_key: dict[tuple[int, int, int], dict[str, KernelRow]] = {}
    for r in rows:
        by_key.setdefault((r.in_features, r.out_features, r.tokens), {})[r.kind] = r
    head = f"{'in':>6} {'out':>6} {'M':>5} " + " ".join(f"{kind + ' us':>13}" for kind in kinds)
    lines = [head + "   bf16/fp8 (blockwise, rowwise, tensorwise); quantizer GB/s (rows, dual, dual f32t, "]
    lines[0] += (
        "dual split, dual pow2); bf16 TFLOP/s; (blockwise + quantize) / small_m; "
        "wgrad ratios (bf16, cuBLAS) / triton; silu_mul_torch / silu_mul"
    )
    notes: dict[str, str] = {}
    for (k, n, m), by_kind in by_key.items():
        cells = []
        for kind in kinds:
            cell = by_kind.get(kind)
            if cell is None or cell.us is None:
                cells.append(f"{'-':>13}")
                if cell is not None and cell.note.startswith("refused"):
                    notes[kind] = cell.note
            else:
                cells.append(f"{cell.us:>13.1f}")
        base = by_kind.get("bf16")
        ratios = []
        base_us = base.us if base is not None else None
        for kind in ("blockwise", "rowwise", "tensorwise"):
            fp8 = by_kind.get(kind)
            fp8_us = fp8.us if fp8 is not None else None
            ratios.append(f"{base_us / fp8_us:.2f}x" if base_us and fp8_us else "-")
        gbs = " ".join(_gbs(by_kind.get(kind)) for kind in QUANTIZERS)
        tf = f"{base.tflops:.0f}" if base is not None and base.tflops is not None else "-"
        small = _small_m_ratio(by_kind)
        lines.append(
            f"{k:>6} {n:>6} {m:>5} " + " ".join(cells)
            + f"   {' '.join(ratios)}; {gbs}; {tf}; {small}; {_wgrad_ratios(by_kind)}; {_silu_ratio(by_kind)}"
        )  # fmt: skip
    lines += [f"{kind}: {note}" for kind, note in notes.items()]
    return "\n".join(lines)


def _gbs(row: KernelRow | None) -> str:
    return f"{row.quantizer_gbs:.0f}" if row is not None and row.quantizer_gbs is not None else "-"


def _small_m_ratio(by_kind: dict[str, KernelRow]) -> str:
    """cuBLAS's path for few tokens (quantize, then blockwise) over the Triton GEMM that does both."""
    parts = [by_kind.get(kind) for kind in ("blockwise", "quantize", "small_m")]
    us = [p.us if p is not None else None for p in parts]
    if us[0] is None or us[1] is None or not us[2]:
        return "-"
    return f"{(us[0] + us[1]) / us[2]:.2f}x"


def _wgrad_ratios(by_kind: dict[str, KernelRow]) -> str:
    """BF16's ``mm`` and cuBLAS's blockwise wgrad, each over the Triton wgrad GEMM (same shape)."""
    triton_row = by_kind.get("wgrad_triton")
    if triton_row is None or not triton_row.us:
        return "-"
    out = []
    for kind in ("bf16", "wgrad"):
        row = by_kind.get(kind)
        out.append(f"{row.us / triton_row.us:.2f}x" if row is not None and row.us else "-")
    return " ".join(out)


def _silu_ratio(by_kind: dict[str, KernelRow]) -> str:
    """Hugging Face's activation path (SiLU, product, quantizer) over the one-pass kernel."""
    torch_row, fused = by_kind.get("silu_mul_torch"), by_kind.get("silu_mul")
    if torch_row is None or fused is None or not torch_row.us or not fused.us:
        return "-"
    return f"{torch_row.us / fused.us:.2f}x"


def report(device: str = "cuda", **options: object) -> str:
    return format_table(run(device, **options))  # type: ignore[arg-type]


def weight_quantization(model: str = "1b", device: str = "cuda", repeats: int = 5) -> str:
    """A trainer's FP8 weights made again after an optimizer step, two ways, alternating: each layer
    on its own when next used (its master weight quantized by the torch quantizer, a fused group's
    members stacked), and the batched call of :mod:`workers.fp8.weights` (one Triton launch on
    CUDA). Wall time with the device waited for at both ends (both run eagerly in a trainer, so
    launch cost counts); the median of ``repeats``."""
    from bench.common import bench_spec, pick_device, timed, vocab_size
    from workers.engines.native.trainer import NativeTrainer
    from workers.fp8.linear import Fp8Linear
    from workers.models.tokenizer import ByteTokenizer

    dev = pick_device(device)
    trainer = NativeTrainer(
        bench_spec(model, "fp8-e2e", dev), vocab_size(model, ByteTokenizer().vocab_size), str(dev)
    )
    layers = [m for m in trainer.model.modules() if isinstance(m, Fp8Linear)]
    owners = list({id(o): o for o in (m.fused_train[0] if m.fused_train else m for m in layers)}.values())
    params: list[torch.Tensor] = [m.weight for m in layers]

    def updated() -> None:  # what an optimizer step leaves: every master weight written in place
        with torch.no_grad():
            torch._foreach_add_(params, 0.0)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def each_layer() -> None:
        for owner in owners:
            owner.fp8_weight()

    times: dict[str, list[float]] = {"each layer": [], "batched": []}
    for i in range(repeats + 1):  # the first round warms up (compilation, allocator)
        for name, fn in (("each layer", each_layer), ("batched", trainer.fp8_weights.quantize)):
            updated()
            _, seconds = timed(dev, fn)
            if i:
                times[name].append(seconds * 1e3)
    each, batched = (sorted(t)[len(t) // 2] for t in times.values())
    n_params = sum(p.numel() for p in params)
    return (
        f"{model}: {len(layers)} FP8 weights ({n_params / 1e6:.1f}M parameters, {len(owners)} quantized "
        f"separately), {dev.type}\n"
        f"each layer: {each:.2f} ms   batched: {batched:.2f} ms   each layer / batched: {each / batched:.2f}x"
    )
