"""``fp8rl bench async SPEC``: the same job synchronously (``rollout.max_staleness: 0``) and
asynchronously (``max_staleness: 1``), one after the other in this process, on the same seeds, each
through the real driver on a local Ray with one trainer and one generator of one core (one torch
thread) each; it prints steps/s of both and their ratio.

What is timed: steps ``skip+1 .. steps`` of each run, from the end of step ``skip`` to the end of the
last (the rows' wall clock), so Ray's start, the actors' set-up, the spec's supervised warm-up and
the first steps (allocator and kernel warm-up) are left out. The job is the spec as shipped: the
warm-up runs as it says (each run does it, then is timed after it), because a warmed-up policy
writes shorter answers and that changes how generation and training balance. Validation and
intermediate checkpoints are switched off (the same in both modes and no part of a step), and the
header prints every setting the bench changed. ``--no-warmup`` times an untrained policy instead,
which writes every token it may. Overlap is worth most where generation and training take similar
time: the table also prints each phase's mean seconds in the synchronous run, and the overlap the
asynchronous one achieved, so a reader sees why the ratio is what it is.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rljob import metrics as m
from rljob.spec import JobSpec, load_spec


def bench_variant(spec: JobSpec, k: int, steps: int, warmup: bool = True) -> JobSpec:
    """``spec`` run for ``steps`` steps with ``max_staleness`` k, one trainer and one generator of
    one thread each, no validation or intermediate checkpoint; its warm-up as it is, or none
    (``warmup=False``)."""
    data = spec.model_dump(mode="json")
    data["rollout"]["max_staleness"] = k
    data["steps"] = steps
    data["checkpoint_interval"] = steps
    if not warmup:
        data["warmup"]["sft_steps"] = 0
    data["validation"]["interval"] = 0
    data["precision"]["exact"] = False
    data["resources"].update(trainers=1, generators=1, cpus_per_actor=1, threads_per_actor=1)
    return JobSpec.model_validate(data)


def changed(base: JobSpec, variant: JobSpec) -> list[str]:
    """``key old -> new`` for every setting of ``variant`` that differs from ``base`` (dotted keys,
    in the spec's order), ``rollout.max_staleness`` aside: what the bench changed."""

    def flat(data: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(data, dict):
            return {prefix: data}
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flat(value, f"{prefix}.{key}" if prefix else key))
        return out

    old, new = flat(base.model_dump(mode="json")), flat(variant.model_dump(mode="json"))
    return [
        f"{key} {old.get(key)!r} -> {value!r}"
        for key, value in new.items()
        if key != "rollout.max_staleness" and old.get(key) != value
    ]


def steps_per_s(rows: Sequence[Mapping[str, Any]], skip: int) -> float:
    """Steps per second from the end of step ``skip`` to the end of the last row."""
    if len(rows) <= skip:
        raise ValueError(f"--steps must exceed --skip ({skip}): {len(rows)} steps ran")
    return (len(rows) - skip) / (float(rows[-1][m.TIME]) - float(rows[skip - 1][m.TIME]))


def mean(rows: Sequence[Mapping[str, Any]], key: str, skip: int) -> float:
    return statistics.fmean(float(r.get(key, 0.0)) for r in rows[skip:])


def overlap_ceiling(gen_s: float, train_s: float, sync_s: float) -> float:
    """The most overlap can win with these synchronous phase times: a synchronous step costs
    gen + train + sync, an overlapped one at least max(gen, train) + sync."""
    return (gen_s + train_s + sync_s) / (max(gen_s, train_s) + sync_s)


def report(spec_path: str | Path, steps: int = 12, skip: int = 2, warmup: bool = True) -> str:
    """The table (module docstring)."""
    from workers.job import driver
    from workers.job.ray_cluster import ray_init, ray_shutdown

    if skip < 1:
        raise ValueError("--skip must be >= 1 (the first step's end starts the clock)")
    base = load_spec(spec_path)
    results = {}
    variants = {k: bench_variant(base, k, steps, warmup) for k in (0, 1)}
    started = ray_init(variants[0])
    try:
        with tempfile.TemporaryDirectory(prefix="fp8rl-bench-async-") as tmp:
            for k, spec in variants.items():
                out = Path(tmp) / f"k{k}"
                results[k] = list(driver.run(spec, out, driver.RunOptions(log=lambda line: None)).rows)
    finally:
        if started:
            ray_shutdown()
    sync, async_ = results[0], results[1]
    s0, s1 = steps_per_s(sync, skip), steps_per_s(async_, skip)
    lines = [
        f"fp8rl bench async {spec_path}: recipe {base.precision.recipe}, {base.rollout.prompts_per_step}x"
        f"{base.rollout.group_size} rollouts of <= {base.rollout.max_new_tokens} tokens a step, "
        f"1 trainer + 1 generator (1 thread each), steps {skip + 1}..{steps} timed"
        + (
            f" after a warm-up of <= {base.warmup.sft_steps} steps"
            if warmup and base.warmup.sft_steps
            else ""
        ),
        "changed from the spec: " + "; ".join(changed(base, variants[0])),
        f"{'mode':<22}{'steps/s':>9}{'gen s':>8}{'train s':>9}{'sync s':>8}{'overlap s':>11}{'lag max':>9}",
    ]
    phases = (m.TIMING_GENERATION_S, m.TIMING_TRAIN_S, m.TIMING_WEIGHT_SYNC_S)
    means = {k: [mean(rows, key, skip) for key in phases] for k, rows in results.items()}
    for k, name, rate in ((0, "sync (max_staleness 0)", s0), (1, "async (max_staleness 1)", s1)):
        gen_s, train_s, sync_s = means[k]
        lines.append(
            f"{name:<22}{rate:>9.3f}{gen_s:>8.3f}{train_s:>9.3f}{sync_s:>8.3f}"
            f"{mean(results[k], m.TIMING_OVERLAP_S, skip):>11.3f}"
            f"{max(float(r.get(m.STALENESS_MAX, 0.0)) for r in results[k]):>9.0f}"
        )
    ceiling = overlap_ceiling(*means[0])
    lines.append(f"ratio async/sync: {s1 / s0:.2f}x (ceiling from the synchronous phases: {ceiling:.2f}x)")
    return "\n".join(lines)
