"""``fp8rl bench step``: one RL step of each recipe, split by phase, in one process.

For each recipe a native trainer and a native generator (on the same device) run what the driver
runs in a step, with the same model, prompts and seeds: generation, reward, training (log-probs,
GRPO loss, optimizer step), and the weight sync without its collective: the trainer's export, packed
into buckets and unpacked as a receiver does, then loaded (``bench sync`` times the collective).
The first step is a warm-up; the table shows the median of ``steps`` more. Ratios are against
``bf16`` measured in the same run. On CPU each recipe that allows ``precision.exact`` (``bf16``,
``fp8-e2e``) runs a second time with it (``+exact``), and its last column is the cost of exact
mode: its step time over the same recipe's without it.

``--model smollm2`` (or a Hugging Face directory) runs a real model on the job of
``examples/smollm2-addition.yaml`` (its tokenizer, chat prompts, reward and batch shape), recipes
``bf16`` and ``fp8-e2e``, and plain ``transformers`` on the same batch (:mod:`bench.hf_baseline`):
the ratios of the targets (native training and generation tokens/s against it, fp8-e2e's
training time against bf16's), by wall time and by the process's CPU time. Progress lines go to
stderr (a real-model run takes minutes on a CPU).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from bench import hf_baseline
from bench.common import bench_spec, device_name, pick_device, real_model_dir, real_spec, timed, vocab_size
from rljob.spec import JobSpec
from workers.engines.factory import build_generator, build_trainer
from workers.engines.protocols import Rollouts
from workers.models.tokenizer import ByteTokenizer, build_tokenizer
from workers.tasks import Task, extract_answer
from workers.weight_sync.broadcast import DEFAULT_BUCKET_BYTES, manifest_of, pack, unpack

T = TypeVar("T")

RECIPES = ("bf16", "fp8-gen", "fp8-e2e")
EXACT_RECIPES = ("bf16", "fp8-e2e")  # the recipes precision.exact allows (fp8-gen can never be exact)
PHASES = ("generation", "reward", "train", "weight_sync")
POW2 = "pow2"  # a recipe's variant with power-of-two scales (on CPU: FP8 GEMMs in BF16, workers.fp8.matmul)
FP8KV = "fp8kv"  # a recipe's variant with the FP8 (E4M3) KV cache (precision.fp8_kv_cache)
VARIANTS = (POW2, FP8KV)
# a real model's example batch (examples/smollm2-addition.yaml): 8 prompts x 8 samples, 12 tokens
REAL_SHAPE = {"prompts": 8, "group_size": 8, "new_tokens": 12}
PRESET_SHAPE = {"prompts": 16, "group_size": 8, "new_tokens": 16}


@dataclass(frozen=True)
class StepRow:
    recipe: str
    seconds: dict[str, float]
    sync_bytes: int
    exact: bool = False
    gen_tokens: float = 0.0  # response tokens generated (median step)
    train_tokens: float = 0.0  # tokens trained on: every sequence's prompt + response
    # process CPU seconds (all threads) of each phase, median: on a shared machine, what the other
    # processes' load changes least (wall time waits for them, CPU time mostly does not)
    cpu_seconds: dict[str, float] | None = None
    prefill_s: float = 0.0  # a one-token generation of the same prompts (the prefill and first token)
    decode_steps: int = 0  # token steps after the first in the median step's generation

    @property
    def label(self) -> str:
        return self.recipe + ("+exact" if self.exact else "")

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def decode_ms(self) -> float | None:
        """One decode step: the generation less its prefill, over the steps after the first token."""
        if self.decode_steps <= 0:
            return None
        return (self.seconds["generation"] - self.prefill_s) / self.decode_steps * 1000.0


@dataclass(frozen=True)
class Baseline:
    """Plain ``transformers`` on the same batch (:mod:`bench.hf_baseline`), median seconds."""

    train_s: float
    train_tokens: float
    generate_s: float
    gen_tokens: float
    train_cpu_s: float
    generate_cpu_s: float


@dataclass
class Workload:
    """What every recipe of one run shares: tokenizer, prompt token ids, and the reward."""

    tok: Any
    texts: list[list[int]]
    score: Callable[[list[str]], torch.Tensor]
    vocab: int


def _preset_workload(model: str, prompts: int, group_size: int) -> Workload:
    tok = ByteTokenizer()
    problems = [(f"{i % 10} + {i // 10 % 10} =", str(i % 10 + i // 10 % 10)) for i in range(prompts)]
    texts = [tok.encode(q + " ") for q, _ in problems for _ in range(group_size)]
    answers = [a for _, a in problems for _ in range(group_size)]

    def score(decoded: list[str]) -> torch.Tensor:
        return torch.tensor([float(extract_answer(d) == a) for d, a in zip(decoded, answers, strict=True)])

    return Workload(tok, texts, score, vocab_size(model, tok.vocab_size))


def _real_workload(spec: JobSpec, prompts: int, group_size: int) -> Workload:
    """The example's task on the real model: chat prompts of step 0, scored by the task."""
    tok = build_tokenizer(spec)
    task = Task.for_job(spec, tok)
    problems = [p for p in task.sample(0, prompts, spec.rollout.seed) for _ in range(group_size)]
    texts = [tok.encode(task.prompt(p)) for p in problems]

    def score(decoded: list[str]) -> torch.Tensor:
        return torch.tensor([task.score(d, p) for d, p in zip(decoded, problems, strict=True)])

    return Workload(tok, texts, score, tok.vocab_size)


