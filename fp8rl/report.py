"""``fp8rl report``: reward, throughput and mismatch curves of one or several runs, as one PNG.

Validation accuracy (``val/accuracy``, on the steps that validated) is drawn on the reward panel
as markers in the run's colour, unsmoothed.

Several seeds of a variant (the recipe, ``-no-is`` when importance sampling is off; e.g. ``make
compare``'s 20 runs) are drawn as one curve per variant: the mean over its runs, on the steps
they all reached, with a band of plus and minus one standard error; validation as the mean with
standard-error bars. ``by_variant=False`` (``fp8rl report --per-run``) draws every run instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob import metrics as m
from rljob.metrics import MetricsLog
from rljob.run_dir import METRICS, RunDir

PANELS: tuple[tuple[str, str, float | None], ...] = (
    (m.REWARD_MEAN, "reward (mean)", None),
    (m.TOKEN_MULT_PROB_ERROR, "token_mult_prob_error (1.0 = no mismatch)", 1.05),
    (m.GENERATION_TOKENS_PER_S, "generation tokens/s", None),
    (m.TRAIN_TOKENS_PER_S, "training tokens/s", None),
    (m.GEN_KL_ERROR, "gen KL error (k3)", None),
    (m.IS_OOB_RATIO, "IS out-of-bounds fraction", None),
)


@dataclass(frozen=True)
class Run:
    """One run directory's metrics: ``label`` is its name (and recipe), ``recipe`` from its
    ``spec.resolved.json`` (None without one)."""

    label: str
    recipe: str | None
    rows: list[dict[str, Any]]
    # the recipe; "-no-is": IS off; "+fp8-kv": FP8 KV cache; "+respond": SLO actions ("-tail0": held to
    # tail_fraction 0)
    variant: str | None = None
    seed: int | None = None  # rollout.seed


def load_run(run_dir: Path) -> Run:
    """A run directory's metrics lines and recipe."""
    files = RunDir(run_dir)
    rows = MetricsLog(files.metrics).rows()
    if not rows:
        raise ValueError(f"{run_dir}: no {METRICS} with steps; is this an fp8rl run directory?")
    label, recipe, variant, seed = run_dir.name, None, None, None
    spec = files.spec_resolved
    if spec.exists():
        data = json.loads(spec.read_text())
        recipe = data.get("precision", {}).get("recipe")
        is_mode = data.get("algorithm", {}).get("importance_sampling", {}).get("mode")
        variant = f"{recipe}-no-is" if recipe != "bf16" and is_mode == "none" else recipe
        if data.get("precision", {}).get("fp8_kv_cache") and variant:
            variant += "+fp8-kv"  # a regime of its own (make compare-fp8kv), not the recipe's run
        slo = data.get("precision", {}).get("mismatch_slo", {})
        if slo.get("action") == "respond" and variant:
            variant += "+respond"  # precision that changes at a breach (make compare-slo)
            if slo.get("tail_fraction") == 0:
                variant += "-tail0"  # no step above the tail bound allowed (make compare-slo's respond-tail0)
        seed = data.get("rollout", {}).get("seed")
        if recipe and recipe not in label:
            label = f"{label} ({recipe})"
    return Run(label, recipe, rows, variant, seed)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (NaNs ignored)."""
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(sum(part) / len(part) if part else math.nan)
    return out


def variant_of(run: Run) -> str:
    """The curve a run belongs to when runs are grouped: its variant, else its label."""
    return run.variant or run.label


def seed_mean(series: list[list[tuple[int, float]]]) -> tuple[list[int], list[float], list[float]]:
    """Mean and standard error over runs of ``(step, value)`` series, on the steps every series
    has (NaN values ignored; standard error 0 where one value is left)."""
    maps = [dict(s) for s in series]
    common = sorted(set.intersection(*(set(mp) for mp in maps))) if maps else []
    steps, means, errors = [], [], []
    for step in common:
        values = [mp[step] for mp in maps if not math.isnan(mp[step])]
        if not values:
            continue
        mean, std = mean_std(values)
        steps.append(step)
        means.append(mean)
        errors.append(std / math.sqrt(len(values)))
    return steps, means, errors


def _series(run: Run, key: str, window: int) -> list[tuple[int, float]]:
    rl_rows = [r for r in run.rows if m.REWARD_MEAN in r]  # not the step-0 validation line
    steps = [int(r["step"]) for r in rl_rows]
    return list(zip(steps, smooth([float(r.get(key, math.nan)) for r in rl_rows], window), strict=True))


def report(runs: list[Run], output: Path, window: int = 5, by_variant: bool | None = None) -> Path:
    """Draw the :data:`PANELS` into ``output`` (PNG); return its path. ``by_variant``: one curve
    per variant, mean over its runs (default: when a variant has several runs); else per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(variant_of(run), []).append(run)
    if by_variant is None:
        by_variant = any(len(g) > 1 for g in groups.values())
    fig, axes = plt.subplots(3, 2, figsize=(12, 11))
    for ax, (key, title, line) in zip(axes.flat, PANELS, strict=True):
        if by_variant:
            _draw_variants(ax, groups, key, window)
        else:
            _draw_runs(ax, runs, key, window)
        if line is not None:
            ax.axhline(line, color="red", linestyle="--", linewidth=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    if by_variant:
        counts = ", ".join(f"{name} n={len(g)}" for name, g in groups.items())
        fig.suptitle(
            f"fp8rl runs: mean over seeds +- standard error (moving average over {window} steps)\n{counts}"
        )
    else:
        fig.suptitle(f"fp8rl runs (moving average over {window} steps)")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=90)
    plt.close(fig)
    return output


