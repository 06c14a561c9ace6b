"""``fp8rl bench rollout``: generator tokens/s of each precision, same model, prompts and seeds.

One native generator per variant (weights BF16 or FP8 decoder linears; KV cache BF16 or FP8),
each given the same weights (a BF16 trainer's export, quantized for the FP8 generators as a
``fp8-gen`` job's weight sync does), the same prompts and the same sampling seeds. EOS is
disabled, so every variant generates exactly ``prompts x new_tokens`` tokens. The time of a
``generate`` call (prefill + decode, median of ``repeat`` after a warm-up) gives tokens/s; the
ratio is against ``bf16 / KV bf16`` measured in the same run. The ``fp8-gen`` and ``fp8-e2e``
generators are the same engine (they differ in where their FP8 weights come from), so ``fp8``
stands for both.

``decodes`` picks the decode loops (``rollout.decode``): ``eager`` (one Python-issued forward per
token; the CPU path) and, on CUDA, ``graph`` (a static KV cache, one CUDA-graph replay per token)
and ``graph-triton`` (the same with the Triton decode attention, ``FP8RL_DECODE_ATTENTION=triton``).
Each variant's ratio is against BF16 weights and BF16 KV with the same decode loop; with both
loops, ``graph/eager`` compares each variant with its own eager run. The warm-up call has the
timed calls' shape, so a graph is captured before the timing starts.

Decode apart from prefill: each variant also times a call of one new token (the prefill, the KV
scales' calibration of an FP8 cache, the first sample; its own warm-up first), and ``decode ms``
is ``(seconds - that) / (new_tokens - 1)``: the time of one decode step of the whole batch.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from bench.common import bench_spec, device_name, pick_device, timed, vocab_size
from workers.engines.factory import build_generator, build_trainer
from workers.engines.protocols import Trainer
from workers.models.tokenizer import ByteTokenizer

VARIANTS = (("bf16", False), ("bf16", True), ("fp8", False), ("fp8", True))
DECODES = ("eager", "graph", "graph-triton")  # graph-triton: FP8RL_DECODE_ATTENTION=triton


@dataclass(frozen=True)
class RolloutRow:
    weights: str
    kv_cache: str
    decode: str
    seconds: float
    tokens: int
    kv_bytes: int
    weight_bytes: int
    vocab: int
    new_tokens: int = 0  # per sequence
    prefill_seconds: float = float("nan")  # a call of one new token (module docstring)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_ms(self) -> float:
        """Milliseconds per decode step of the batch, prefill left out (NaN below 2 new tokens)."""
        if self.new_tokens < 2:
            return float("nan")
        return (self.seconds - self.prefill_seconds) / (self.new_tokens - 1) * 1e3


def run(
    model: str = "tiny",
    device: str = "auto",
    prompts: int = 64,
    new_tokens: int = 32,
    repeat: int = 3,
    decodes: tuple[str, ...] | None = None,
    kv_caches: tuple[str, ...] = ("bf16", "fp8"),
    variants: tuple[str, ...] | None = None,
) -> tuple[str, list[RolloutRow]]:
    """``variants`` (``WEIGHTS/KV`` pairs, e.g. ``bf16/bf16,fp8/fp8``) picks variants directly,
    in place of every weight with each of ``kv_caches``."""
    dev = pick_device(device)
    decodes = decodes or (("eager", "graph") if dev.type == "cuda" else ("eager",))
    bad = [d for d in decodes if d not in DECODES]
    if bad:
        raise ValueError(f"--decode {','.join(bad)}: choose from {', '.join(DECODES)}")
    if set(decodes) - {"eager"} and dev.type != "cuda":
        raise ValueError("--decode graph needs a CUDA GPU (CUDA graphs); use --decode eager on CPU")
    if not kv_caches or set(kv_caches) - {"bf16", "fp8"}:
        raise ValueError(f"--kv-cache {','.join(kv_caches)}: choose from bf16, fp8")
    chosen = (
        parse_variants(variants)
        if variants is not None
        else {(w, kv) for w, kv in VARIANTS if ("fp8" if kv else "bf16") in kv_caches}
    )
    tok = ByteTokenizer()
    texts = [tok.encode(f"Calculate {i % 10} + {i // 10 % 10}. ") for i in range(prompts)]
    trainer = build_trainer(bench_spec(model, "bf16", dev), vocab_size(model, tok.vocab_size), str(dev))
    plan = [
        (w, kv, d)
        for w, kv in VARIANTS
        if (w, kv) in chosen
        for d in decodes  # interleaved: each variant's loops back to back
    ]
    rows = []
    for i, (w, kv, d) in enumerate(plan, 1):
        r = _variant(trainer, model, dev, w, kv, d, texts, new_tokens, repeat)
        rows.append(r)
        # progress on stderr, so that a run cut short (a GPU lease) still shows what it measured
        print(
            f"[{i}/{len(plan)}] weights {r.weights}, KV {r.kv_cache}, {r.decode}: "
            f"{r.tokens_per_s:.1f} tokens/s ({r.seconds:.3f} s)",
            file=sys.stderr,
            flush=True,
        )
    return device_name(dev), rows


def parse_variants(variants: tuple[str, ...]) -> set[tuple[str, bool]]:
    """``("bf16/bf16", "fp8/fp8")`` -> ``{("bf16", False), ("fp8", True)}``, each checked."""
    names = {f"{w}/{'fp8' if kv else 'bf16'}": (w, kv) for w, kv in VARIANTS}
    bad = [v for v in variants if v not in names]
    if bad or not variants:
        choices = ", ".join(names)
        given = ",".join(variants)
        raise ValueError(f"--variants {given}: give WEIGHTS/KV pairs, comma-separated, from {choices}")
    return {names[v] for v in variants}


def _variant(
    trainer: Trainer,
    model: str,
    dev: torch.device,
    weights: str,
    fp8_kv: bool,
    decode: str,
    texts: list[list[int]],
    new_tokens: int,
    repeat: int,
) -> RolloutRow:
    tok = ByteTokenizer()
    recipe = "fp8-gen" if weights == "fp8" else "bf16"
    loop = "eager" if decode == "eager" else "graph"
    positions = max(1024, max(map(len, texts)) + new_tokens)  # the longest sequence generated
    spec = bench_spec(
        model, recipe, dev, positions, precision={"fp8_kv_cache": fp8_kv}, rollout={"decode": loop}
    )
    vocab = vocab_size(model, tok.vocab_size)
    attention = "triton" if decode == "graph-triton" else "sdpa"
    with _env("FP8RL_DECODE_ATTENTION", attention):  # read when the generator is built
        gen = build_generator(spec, vocab, -1, tok.pad_id, str(dev))  # eos -1: never stops
    gen.load_weights(trainer.export_weights(gen.fp8_weight_names()))
    gen.generate(texts, new_tokens, 1.0, 1.0, 0)  # warm-up (and the graph's capture)
    times, tokens = [], 0
    for r in range(repeat):
        out, seconds = timed(dev, partial(gen.generate, texts, new_tokens, 1.0, 1.0, r))
        times.append(seconds)
        tokens = int(out.response_mask.sum())
    kv_bytes = gen.kv_cache_bytes  # of the full-length calls
    gen.generate(texts, 1, 1.0, 1.0, 0)  # warm-up of the one-token call (its own graph)
    prefill = [timed(dev, partial(gen.generate, texts, 1, 1.0, 1.0, r))[1] for r in range(repeat)]
    row = RolloutRow(
        weights, "fp8" if fp8_kv else "bf16", decode, statistics.median(times), tokens,
        kv_bytes, gen.weight_bytes, vocab, new_tokens, statistics.median(prefill),
    )  # fmt: skip
    if dev.type == "cuda":
        del gen
        torch.cuda.empty_cache()
    return row


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


def format_table(device: str, rows: list[RolloutRow], model: str) -> str:
    """``vs bf16``: against BF16 weights and KV with the same decode loop; ``graph/eager``: a graph
    row against the same variant's eager row; ``decode ms``: one decode step, prefill left out,
    and ``decode vs bf16`` its ratio to BF16's (above 1: faster)."""
    base = {r.decode: r.tokens_per_s for r in rows if (r.weights, r.kv_cache) == ("bf16", "bf16")}
    base_decode = {r.decode: r.decode_ms for r in rows if (r.weights, r.kv_cache) == ("bf16", "bf16")}
    eager = {(r.weights, r.kv_cache): r.tokens_per_s for r in rows if r.decode == "eager"}
    lines = [
        f"device: {device}   model: {model} (vocabulary {rows[0].vocab if rows else '-'})",
        f"{'weights':<8} {'kv cache':<9} {'decode':<12} {'tokens':>8} {'seconds':>9} {'tokens/s':>10} "
        f"{'vs bf16':>8} {'graph/eager':>12} {'KV MiB':>9} {'weights MiB':>12} {'decode ms':>10} "
        f"{'decode vs bf16':>15}",
    ]
    for r in rows:
        vs = f"{r.tokens_per_s / base[r.decode]:>7.2f}x" if r.decode in base else f"{'-':>8}"
        e = eager.get((r.weights, r.kv_cache))
        ge = f"{r.tokens_per_s / e:>11.2f}x" if r.decode != "eager" and e else f"{'-':>12}"
        d = base_decode.get(r.decode, float("nan")) / r.decode_ms if r.decode_ms > 0 else float("nan")
        dvs = f"{d:>14.2f}x" if d == d else f"{'-':>15}"  # NaN: no decode time
        lines.append(
            f"{r.weights:<8} {r.kv_cache:<9} {r.decode:<12} {r.tokens:>8} {r.seconds:>9.3f} "
            f"{r.tokens_per_s:>10.1f} {vs} {ge} {r.kv_bytes / 2**20:>9.2f} {r.weight_bytes / 2**20:>12.2f} "
            f"{r.decode_ms:>10.3f} {dvs}"
        )
    return "\n".join(lines)


def report(model: str = "tiny", device: str = "auto", **options: Any) -> str:
    """``run`` and ``format_table``: what ``fp8rl bench`` prints."""
    device_, rows = run(model, device, **options)
    return format_table(device_, rows, model)