def run(
    model: str = "tiny",
    device: str = "auto",
    prompts: int | None = None,
    group_size: int | None = None,
    new_tokens: int | None = None,
    steps: int = 2,
    recipes: tuple[str, ...] | None = None,
    baseline: bool | None = None,
    progress: Callable[[str], None] = lambda _: None,
    kv_caches: tuple[str, ...] = ("bf16",),
    interleave: bool = False,
) -> tuple[str, list[StepRow], Baseline | None]:
    """Every recipe of ``recipes`` (default: all three for a preset, ``bf16`` and ``fp8-e2e`` for
    a real model), plus on CPU for a preset the ``precision.exact`` variants; with ``baseline``
    (default: for a real model) plain ``transformers`` on the ``bf16`` recipe's last batch. With
    ``interleave`` every recipe is built first and their steps run in turn (step 0 of each, then
    step 1 of each, ...), so that a machine whose speed drifts slows every recipe alike."""
    dev = pick_device(device)
    path = real_model_dir(model)
    shape = REAL_SHAPE if path is not None else PRESET_SHAPE
    prompts = prompts or shape["prompts"]
    group_size = group_size or shape["group_size"]
    new_tokens = new_tokens or shape["new_tokens"]
    recipes = recipes or (("bf16", "fp8-e2e") if path is not None else RECIPES)
    for r in recipes:
        kind, *variants = r.split("+")
        if kind not in RECIPES or (variants and kind == "bf16") or set(variants) - set(VARIANTS):
            raise ValueError(
                f"--recipes: {r!r} is not a recipe; choose from {', '.join(RECIPES)}, or an FP8 one "
                f"with +{POW2} (power-of-two scales: precision.power_of_two_scales) and/or +{FP8KV} "
                "(the E4M3 KV cache: precision.fp8_kv_cache)"
            )
    if not kv_caches or set(kv_caches) - {"bf16", "fp8"}:
        raise ValueError(f"--kv-cache {','.join(kv_caches)}: bf16, fp8 or bf16,fp8")
    # each FP8 recipe once per KV cache asked for (bf16 keeps its BF16 cache)
    recipes = tuple(
        r + (f"+{FP8KV}" if kv == "fp8" and FP8KV not in r.split("+") else "")
        for r in recipes
        for kv in (kv_caches if r != "bf16" else ("bf16",))
    )
    recipes = tuple(dict.fromkeys(recipes))
    baseline = path is not None if baseline is None else baseline
    if baseline and (path is None or "bf16" not in recipes):
        raise ValueError("--baseline needs a real model (--model smollm2 or a directory) and the bf16 recipe")
    rollout = {"prompts_per_step": prompts, "group_size": group_size, "max_new_tokens": new_tokens}

    def make_spec(recipe: str, exact: bool) -> JobSpec:
        kind, *variants = recipe.split("+")
        precision = {
            "exact": exact,
            "power_of_two_scales": POW2 in variants,
            "fp8_kv_cache": FP8KV in variants,
        }
        extra: dict[str, Any] = {
            "rollout": rollout, "optimizer": {"micro_batch_size": 64}, "precision": precision
        }  # fmt: skip
        if path is not None:
            return real_spec(path, kind, dev, **extra)
        return bench_spec(model, kind, dev, **extra)

    first = make_spec(recipes[0], False)
    work = (
        _real_workload(first, prompts, group_size)
        if path is not None
        else _preset_workload(model, prompts, group_size)
    )
    # exact mode is verified on CPU only (the spec refuses it with GPUs); its attention
    # materializes [B, H, q, T, D] products, a mode for the tiny presets
    plan = [
        (recipe, exact)
        for recipe in recipes
        for exact in (
            (False, True) if recipe in EXACT_RECIPES and dev.type == "cpu" and path is None else (False,)
        )
    ]
    rows, last_bf16 = [], None
    if interleave:  # every recipe built first, then step by step in turn: drift reaches all alike
        runners = [_Runner(make_spec(recipe, exact), dev, work, progress) for recipe, exact in plan]
        for s in range(steps + 1):
            for runner in runners:
                runner.step(s)
        finished = [runner.finish(steps) for runner in runners]
    else:
        finished = []
        for recipe, exact in plan:
            runner = _Runner(make_spec(recipe, exact), dev, work, progress)
            for s in range(steps + 1):
                runner.step(s)
            finished.append(runner.finish(steps))
            del runner
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    for (recipe, exact), (row, batch) in zip(plan, finished, strict=True):
        rows.append(row)
        if recipe == "bf16" and not exact:
            last_bf16 = batch
    base = None
    if baseline:
        assert path is not None and last_bf16 is not None
        base = _baseline(path, work, last_bf16, new_tokens, steps, progress)
    return device_name(dev), rows, base


