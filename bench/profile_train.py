"""``fp8rl bench profile-train``: where one training step's time goes, kernel by kernel, per recipe.

For each recipe a native trainer (the preset model, random init) trains one step on the same
synthetic batch (``sequences`` rows of ``prompt_tokens`` + ``new_tokens`` tokens, every response
token sampled; the batch shape of ``bench step``), once to warm up and once under
``torch.profiler``. On CUDA each kernel's GPU time is read (CUDA activity only: no CPU-side
events, so the profiler adds little); on a CPU each operator's own time. The report gives per
recipe the step's wall time, the summed kernel time (far below wall: the GPU waits for the host)
and the top kernels; then, against the first recipe, the kernels that make up the difference,
largest first, until they name ``cover`` of it: where FP8 training spends what BF16 does not.
The profiled step is not a timing (the profiler adds its own cost); ``bench step`` times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile

from bench.common import bench_spec, device_name, pick_device, timed, vocab_size
from workers.engines.factory import build_trainer
from workers.engines.protocols import Rollouts
from workers.models.tokenizer import ByteTokenizer

NAME_WIDTH = 96  # kernel names are long C++ templates; the head tells them apart


@dataclass(frozen=True)
class Kernel:
    name: str
    calls: int
    ms: float  # own time on the device (CUDA) or the host (CPU), summed over calls


@dataclass(frozen=True)
class Profile:
    recipe: str
    wall_ms: float  # the profiled step, end to end
    kernels: tuple[Kernel, ...]  # largest first

    @property
    def total_ms(self) -> float:
        return sum(k.ms for k in self.kernels)


def synthetic_batch(
    sequences: int, prompt_tokens: int, new_tokens: int, vocab: int, seed: int = 0
) -> Rollouts:
    """A fixed batch: random tokens, every response token sampled, the generator's log-probs at
    ``log(1/vocab)`` (a uniform sampler; the loss's values do not change its kernels)."""
    if min(sequences, prompt_tokens, new_tokens) <= 0:
        raise ValueError(
            f"--sequences {sequences} / --prompt-tokens {prompt_tokens} / --new-tokens {new_tokens}: "
            "each must be a positive number"
        )
    g = torch.Generator().manual_seed(seed)
    logp = torch.full((sequences, new_tokens), -torch.log(torch.tensor(float(vocab))).item())
    return Rollouts(
        torch.randint(0, vocab, (sequences, prompt_tokens), generator=g),
        torch.ones(sequences, prompt_tokens, dtype=torch.int64),
        torch.randint(0, vocab, (sequences, new_tokens), generator=g),
        torch.ones(sequences, new_tokens, dtype=torch.float32),
        logp,
    )


def kernels_of(events: list[tuple[str, int, float]]) -> tuple[Kernel, ...]:
    """``(name, calls, microseconds)`` rows merged by name, largest time first."""
    merged: dict[str, list[float]] = {}
    for name, calls, us in events:
        row = merged.setdefault(name, [0, 0.0])
        row[0] += calls
        row[1] += us
    rows = (Kernel(n, int(c), us / 1000.0) for n, (c, us) in merged.items())
    return tuple(sorted(rows, key=lambda k: (-k.ms, k.name)))


def difference(base: Profile, other: Profile, cover: float) -> tuple[list[tuple[str, float, float]], float]:
    """The kernels whose time differs most between ``other`` and ``base``, ``(name, base ms,
    other ms)``, taken by size of the change until they hold ``cover`` of all the change (the sum
    of every kernel's ``|other - base|``: a kernel that got faster offsets one that got slower,
    so both are named), and the share they hold."""
    if not 0.0 < cover <= 1.0:
        raise ValueError(f"--cover {cover}: a fraction in (0, 1]")
    a = {k.name: k.ms for k in base.kernels}
    b = {k.name: k.ms for k in other.kernels}
    changes = sorted(
        ((n, a.get(n, 0.0), b.get(n, 0.0)) for n in a.keys() | b.keys()), key=lambda r: -abs(r[2] - r[1])
    )
    moved = sum(abs(new - old) for _, old, new in changes)
    picked: list[tuple[str, float, float]] = []
    named = 0.0
    for row in changes:
        if named >= cover * moved:
            break
        picked.append(row)
        named += abs(row[2] - row[1])
    return picked, (named / moved if moved else 1.0)


def profile_recipe(
    recipe: str, model: str, dev: torch.device, batch: Rollouts, group_size: int, micro_batch: int
) -> Profile:
    n, new_tokens = batch.response_ids.shape
    rollout = {"prompts_per_step": n // group_size, "group_size": group_size, "max_new_tokens": new_tokens}
    spec = bench_spec(model, recipe, dev, rollout=rollout, optimizer={"micro_batch_size": micro_batch})
    trainer = build_trainer(spec, vocab_size(model, ByteTokenizer().vocab_size), str(dev))
    rewards = torch.arange(n, dtype=torch.float32) % group_size  # every group's rewards differ
    step = partial(trainer.train_step, batch, rewards, 1.0)
    step()  # warm-up: kernels, the allocator, the optimizer state
    cuda = dev.type == "cuda"
    # on CUDA the host's operators are recorded too (they tie each kernel to its launch); only
    # the kernels' own GPU time is read
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        _, seconds = timed(dev, step)
    rows = []
    for e in prof.key_averages():
        on_device = e.device_type == DeviceType.CUDA
        if cuda and on_device and e.self_device_time_total > 0:
            rows.append((e.key[:NAME_WIDTH], e.count, float(e.self_device_time_total)))
        elif not cuda and not on_device and e.self_cpu_time_total > 0:
            rows.append((e.key[:NAME_WIDTH], e.count, float(e.self_cpu_time_total)))
    del trainer, step
    if cuda:
        torch.cuda.empty_cache()
    return Profile(recipe, seconds * 1000.0, kernels_of(rows))


def run(
    model: str = "tiny",
    device: str = "auto",
    recipes: tuple[str, ...] = ("bf16", "fp8-e2e"),
    sequences: int = 512,
    prompt_tokens: int = 16,
    new_tokens: int = 64,
    group_size: int = 8,
    micro_batch: int = 64,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[str, list[Profile]]:
    dev = pick_device(device)
    if micro_batch <= 0:
        raise ValueError(f"--micro-batch {micro_batch}: a positive number of sequences")
    if group_size <= 0 or sequences % group_size:
        raise ValueError(
            f"--sequences {sequences} / --group-size {group_size}: the sequences must be whole groups "
            "(a positive group size that divides them)"
        )
    vocab = vocab_size(model, ByteTokenizer().vocab_size)
    batch = synthetic_batch(sequences, prompt_tokens, new_tokens, vocab)
    out = []
    for recipe in recipes:
        out.append(profile_recipe(recipe, model, dev, batch, group_size, micro_batch))
        progress(f"{recipe}: {out[-1].wall_ms:.1f} ms wall, {out[-1].total_ms:.1f} ms in kernels")
    return device_name(dev), out


def format_report(device: str, model: str, profiles: list[Profile], top: int, cover: float) -> str:
    lines = [f"device: {device}   model: {model}   one training step, profiled"]
    for p in profiles:
        lines += [
            "",
            f"{p.recipe}: {p.wall_ms:.1f} ms wall, {p.total_ms:.1f} ms in {sum(k.calls for k in p.kernels)} "
            f"kernel calls ({len(p.kernels)} kernels)",
            f"{'ms':>9} {'share':>6} {'calls':>6}  kernel",
        ]
        for k in p.kernels[:top]:
            lines.append(f"{k.ms:9.2f} {k.ms / max(p.total_ms, 1e-9):6.1%} {k.calls:6d}  {k.name}")
    base = profiles[0]
    for p in profiles[1:]:
        rows, named = difference(base, p, cover)
        lines += [
            "",
            f"{p.recipe} - {base.recipe}: {p.total_ms - base.total_ms:+.1f} ms in kernels; "
            f"the {len(rows)} largest changes hold {named:.0%} of all the change (sum of |change|)",
            f"{base.recipe + ' ms':>12} {p.recipe + ' ms':>12} {'change':>9}  kernel",
        ]
        lines += [f"{a:12.2f} {b:12.2f} {b - a:+9.2f}  {n}" for n, a, b in rows]
    return "\n".join(lines)


def report(
    model: str = "tiny",
    device: str = "auto",
    recipes: tuple[str, ...] = ("bf16", "fp8-e2e"),
    top: int = 20,
    cover: float = 0.9,
    sequences: int = 512,
    prompt_tokens: int = 16,
    new_tokens: int = 64,
    group_size: int = 8,
    micro_batch: int = 64,
    progress: Callable[[str], None] = lambda _: None,
) -> str:
    if top <= 0:
        raise ValueError(f"--top {top}: a positive number of kernels")
    if not 0.0 < cover <= 1.0:
        raise ValueError(f"--cover {cover}: a fraction in (0, 1]")
    if not recipes:
        raise ValueError("--recipes: name at least one recipe (the first is the baseline)")
    name, profiles = run(
        model, device, recipes, sequences, prompt_tokens, new_tokens, group_size, micro_batch, progress
    )
    return format_report(name, model, profiles, top, cover)
