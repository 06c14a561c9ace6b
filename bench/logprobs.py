"""Memory of the trainer's log-probs at a real vocabulary (``fp8rl bench logprobs``): the chunked
log-softmax (:mod:`workers.engines.logprobs`) against the one-piece form it replaced.

Each variant runs forward and backward once on BF16 logits ``[B, L, V]`` that require grad, in a
fresh Python process, so its peak resident memory (``ru_maxrss``) is its own; the report subtracts
the memory held before the call (the logits and the process itself), leaving what the log-prob
computation adds at its peak. Times are wall times of the same call (one run each; CPU only).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import torch

VARIANTS = ("one-piece", "chunked")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(variant: str, batch: int, length: int, vocab: int) -> dict[str, float]:
    """One forward + backward of ``variant`` in this process: peak MiB added, seconds."""
    from workers.engines.logprobs import token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, length, vocab, generator=g).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, vocab, (batch, length), generator=g)
    weights = torch.randn(batch, length, generator=g)
    logits.grad = torch.zeros_like(logits)  # the gradient's own [B, L, V] BF16, held by both
    before = _rss_mib()
    t0 = time.perf_counter()
    if variant == "one-piece":
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    else:
        logp = token_logprobs(logits, tokens)
    (logp * weights).sum().backward()  # type: ignore[no-untyped-call]
    return {"peak_added_mib": _rss_mib() - before, "seconds": time.perf_counter() - t0}


def report(batch: int, length: int, vocab: int) -> str:
    rows = {}
    for variant in VARIANTS:
        code = (
            "import json, sys; from bench.logprobs import measure; "
            f"print(json.dumps(measure({variant!r}, {batch}, {length}, {vocab})))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    f32 = batch * length * vocab * 4 / 2**20
    lines = [
        f"log-probs of [B={batch}, L={length}, V={vocab}] BF16 logits, forward + backward "
        f"(one float32 copy of every logit: {f32:.0f} MiB)",
        f"{'variant':<10} {'peak added (MiB)':>17} {'x float32 logits':>17} {'seconds':>8}",
    ]
    for variant, r in rows.items():
        peak = r["peak_added_mib"]
        lines.append(f"{variant:<10} {peak:>17.0f} {peak / f32:>17.2f} {r['seconds']:>8.2f}")
    a, b = rows["one-piece"], rows["chunked"]
    lines.append(
        f"chunked / one-piece: memory {b['peak_added_mib'] / max(a['peak_added_mib'], 1e-9):.2f}x, "
        f"time {b['seconds'] / a['seconds']:.2f}x"
    )
    return "\n".join(lines)