class _Runner:
    """One recipe's trainer and generator, stepped as the driver steps them; ``finish`` makes its row."""

    def __init__(
        self, spec: JobSpec, dev: torch.device, work: Workload, progress: Callable[[str], None]
    ) -> None:
        self.spec, self.dev, self.work, self.progress = spec, dev, work, progress
        tok = work.tok
        self.trainer = build_trainer(spec, work.vocab, str(dev))
        self.gen = build_generator(spec, work.vocab, tok.eos_ids, tok.pad_id, str(dev))
        self.names = self.gen.fp8_weight_names()
        self.gen.load_weights(self.trainer.export_weights(self.names))
        self.samples: list[dict[str, float]] = []
        self.cpu: list[dict[str, float]] = []
        self.gen_tokens: list[float] = []
        self.sync_bytes = 0
        self.batch: Rollouts | None = None

    def _score(self, batch: Rollouts) -> torch.Tensor:
        rows = zip(batch.response_ids, batch.response_mask, strict=True)
        return self.work.score([self.work.tok.decode(r[: int(m.sum())].tolist()) for r, m in rows])

    def _sync(self) -> int:
        payload = self.trainer.export_weights(self.names)
        manifest = manifest_of(payload)
        buckets = pack(payload, manifest, DEFAULT_BUCKET_BYTES)
        self.gen.load_weights(unpack(buckets, manifest, DEFAULT_BUCKET_BYTES))
        return sum(b.numel() for b in buckets)

    def step(self, s: int) -> None:
        """Step ``s``: generation, reward, training, weight sync; step 0 warms up (not counted)."""
        dev, t, c = self.dev, {}, {}
        new_tokens = self.spec.rollout.max_new_tokens
        batch, t["generation"], c["generation"] = _clocked(
            dev, partial(self.gen.generate, self.work.texts, new_tokens, 1.0, 1.0, s)
        )
        rewards, t["reward"], c["reward"] = _clocked(dev, partial(self._score, batch))
        _, t["train"], c["train"] = _clocked(dev, partial(self.trainer.train_step, batch, rewards, 1.0))
        self.sync_bytes, t["weight_sync"], c["weight_sync"] = _clocked(dev, self._sync)
        label = _name(self.spec) + ("+exact" if self.spec.precision.exact else "")
        self.progress(f"{label} step {s}: " + ", ".join(f"{p} {t[p]:.2f} s" for p in PHASES))
        self.batch = batch
        if s > 0:  # the first step warms up kernels, the allocator and the optimizer state
            self.samples.append(t)
            self.cpu.append(c)
            self.gen_tokens.append(float(batch.response_mask.sum()))

    def finish(self, steps: int) -> tuple[StepRow, Rollouts]:
        """The median step's row, with the prefill: a one-token generation of the same prompts
        (once to warm up, e.g. a graph's capture, then timed)."""
        assert self.batch is not None, "finish() before any step"
        batch, gen = self.batch, self.gen
        one = [
            _clocked(self.dev, partial(gen.generate, self.work.texts, 1, 1.0, 1.0, steps + 1 + i))[1]
            for i in range(2)
        ]
        median = {p: statistics.median(x[p] for x in self.samples) for p in PHASES}
        train_tokens = float(batch.prompt_mask.sum() + batch.response_mask.sum())
        cpu_median = {p: statistics.median(x[p] for x in self.cpu) for p in PHASES}
        row = StepRow(
            _name(self.spec), median, self.sync_bytes, self.spec.precision.exact,
            statistics.median(self.gen_tokens), train_tokens, cpu_median,
            prefill_s=one[1], decode_steps=max(0, int(batch.response_ids.shape[1]) - 1),
        )  # fmt: skip
        return row, batch


