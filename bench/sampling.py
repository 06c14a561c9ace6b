"""``fp8rl bench sampling``: one decode step's sampling from ``[B, V]`` BF16 logits, torch's path
(:func:`workers.engines.native.sampling.next_token`: float copy, temperature, log-softmax, exp, the
exponential draw, the race, the gather) against the three Triton launches ``FP8RL_SAMPLING=triton``
takes (:mod:`workers.engines.native.triton_sample`), at the vocabularies of the presets (SmolLM2's
49152, Llama-3's 128256) and decode batch sizes.

GPU time per call from CUDA-graph replay (:func:`bench.kernels.time_calls`), both paths drawing
from their own generator in the graph; the ratio is torch's time over the kernels'. The GB/s
column counts the bytes the kernels must move: the logits read twice, the draw's float32 noise
written by torch and read once. Each row also says whether the two paths chose the same tokens
from the same seed (``same``: rows equal / rows). Needs Triton: CUDA, or ``TRITON_INTERPRET=1``
on a CPU (where the times say only that it runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from bench.kernels import time_calls
from workers.engines.native.sampling import next_token

ROWS: tuple[int, ...] = (1, 64, 256, 1024)
VOCABS: tuple[int, ...] = (49152, 128256)
TEMPERATURE = 1.0
SETS = 2  # logits sets cycled through (256 x 128256 BF16 is 66 MB: more than the L2 holds)


@dataclass(frozen=True)
class Row:
    rows: int
    vocab: int
    torch_us: float | None
    triton_us: float | None
    same: int  # rows where both paths drew the same token from the same seed
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return self.torch_us / self.triton_us if self.torch_us and self.triton_us else None

    @property
    def gbs(self) -> float | None:
        """Bytes the kernels move (BF16 logits read twice, float32 noise written and read) per second."""
        if not self.triton_us:
            return None
        return self.rows * self.vocab * (2 * 2 + 2 * 4) / (self.triton_us * 1e-6) / 1e9


def _torch_step(logits: torch.Tensor, gen: torch.Generator, done: torch.Tensor) -> object:
    return next_token(logits, TEMPERATURE, 1.0, gen, done, 0)


def _triton_step(logits: torch.Tensor, gen: torch.Generator, done: torch.Tensor) -> object:
    from workers.engines.native.triton_sample import sample_rows

    return sample_rows(logits, TEMPERATURE, gen, done, 0)


def measure(b: int, v: int, device: torch.device, replays: int) -> Row:
    g = torch.Generator(device=device).manual_seed(b * 7 + v)
    sets = [(torch.randn(b, v, generator=g, device=device) * 4).bfloat16() for _ in range(SETS)]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    times: list[float | None] = []
    for step in (_torch_step, _triton_step):
        gen = torch.Generator(device=device).manual_seed(0)
        calls = [partial(step, logits, gen, done) for logits in sets]
        try:
            times.append(time_calls(device, calls, replays))
        except Exception as err:  # Triton missing, or a CPU without the interpreter: say so
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:100]
            return Row(b, v, times[0] if times else None, None, 0, f"refused: {type(err).__name__}: {first}")
    picks = [
        step(sets[0], torch.Generator(device=device).manual_seed(1), done)
        for step in (_torch_step, _triton_step)
    ]
    same = int((picks[0][0] == picks[1][0]).sum())  # type: ignore[index]
    return Row(b, v, times[0], times[1], same)


def run(
    device: str, rows: Sequence[int] = ROWS, vocabs: Sequence[int] = VOCABS, replays: int = 20
) -> list[Row]:
    dev = torch.device(device)
    out = []
    for v in vocabs:
        for b in rows:
            out.append(measure(b, v, dev, replays))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return out


def format_table(rows: Sequence[Row]) -> str:
    lines = [
        f"{'B':>5} {'V':>7} {'torch us':>10} {'triton us':>10} {'torch/triton':>12} {'GB/s':>7} {'same':>10}"
    ]
    for r in rows:
        t = f"{r.torch_us:.1f}" if r.torch_us is not None else "-"
        k = f"{r.triton_us:.1f}" if r.triton_us is not None else "-"
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
        gbs = f"{r.gbs:.0f}" if r.gbs is not None else "-"
        same = f"{r.same}/{r.rows}" if r.triton_us is not None else "-"
        lines.append(
            f"{r.rows:>5} {r.vocab:>7} {t:>10} {k:>10} {ratio:>12} {gbs:>7} {same:>10}"
            + (f"  {r.note}" if r.note else "")
        )
    return "\n".join(lines)


def report(device: str, rows: Sequence[int] = ROWS, vocabs: Sequence[int] = VOCABS, replays: int = 20) -> str:
    return format_table(run(device, rows, vocabs, replays))