def _draw_runs(ax: Any, runs: list[Run], key: str, window: int) -> None:
    for run in runs:
        series = _series(run, key, window)
        (curve,) = ax.plot([s for s, _ in series], [v for _, v in series], label=run.label)
        val = validation_points(run.rows) if key == m.REWARD_MEAN else []
        if val:
            label = f"{run.label} val accuracy"
            ax.plot(*zip(*val, strict=True), "o--", color=curve.get_color(), label=label)


def _draw_variants(ax: Any, groups: dict[str, list[Run]], key: str, window: int) -> None:
    for name, group in groups.items():
        steps, mean, err = seed_mean([_series(run, key, window) for run in group])
        (curve,) = ax.plot(steps, mean, label=f"{name} (n={len(group)})")
        low = [a - e for a, e in zip(mean, err, strict=True)]
        high = [a + e for a, e in zip(mean, err, strict=True)]
        ax.fill_between(steps, low, high, color=curve.get_color(), alpha=0.2, linewidth=0)
        if key != m.REWARD_MEAN:
            continue
        val_steps, val_mean, val_err = seed_mean([validation_points(run.rows) for run in group])
        if val_steps:
            ax.errorbar(
                val_steps, val_mean, yerr=val_err, fmt="o--", color=curve.get_color(), capsize=3,
                label=f"{name} val accuracy",
            )  # fmt: skip