def _name(spec: JobSpec) -> str:
    """The recipe as ``--recipes`` names it: ``fp8-e2e+pow2`` with power-of-two scales."""
    pow2 = f"+{POW2}" if spec.precision.power_of_two_scales else ""
    return spec.precision.recipe + pow2 + (f"+{FP8KV}" if spec.precision.fp8_kv_cache else "")


def _clocked(dev: torch.device, fn: Callable[[], T]) -> tuple[T, float, float]:
    """``fn()``, its wall seconds (:func:`timed`) and the process's CPU seconds in it."""
    cpu = time.process_time()
    out, wall = timed(dev, fn)
    return out, wall, time.process_time() - cpu


def _baseline(
    path: Path, work: Workload, batch: Rollouts, new_tokens: int, steps: int, progress: Callable[[str], None]
) -> Baseline:
    """Plain ``transformers`` (:mod:`bench.hf_baseline`) on ``batch`` (training) and on the same
    prompts (generation): one warm-up, then the median of ``steps``."""
    cpu = torch.device("cpu")
    model = hf_baseline.load(path, torch.float32)
    train = [_clocked(cpu, partial(hf_baseline.train_pass, model, batch)) for _ in range(steps + 1)][1:]
    progress(f"transformers train: {', '.join(f'{t[1]:.2f} s' for t in train)}")
    del model
    model = hf_baseline.load(path, torch.bfloat16)
    tok = work.tok
    generate = partial(hf_baseline.generate, model, work.texts, new_tokens, tok.eos_ids, tok.pad_id)
    gens = [_clocked(cpu, partial(generate, s)) for s in range(steps + 1)][1:]
    progress(f"transformers generate: {', '.join(f'{g[1]:.2f} s' for g in gens)}")
    return Baseline(
        train_s=statistics.median(t[1] for t in train),
        train_tokens=float(batch.prompt_mask.sum() + batch.response_mask.sum()),
        generate_s=statistics.median(g[1] for g in gens),
        gen_tokens=statistics.median(float(g[0]) for g in gens),
        train_cpu_s=statistics.median(t[2] for t in train),
        generate_cpu_s=statistics.median(g[2] for g in gens),
    )


