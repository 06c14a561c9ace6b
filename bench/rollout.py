"""``fp8rl bench rollout``: generator tokens/s of each precision, same model, prompts and seeds.

One native generator per variant (weights BF16 or FP8 decoder linears; KV cache BF16 or FP8),
each given the same weights (a BF16 trainer's export, quantized for the FP8 generators as a
``fp8-gen`` job's weight sync does), the same prompts and the same sampling seeds. EOS is
disabled, so every variant generates exactly ``prompts x new_tokens`` tokens. The time of a
``generate`` call (prefill + decode, median of ``repeat`` after a warm-up) gives tokens/s; the
ratio is against ``bf16 / KV bf16`` measured in the same run. The ``fp8-gen`` and ``fp8-e2e``
generators are the same engine (they differ in where their FP8 weights come from), so ``fp8``
stands for both.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from bench.common import bench_spec, device_name, pick_device, timed
from workers.engines.factory import build_generator, build_trainer
from workers.engines.protocols import Trainer
from workers.tokenizer import ByteTokenizer

VARIANTS = (("bf16", False), ("bf16", True), ("fp8", False), ("fp8", True))


@dataclass(frozen=True)
class RolloutRow:
    weights: str
    kv_cache: str
    seconds: float
    tokens: int
    kv_bytes: int
    weight_bytes: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def run(
    model: str = "tiny",
    device: str = "auto",
    prompts: int = 64,
    new_tokens: int = 32,
    repeat: int = 3,
) -> tuple[str, list[RolloutRow]]:
    dev = pick_device(device)
    tok = ByteTokenizer()
    texts = [tok.encode(f"Calculate {i % 10} + {i // 10 % 10}. ") for i in range(prompts)]
    trainer = build_trainer(bench_spec(model, "bf16", dev), tok.vocab_size, str(dev))
    rows = [_variant(trainer, model, dev, w, kv, texts, new_tokens, repeat) for w, kv in VARIANTS]
    return device_name(dev), rows


def _variant(
    trainer: Trainer,
    model: str,
    dev: torch.device,
    weights: str,
    fp8_kv: bool,
    texts: list[list[int]],
    new_tokens: int,
    repeat: int,
) -> RolloutRow:
    tok = ByteTokenizer()
    recipe = "fp8-gen" if weights == "fp8" else "bf16"
    spec = bench_spec(model, recipe, dev, precision={"fp8_kv_cache": fp8_kv})
    gen = build_generator(spec, tok.vocab_size, -1, tok.pad_id, str(dev))  # eos -1: never stops
    gen.load_weights(trainer.export_weights(gen.fp8_weight_names()))
    gen.generate(texts, min(new_tokens, 4), 1.0, 1.0, 0)  # warm-up
    times, tokens = [], 0
    for r in range(repeat):
        out, seconds = timed(dev, partial(gen.generate, texts, new_tokens, 1.0, 1.0, r))
        times.append(seconds)
        tokens = int(out.response_mask.sum())
    row = RolloutRow(
        weights, "fp8" if fp8_kv else "bf16", statistics.median(times), tokens,
        gen.kv_cache_bytes, gen.weight_bytes,
    )  # fmt: skip
    if dev.type == "cuda":
        del gen
        torch.cuda.empty_cache()
    return row


def format_table(device: str, rows: list[RolloutRow], model: str) -> str:
    base = rows[0].tokens_per_s
    lines = [
        f"device: {device}   model: {model}",
        f"{'weights':<8} {'kv cache':<9} {'tokens':>8} {'seconds':>9} {'tokens/s':>10} {'vs bf16':>8} "
        f"{'KV MiB':>9} {'weights MiB':>12}",
    ]
    for r in rows:
        lines.append(
            f"{r.weights:<8} {r.kv_cache:<9} {r.tokens:>8} {r.seconds:>9.3f} {r.tokens_per_s:>10.1f} "
            f"{r.tokens_per_s / base:>7.2f}x {r.kv_bytes / 2**20:>9.2f} {r.weight_bytes / 2**20:>12.2f}"
        )
    return "\n".join(lines)


def report(model: str = "tiny", device: str = "auto", **options: Any) -> str:
    """``run`` and ``format_table``: what ``fp8rl bench`` prints."""
    device_, rows = run(model, device, **options)
    return format_table(device_, rows, model)
