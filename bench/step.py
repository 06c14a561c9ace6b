"""``fp8rl bench step``: one RL step of each recipe, split by phase, in one process.

For each recipe a native trainer and a native generator (on the same device) run what the driver
runs in a step, with the same model, prompts and seeds: generation, reward, training (log-probs,
GRPO loss, optimizer step), and the weight sync without its collective: the trainer's export, packed
into buckets and unpacked as a receiver does, then loaded (``bench sync`` times the collective).
The first step is a warm-up; the table shows the median of ``steps`` more. Ratios are against
``bf16`` measured in the same run. On CPU each recipe that allows ``precision.exact`` (``bf16``,
``fp8-e2e``) runs a second time with it (``+exact``), and its last column is the cost of exact
mode: its step time over the same recipe's without it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from bench.common import bench_spec, device_name, pick_device, timed, vocab_size
from rljob.spec import JobSpec
from workers.engines.factory import build_generator, build_trainer
from workers.engines.protocols import Rollouts
from workers.tasks import extract_answer
from workers.tokenizer import ByteTokenizer
from workers.weight_sync import DEFAULT_BUCKET_BYTES, manifest_of, pack, unpack

RECIPES = ("bf16", "fp8-gen", "fp8-e2e")
EXACT_RECIPES = ("bf16", "fp8-e2e")  # the recipes precision.exact allows (fp8-gen can never be exact)
PHASES = ("generation", "reward", "train", "weight_sync")


@dataclass(frozen=True)
class StepRow:
    recipe: str
    seconds: dict[str, float]
    sync_bytes: int
    exact: bool = False

    @property
    def label(self) -> str:
        return self.recipe + ("+exact" if self.exact else "")

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def run(
    model: str = "tiny",
    device: str = "auto",
    prompts: int = 16,
    group_size: int = 8,
    new_tokens: int = 16,
    steps: int = 2,
) -> tuple[str, list[StepRow]]:
    dev = pick_device(device)
    tok = ByteTokenizer()
    problems = [(f"{i % 10} + {i // 10 % 10} =", str(i % 10 + i // 10 % 10)) for i in range(prompts)]
    texts = [tok.encode(q + " ") for q, _ in problems for _ in range(group_size)]
    answers = [a for _, a in problems for _ in range(group_size)]
    rows = []
    for recipe in RECIPES:
        # exact mode is verified on CPU only (the spec refuses it with GPUs)
        modes = (False, True) if recipe in EXACT_RECIPES and dev.type == "cpu" else (False,)
        for exact in modes:
            spec = bench_spec(
                model, recipe, dev,
                rollout={"prompts_per_step": prompts, "group_size": group_size, "max_new_tokens": new_tokens},
                optimizer={"micro_batch_size": 64},
                precision={"exact": exact},
            )  # fmt: skip
            rows.append(
                _recipe(spec, dev, texts, answers, steps, vocab_size(model, ByteTokenizer().vocab_size))
            )
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return device_name(dev), rows


def _recipe(
    spec: JobSpec, dev: torch.device, texts: list[list[int]], answers: list[str], steps: int, vocab: int
) -> StepRow:
    tok = ByteTokenizer()
    trainer = build_trainer(spec, vocab, str(dev))
    gen = build_generator(spec, vocab, tok.eos_ids, tok.pad_id, str(dev))
    names = gen.fp8_weight_names()
    gen.load_weights(trainer.export_weights(names))
    new_tokens = spec.rollout.max_new_tokens

    def score(batch: Rollouts) -> torch.Tensor:
        rows = zip(batch.response_ids, batch.response_mask, strict=True)
        decoded = [tok.decode(r[: int(m.sum())].tolist()) for r, m in rows]
        return torch.tensor([float(extract_answer(d) == a) for d, a in zip(decoded, answers, strict=True)])

    def sync() -> int:
        payload = trainer.export_weights(names)
        manifest = manifest_of(payload)
        buckets = pack(payload, manifest, DEFAULT_BUCKET_BYTES)
        gen.load_weights(unpack(buckets, manifest, DEFAULT_BUCKET_BYTES))
        return sum(b.numel() for b in buckets)

    samples: list[dict[str, float]] = []
    sync_bytes = 0
    for s in range(steps + 1):
        t: dict[str, float] = {}
        batch, t["generation"] = timed(dev, partial(gen.generate, texts, new_tokens, 1.0, 1.0, s))
        rewards, t["reward"] = timed(dev, partial(score, batch))
        _, t["train"] = timed(dev, partial(trainer.train_step, batch, rewards, 1.0))
        sync_bytes, t["weight_sync"] = timed(dev, sync)
        if s > 0:  # the first step warms up kernels, the allocator and the optimizer state
            samples.append(t)
    median = {p: statistics.median(x[p] for x in samples) for p in PHASES}
    return StepRow(spec.precision.recipe, median, sync_bytes, spec.precision.exact)


def format_table(device: str, rows: list[StepRow], model: str) -> str:
    base = rows[0]
    head = " ".join(f"{p + ' s':>14}" for p in PHASES)
    plain = {r.recipe: r for r in rows if not r.exact}
    any_exact = any(r.exact for r in rows)
    lines = [
        f"device: {device}   model: {model}",
        f"{'recipe':<14} {head} {'step s':>9} {'vs bf16':>8} {'sync MiB':>9}"
        + (f" {'exact cost':>10}" if any_exact else ""),
    ]
    for r in rows:
        cells = " ".join(f"{r.seconds[p]:>14.4f}" for p in PHASES)
        ratio = base.total / r.total
        cost = f" {r.total / plain[r.recipe].total:>9.2f}x" if r.exact else ""
        lines.append(
            f"{r.label:<14} {cells} {r.total:>9.4f} {ratio:>7.2f}x {r.sync_bytes / 2**20:>9.2f}{cost}"
        )
    lines.append("vs bf16: bf16 step time / this recipe's (above 1: faster than bf16)")
    if any_exact:
        lines.append(
            "exact cost: step time with precision.exact / the same recipe's without (above 1: slower)"
        )
    return "\n".join(lines)


def report(model: str = "tiny", device: str = "auto", **options: Any) -> str:
    """``run`` and ``format_table``: what ``fp8rl bench`` prints."""
    device_, rows = run(model, device, **options)
    return format_table(device_, rows, model)