def format_table(device: str, rows: list[StepRow], model: str, base: Baseline | None = None) -> str:
    first = rows[0]
    head = " ".join(f"{p + ' s':>14}" for p in PHASES)
    plain = {r.recipe: r for r in rows if not r.exact}
    any_exact = any(r.exact for r in rows)
    lines = [
        f"device: {device}   model: {model}",
        f"{'recipe':<20} {head} {'step s':>9} {'vs ' + first.recipe:>11} {'sync MiB':>9} {'prefill s':>9} "
        f"{'decode ms':>9}" + (f" {'exact cost':>10}" if any_exact else ""),
    ]
    for r in rows:
        cells = " ".join(f"{r.seconds[p]:>14.4f}" for p in PHASES)
        ratio = first.total / r.total
        cost = f" {r.total / plain[r.recipe].total:>9.2f}x" if r.exact else ""
        decode = f"{r.decode_ms:>9.3f}" if r.decode_ms is not None else f"{'-':>9}"
        lines.append(
            f"{r.label:<20} {cells} {r.total:>9.4f} {ratio:>10.2f}x {r.sync_bytes / 2**20:>9.2f} "
            f"{r.prefill_s:>9.4f} {decode}{cost}"
        )
    lines.append(f"vs {first.recipe}: {first.recipe} step time / this recipe's (above 1: faster)")
    lines.append(
        "prefill s: a one-token generation of the same prompts; decode ms: (generation - prefill) "
        "over the token steps after the first"
    )
    if any_exact:
        lines.append(
            "exact cost: step time with precision.exact / the same recipe's without (above 1: slower)"
        )
    if base is not None:
        lines += _baseline_lines(plain, base)
    return "\n".join(lines)


def _baseline_lines(plain: dict[str, StepRow], base: Baseline) -> list[str]:
    """The targets' ratios, by wall time and by CPU time (the process's, all threads): native
    against plain transformers, and fp8-e2e's training time against bf16's."""
    bf16 = plain["bf16"]
    bc = bf16.cpu_seconds or bf16.seconds

    def rate(tokens: float, wall: float, cpu: float) -> str:
        return f"{tokens / wall:>9.1f} {tokens / cpu:>8.1f}"

    lines = [
        "",
        f"{'against plain transformers (same batch and threads)':<48} {'native tok/s':>18} "
        f"{'transformers tok/s':>18} {'ratio':>7} {'cpu ratio':>9}",
        f"{'':<48} {'wall':>9} {'cpu':>8} {'wall':>9} {'cpu':>8}",
        f"{'train: bf16 vs float32 log-probs + fwd/bwd':<48} "
        f"{rate(bf16.train_tokens, bf16.seconds['train'], bc['train'])} "
        f"{rate(base.train_tokens, base.train_s, base.train_cpu_s)} "
        f"{base.train_s / bf16.seconds['train']:>6.2f}x {base.train_cpu_s / bc['train']:>8.2f}x",
        f"{'generation: bf16 vs generate() in bf16':<48} "
        f"{rate(bf16.gen_tokens, bf16.seconds['generation'], bc['generation'])} "
        f"{rate(base.gen_tokens, base.generate_s, base.generate_cpu_s)} "
        f"{(bf16.gen_tokens / bf16.seconds['generation']) / (base.gen_tokens / base.generate_s):>6.2f}x "
        f"{(bf16.gen_tokens / bc['generation']) / (base.gen_tokens / base.generate_cpu_s):>8.2f}x",
    ]
    for name in ("fp8-e2e", f"fp8-e2e+{POW2}"):
        if name not in plain:
            continue
        e2e = plain[name]
        ec = e2e.cpu_seconds or e2e.seconds
        lines.append(
            f"{'train seconds: ' + name + ' / bf16':<48} {e2e.seconds['train']:>9.2f} {ec['train']:>8.2f} "
            f"{bf16.seconds['train']:>9.2f} {bc['train']:>8.2f} "
            f"{e2e.seconds['train'] / bf16.seconds['train']:>6.2f}x {ec['train'] / bc['train']:>8.2f}x"
        )
    lines.append(
        "ratio: native tokens/s over transformers' (train: same tokens, so seconds inverted); "
        "fp8-e2e lines: their seconds over bf16's (target: at most 1.6)"
    )
    return lines


def report(model: str = "tiny", device: str = "auto", **options: Any) -> str:
    """``run`` and ``format_table``: what ``fp8rl bench`` prints."""
    device_, rows, base = run(model, device, **options)
    return format_table(device_, rows, model, base)