def validation_points(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """``(step, val/accuracy)`` of the steps that validated."""
    return [(int(r["step"]), float(r[m.VAL_ACCURACY])) for r in rows if r.get(m.VAL_ACCURACY) is not None]


def summary(runs: list[Run], last: int = 10) -> list[dict[str, Any]]:
    """Per run: first and final reward (means of the first and the last ``last`` steps; of the
    first and last half when the run has fewer than ``2 * last`` steps, so the two never share a
    step), mean token_mult_prob_error, and the last validation accuracy (None without
    validation)."""
    out = []
    for run in runs:
        val = validation_points(run.rows)  # step 0 (before RL) included
        rows = [r for r in run.rows if m.REWARD_MEAN in r]  # the RL steps
        last = max(1, min(last, len(rows) // 2))
        tail = rows[-last:]
        tmpe = [float(r[m.TOKEN_MULT_PROB_ERROR]) for r in rows]
        out.append(
            {
                "run": run.label,
                "recipe": run.recipe or run.label,
                "variant": run.variant or run.recipe or run.label,
                "seed": run.seed,
                "steps": int(rows[-1]["step"]),
                "first_reward": sum(float(r[m.REWARD_MEAN]) for r in rows[:last]) / len(rows[:last]),
                "final_reward": sum(float(r[m.REWARD_MEAN]) for r in tail) / len(tail),
                "token_mult_prob_error": sum(tmpe) / len(tmpe),
                "val_accuracy": val[-1][1] if val else None,
                "val_first": val[0][1] if val else None,  # step 0 (before RL) where the run has it
            }
        )
    return out


# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom (standard tables)
T975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
    10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
    18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060,
    26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042,
}  # fmt: skip
RISE, FLOOR = 0.15, 0.3  # a run "learns" when val/accuracy rises by RISE over step 0, to FLOOR


def validation_table(summaries: list[dict[str, Any]], baseline: str = "bf16") -> list[dict[str, Any]]:
    """Per variant, over its runs (seeds) with validation: final ``val/accuracy`` mean and
    standard error; the paired difference to ``baseline`` on the seeds both ran (mean and 95%
    interval, Student's t); mean ``token_mult_prob_error``; and how many runs learned (rose by
    :data:`RISE` over step 0, to at least :data:`FLOOR`)."""
    runs = [r for r in summaries if r["val_accuracy"] is not None]
    base = {r["seed"]: r["val_accuracy"] for r in runs if r["variant"] == baseline}
    out = []
    for variant in dict.fromkeys(r["variant"] for r in runs):
        rows = [r for r in runs if r["variant"] == variant]
        acc = [float(r["val_accuracy"]) for r in rows]
        mean, std = mean_std(acc)
        diffs = [float(r["val_accuracy"]) - base[r["seed"]] for r in rows if r["seed"] in base]
        diff = None
        if diffs and variant != baseline:
            d_mean, d_std = mean_std(diffs)
            half = (
                T975.get(len(diffs) - 1, 1.96) * d_std / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
            )
            diff = (d_mean, d_mean - half, d_mean + half, len(diffs))
        learned = sum(
            r["val_first"] is not None
            and r["val_accuracy"] - r["val_first"] >= RISE
            and r["val_accuracy"] >= FLOOR
            for r in rows
        )
        out.append(
            {
                "variant": variant,
                "runs": len(rows),
                "val_accuracy": (mean, std / math.sqrt(len(acc))),
                "diff": diff,
                "token_mult_prob_error": sum(float(r["token_mult_prob_error"]) for r in rows) / len(rows),
                "learned": learned,
            }
        )
    return out


def format_validation_table(table: list[dict[str, Any]], baseline: str = "bf16") -> str:
    lines = [
        f"{'recipe':<22} {'seeds':>5} {'val accuracy':>16} {'vs ' + baseline + ' (paired, 95% CI)':>32} "
        f"{'token_mult_prob_error':>22} {'learned':>8}"
    ]
    for r in table:
        mean, se = r["val_accuracy"]
        d = r["diff"]
        diff = "-" if d is None else f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}] (n={d[3]})"
        lines.append(
            f"{r['variant']:<22} {r['runs']:>5} {f'{mean:.3f} +- {se:.3f}':>16} {diff:>32} "
            f"{r['token_mult_prob_error']:>22.5f} {str(r['learned']) + '/' + str(r['runs']):>8}"
        )
    lines.append(
        "(final val/accuracy: mean +- standard error over seeds; paired: the same seeds' difference; "
        f"learned: val/accuracy rose >= {RISE} over step 0, to >= {FLOOR})"
    )
    return "\n".join(lines)


def by_recipe(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`summary` rows grouped by recipe: per recipe, the mean and spread (sample standard
    deviation; 0 for one run) over its runs (e.g. seeds) of the final reward, the run-mean
    token_mult_prob_error and the last validation accuracy."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in summaries:
        groups.setdefault(row["recipe"], []).append(row)
    out = []
    for recipe, rows in groups.items():
        entry: dict[str, Any] = {"recipe": recipe, "runs": len(rows)}
        for key in ("final_reward", "token_mult_prob_error", "val_accuracy"):
            values = [float(r[key]) for r in rows if r[key] is not None]
            entry[key] = mean_std(values) if values else None
        out.append(entry)
    return out


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value) of ``values``."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
