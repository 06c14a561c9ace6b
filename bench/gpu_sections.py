"""The benchmark sections of the GPU checklist (:mod:`bench.gpu_check`): ``bench fp8``, the
kernel microbenchmark, the host overhead of one linear, ``bench rollout`` / ``step`` / ``sync`` at
GPU sizes, and a short ``fp8rl run`` per recipe. Each returns the section's markdown."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def bench_fp8(quick: bool) -> str:
    from bench import fp8

    shapes = fp8.QUICK_SHAPES if quick else fp8.LLM_SHAPES + fp8.SQUARE_SHAPES
    parts = []
    for mode in ("fwd", "train"):
        info, rows = fp8.run(shapes, device="cuda", mode=mode)
        parts.append(fp8.format_table(info, rows))
    return "```\n" + "\n\n".join(parts) + "\n```"


def kernel_microbench(quick: bool) -> str:
    """GPU time per call of each GEMM kind and of the quantizer (graph replay), per token count:
    which kernel wins in which regime (``bench/kernels.py``)."""
    from bench import kernels

    shapes = kernels.SHAPES[:2] if quick else kernels.SHAPES
    table = kernels.report("cuda", shapes=shapes)
    return "```\n" + table + "\n\n" + kernels.weight_quantization("1b", "cuda") + "\n```"


def overhead() -> str:
    """Host time to issue one linear (what an eager decode step pays per layer) vs its GPU time,
    and the same for each piece of the FP8 linear."""

    def per_call(fn: Callable[[], object], calls: int = 200) -> tuple[float, float]:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - t0) / calls
        torch.cuda.synchronize()
        return host * 1e6, (time.perf_counter() - t0) / calls * 1e6

    lines = ["| tokens x in x out | what | host us/call | GPU us/call |", "|---|---|---|---|"]
    for m, k, n in ((1, 2048, 8192), (256, 2048, 8192), (2048, 2048, 8192)):
        for name, fn in _pieces(m, k, n):
            host, gpu = per_call(fn)
            lines.append(f"| {m}x{k}x{n} | {name} | {host:.1f} | {gpu:.1f} |")
    lines.append("")
    lines.append("GPU us/call: wall time of 200 calls until the GPU finished, per call; when host us is")
    lines.append("close to it, the call is launch-bound (the GPU waits for the host).")
    return "\n".join(lines)


def _pieces(m: int, k: int, n: int) -> list[tuple[str, Callable[[], object]]]:
    from torch import nn

    from workers.fp8.linear import Fp8Linear
    from workers.fp8.matmul import blockwise_scaled_mm, fp8_matmul
    from workers.fp8.quant import quantize_rows

    bf16 = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    fp8 = Fp8Linear.from_linear(bf16, name="bench")
    fp8.drop_master_weight()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = fp8.fp8_weight()
    xq = quantize_rows(x, "e4m3", rows_multiple=16)
    gemm = fp8.fprop_gemm
    return [
        ("bf16 nn.Linear", lambda: bf16(x)),
        ("fp8 Fp8Linear", lambda: fp8(x)),
        ("  quantize_rows (Triton)", lambda: quantize_rows(x, "e4m3", rows_multiple=16)),
        (
            "  bound GEMM (planned once per weight)",
            lambda: gemm.bound(w, fp8.config, x.device, torch.bfloat16)(xq),
        ),
        (
            "  fp8_matmul (plans and lays out per call)",
            lambda: fp8_matmul(xq, w.t(), out_dtype=torch.bfloat16),
        ),
        ("  F.scaled_mm alone", lambda: blockwise_scaled_mm(xq, w.t(), torch.bfloat16)),
    ]


def data_plane_benches(quick: bool) -> dict[str, Callable[[], str]]:
    """``bench rollout``, ``step`` and ``sync`` at GPU sizes: a ~1B model (``--quick``: ~100M)."""
    from bench import rollout, step, sync

    model = "100m" if quick else "1b"
    tokens = 32 if quick else 256  # the 1B preset: 256 new tokens, a 32k vocabulary (bench.common)

    def rollouts() -> str:
        # 1024 sequences of the 1B model: the graph loops only (eager takes minutes there)
        runs = [(256, rollout.DECODES), (1024, rollout.DECODES if quick else rollout.DECODES[1:])]
        tables = [
            f"{n} sequences\n"
            + rollout.report(model, "cuda", prompts=n, new_tokens=tokens, repeat=2, decodes=decodes)
            for n, decodes in runs
        ]
        return "\n\n".join(tables)

    sections = {
        "bench-rollout": rollouts,
        # the RL step as the issue measures it: 1B, 32k vocabulary, 256 new tokens, graph decode
        "bench-step": lambda: step.report(
            model, "cuda", prompts=64, group_size=8, new_tokens=tokens, steps=2
        ),
        "bench-sync": lambda: sync.report(model, "cuda", repeat=3),
    }

    def fenced(run: Callable[[], str]) -> Callable[[], str]:
        return lambda: "```\n" + run() + "\n```"

    return {name: fenced(run) for name, run in sections.items()}


def run_recipes(quick: bool) -> str:
    import importlib.util
    import json

    from rljob import metrics as m
    from rljob.run_dir import RunDir

    if importlib.util.find_spec("ray") is None:
        return "skipped: ray is not installed in this Python (the GPU worker image has it)"
    if not Path("examples/arithmetic-gpu.yaml").is_file():
        return "skipped: no examples/ here; run make gpu-check from a checkout"
    steps = "3" if quick else "10"
    lines = [
        "| recipe | exit | steps | reward (last) | token_mult_prob_error (mean) | gen tokens/s (last) | "
        "weight sync MiB | KV MiB | generator weights MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for recipe in ("bf16", "fp8-gen", "fp8-e2e"):
        out_dir = Path("runs") / f"gpu-check-{recipe}-{int(time.time())}"
        cmd = [
            sys.executable, "-m", "fp8rl.cli", "run", "examples/arithmetic-gpu.yaml", "--recipe", recipe,
            "--steps", steps, "--output", str(out_dir), "--no-progress",
        ]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        metrics = RunDir(out_dir).metrics
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        rows = [r for r in rows if m.TOKEN_MULT_PROB_ERROR in r]  # RL steps (not a step-0 validation)
        if rows:
            last = rows[-1]
            mismatch = sum(r[m.TOKEN_MULT_PROB_ERROR] for r in rows) / len(rows)
            mib = [last.get(k, 0) / 2**20 for k in (m.WEIGHT_SYNC_BYTES, m.KV_CACHE_BYTES, m.WEIGHTS_BYTES)]
            lines.append(
                f"| {recipe} | {res.returncode} | {len(rows)} | {last['reward/mean']:.3f} | {mismatch:.5f} | "
                f"{last['throughput/generation_tokens_per_s']:.0f} | "
                + " | ".join(f"{x:.1f}" for x in mib)
                + " |"
            )
        else:
            lines.append(f"| {recipe} | {res.returncode} | 0 | | | | | | |")
        if res.returncode != 0:
            lines.append(f"\n```\n{res.stderr[-3000:]}\n```\n")
    return "\n".join(lines)
