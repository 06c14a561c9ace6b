"""Gradient fidelity of each training precision on the same weights and batch (``fp8rl bench gradients``).

For every parameter ``p`` of the policy, the GRPO loss's gradient ``g = dL/dp`` under a precision
variant is compared with ``r``, the same gradient computed in float32 from end to end (float32
master weights, float32 between the GEMMs and in the GEMMs):

    cos(g, r) = <g, r> / sqrt(<g, g> <r, r>)        1 = same direction
    rel(g, r) = ||g - r|| / ||r||                   0 = same vector (norm errors count too)

computed in float64 on the flattened tensors; the ``global`` figures treat the whole model's
gradient as one vector. Variants (every one from the same master weights and the same batch):

- ``bf16``: the ``bf16`` recipe's trainer, BF16 between the GEMMs and in them;
- ``e4m3``: ``fp8-e2e`` with ``precision.fp8_format: e4m3``, E4M3 blockwise on fprop, dgrad, wgrad;
- ``hybrid``: ``fp8-e2e`` with ``fp8_format: hybrid``, E5M2 gradients;
- ``float32``: the reference computed a second time (a sanity check: cos 1 and rel 0 exactly).

The FP8 variants keep ``keep_bf16_layers`` decoder layers in BF16 as given; the CLI audits with
every decoder layer in FP8 by default, since the question it answers is how many layers a job
needs to keep in BF16.

The batch is one RL step of the job as the driver makes it: ``rollout.prompts_per_step`` problems
of the task (``batches`` steps' worth, concatenated), ``group_size`` samples each from a BF16
generator holding the weights, scored by the task. The gradient is that of the first optimizer step
of an RL step: on-policy (``logp_old = logp``), the whole batch as one minibatch, micro-batches of
``optimizer.micro_batch_size`` accumulated as the trainer does, no optimizer step. The IS weights
are 1 in every variant (the generator's log-probs stand in as the variant's own): otherwise the
float32 reference, which differs from the BF16 generator, would get weights the BF16 variants do
not, and the audit would measure the IS correction instead of the arithmetic. The KL penalty
(``algorithm.kl``), whose reference policy a checkpoint does not hold, is left out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rljob.spec import JobSpec
from workers.algo.advantages import grpo_advantages
from workers.algo.grpo import grpo_loss, loss_units
from workers.engines.factory import native_pair, native_trainer
from workers.engines.native.trainer import NativeTrainer, sequence_logprobs
from workers.engines.protocols import Rollouts
from workers.fp8.dispatch import to_device
from workers.fp8.linear import Fp8Linear
from workers.models.checkpoint import load_master_weights
from workers.models.tokenizer import build_tokenizer
from workers.tasks import Task

VARIANTS = ("bf16", "e4m3", "hybrid")  # the default audit, in table order
ALL_VARIANTS = (*VARIANTS, "float32")
REFERENCE = "float32 forward and backward (float32 master weights, float32 between and in the GEMMs)"


# -- comparing two gradients -----------------------------------------------------------------------


def cosine(g: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of two same-shape tensors (flattened), in float64; NaN if either is zero.

    ``<g, r> / sqrt(<g, g> <r, r>)`` rather than ``/ (|g| |r|)``: for ``g == r`` it is exactly 1.
    """
    g64, r64 = g.double().flatten(), ref.double().flatten()
    denom = math.sqrt(float(g64 @ g64) * float(r64 @ r64))
    if denom == 0.0:
        return math.nan
    return max(-1.0, min(1.0, float(g64 @ r64) / denom))


def relative_error(g: torch.Tensor, ref: torch.Tensor) -> float:
    """``||g - ref|| / ||ref||`` in float64; 0 if both are zero, inf if only ``ref`` is."""
    g64, r64 = g.double().flatten(), ref.double().flatten()
    diff, norm = float(torch.linalg.vector_norm(g64 - r64)), float(torch.linalg.vector_norm(r64))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


# -- results ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamFidelity:
    """One parameter's gradient under one variant against the reference."""

    cos: float
    rel: float
    fp8: bool  # the parameter is the weight of an Fp8Linear in this variant


@dataclass
class VariantFidelity:
    """Every parameter of one variant, and the whole model's gradient as one vector."""

    layers: dict[str, ParamFidelity]
    global_cos: float
    global_rel: float

    @property
    def min_cos(self) -> tuple[str, float]:
        name = min(self.layers, key=lambda n: _finite_or(self.layers[n].cos, math.inf))
        return name, self.layers[name].cos

    @property
    def max_rel(self) -> tuple[str, float]:
        name = max(self.layers, key=lambda n: _finite_or(self.layers[n].rel, -math.inf))
        return name, self.layers[name].rel

    def to_dict(self) -> dict[str, Any]:
        (cos_at, cos), (rel_at, rel) = self.min_cos, self.max_rel
        return {
            "layers": {
                n: {"cos": _json_float(p.cos), "rel": _json_float(p.rel), "fp8": p.fp8}
                for n, p in self.layers.items()
            },
            "global_cos": _json_float(self.global_cos),
            "global_rel": _json_float(self.global_rel),
            "min_cos": {"layer": cos_at, "value": _json_float(cos)},
            "max_rel": {"layer": rel_at, "value": _json_float(rel)},
            "fp8_layers": sum(p.fp8 for p in self.layers.values()),
        }


@dataclass
class GradientAudit:
    """The audit of one batch: parameter shapes, batch statistics, one entry per variant."""

    checkpoint: str | None
    keep_bf16_layers: tuple[int, int]  # of the FP8 variants
    spec_keep_bf16_layers: tuple[int, int]  # what the job spec says
    shapes: dict[str, tuple[int, ...]]  # every parameter with a gradient, in model order
    sequences: int
    tokens: int
    reward_mean: float
    variants: dict[str, VariantFidelity] = field(default_factory=dict)

    def to_dict(self, spec: str) -> dict[str, Any]:
        return {
            "spec": spec,
            "checkpoint": self.checkpoint,
            "reference": REFERENCE,
            "keep_bf16_layers": list(self.keep_bf16_layers),
            "spec_keep_bf16_layers": list(self.spec_keep_bf16_layers),
            "batch": {"sequences": self.sequences, "tokens": self.tokens, "reward_mean": self.reward_mean},
            "shapes": {n: list(s) for n, s in self.shapes.items()},
            "variants": {v: f.to_dict() for v, f in self.variants.items()},
        }

    def write_json(self, path: Path, spec: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(spec), indent=2) + "\n")

    def format_table(self) -> str:
        """One row per parameter (cos and rel per variant), then one summary line per variant."""
        names = list(self.variants)
        fp8_in = {n for f in self.variants.values() for n, p in f.layers.items() if p.fp8}
        width = max(len(_short(n)) for n in self.shapes)
        cols = "".join(f" {f'{v} cos':>11} {f'{v} rel':>11}" for v in names)
        header = f"{'layer':<{width}} {'param shape':<12} {'fp8':<3}{cols}"
        lines = [header, "-" * len(header)]
        for n, shape in self.shapes.items():
            layer = [self.variants[v].layers[n] for v in names]
            cells = "".join(f" {_fmt(p.cos, 'f'):>11} {_fmt(p.rel, 'e'):>11}" for p in layer)
            dims = "x".join(str(d) for d in shape)
            lines.append(f"{_short(n):<{width}} {dims:<12} {'yes' if n in fp8_in else '-':<3}{cells}")
        lines.append("")
        for v, f in self.variants.items():
            (cos_at, cos), (rel_at, rel) = f.min_cos, f.max_rel
            lines.append(
                f"{v:<7} whole model: cos {_fmt(f.global_cos, 'f')} rel {_fmt(f.global_rel, 'e')} | "
                f"min cos {_fmt(cos, 'f')} ({_short(cos_at)}) | max rel {_fmt(rel, 'e')} ({_short(rel_at)})"
            )
        return "\n".join(lines)


def _finite_or(x: float, default: float) -> float:
    return x if math.isfinite(x) else default


def _json_float(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN or inf


def _fmt(x: float, kind: str) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:.6f}" if kind == "f" else f"{x:.3e}"


def _short(name: str) -> str:
    return name.removeprefix("model.")


# -- inputs ----------------------------------------------------------------------------------------


def parse_variants(text: str) -> tuple[str, ...]:
    """``"bf16,e4m3"`` -> ``("bf16", "e4m3")``; anything else raises naming the option."""
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in names if v not in ALL_VARIANTS]
    if not names or bad:
        raise ValueError(
            f"--variants {text!r}: {'unknown ' + ', '.join(bad) if bad else 'empty'}; "
            f"give a comma-separated list of {', '.join(ALL_VARIANTS)} (e.g. bf16,e4m3,hybrid)"
        )
    return names


def parse_keep_layers(text: str) -> tuple[int, int]:
    """``"1,0"`` -> ``(1, 0)``: decoder layers kept in BF16 at the start and at the end."""
    try:
        first, last = (int(x) for x in text.split(","))
    except ValueError:
        first = last = -1
    if min(first, last) < 0:
        raise ValueError(
            f"--keep-bf16-layers {text!r}: give FIRST,LAST, two counts >= 0 of decoder layers kept "
            "in BF16 at each end (0,0: every decoder layer FP8)"
        )
    return first, last


def variant_spec(spec: JobSpec, variant: str, keep_bf16_layers: tuple[int, int]) -> JobSpec:
    """The job spec whose trainer computes ``variant``'s gradient (float32 and bf16: no FP8)."""
    s = spec.model_copy(deep=True)
    p = s.precision
    if variant == "float32":
        p.master_dtype = "float32"
    if variant in ("e4m3", "hybrid"):
        p.recipe, p.keep_bf16_layers = "fp8-e2e", keep_bf16_layers
        p.fp8_format = "e4m3" if variant == "e4m3" else "hybrid"
    else:
        p.recipe = "bf16"
    return s


def rl_batch(
    spec: JobSpec, state: dict[str, torch.Tensor] | None, batches: int = 1, device: str = "cpu"
) -> tuple[Rollouts, torch.Tensor]:
    """``batches`` RL steps' prompts, sampled by a BF16 generator holding the weights, and scored:
    ``(rollouts [B, ...], rewards [B])``, groups of ``group_size`` consecutive, on the host."""
    tok, r = build_tokenizer(spec), spec.rollout
    task = Task.for_job(spec, tok)
    s = variant_spec(spec, "bf16", (0, 0))
    _, gen = native_pair(s, tok.vocab_size, tok.eos_ids, tok.pad_id, state, device)
    problems = [p for b in range(batches) for p in task.sample(b, r.prompts_per_step, r.seed)]
    expanded = [p for p in problems for _ in range(r.group_size)]
    batch = gen.generate(
        [tok.encode(task.prompt(p)) for p in expanded], r.max_new_tokens, r.temperature, r.top_p, r.seed
    )
    texts = [
        tok.decode(row[: int(m.sum())].tolist())
        for row, m in zip(batch.response_ids, batch.response_mask, strict=True)
    ]
    rewards = torch.tensor([task.score(t, p) for t, p in zip(texts, expanded, strict=True)])  # [B]
    return batch, rewards


# -- gradients -------------------------------------------------------------------------------------


def policy_gradient(
    trainer: NativeTrainer, batch: Rollouts, rewards: torch.Tensor, compute_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The GRPO loss's gradient on ``batch`` (on-policy, one minibatch), per parameter, float32 on
    the host; no optimizer step. ``compute_dtype``: between the GEMMs (float32 for the reference)."""
    spec, model = trainer.spec, trainer.model
    algo, mbs, temperature = spec.algorithm, spec.optimizer.micro_batch_size, spec.rollout.temperature
    advantages = grpo_advantages(rewards, spec.rollout.group_size, algo.advantage_normalization)  # [B]
    units = loss_units(batch.response_mask, algo.loss_aggregation)  # of the whole batch
    model.zero_grad(set_to_none=True)
    for a in range(0, batch.prompt_ids.shape[0], mbs):
        micro = Rollouts(*(to_device(t[a : a + mbs], trainer.device) for t in batch))
        logp = sequence_logprobs(model, micro, temperature, compute_dtype)  # [b, L]
        out = grpo_loss(
            logp,
            logp.detach(),
            logp.detach(),  # IS weights exactly 1: variants differ in arithmetic, not in correction
            to_device(advantages[a : a + mbs], trainer.device),
            micro.response_mask,
            algo,
            units,
        )
        torch.autograd.backward(out.loss)
    return {
        name: p.grad.detach().to(device="cpu", dtype=torch.float32)
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def compare(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], fp8: set[str]) -> VariantFidelity:
    """Each parameter's gradient in ``grads`` against ``ref`` (same names), and the whole model's."""
    if set(grads) != set(ref):
        raise ValueError(f"parameters with a gradient differ: {sorted(set(grads) ^ set(ref))}")
    layers = {
        n: ParamFidelity(cosine(grads[n], r), relative_error(grads[n], r), n in fp8) for n, r in ref.items()
    }
    flat = torch.cat([grads[n].flatten() for n in ref])
    flat_ref = torch.cat([r.flatten() for r in ref.values()])
    return VariantFidelity(layers, cosine(flat, flat_ref), relative_error(flat, flat_ref))


def audit_batch(
    spec: JobSpec,
    state: dict[str, torch.Tensor] | None,
    batch: Rollouts,
    rewards: torch.Tensor,
    variants: tuple[str, ...] = VARIANTS,
    keep_bf16_layers: tuple[int, int] = (0, 0),
    device: str = "cpu",
) -> GradientAudit:
    """Every variant's gradient on ``batch`` against the float32 reference, from master weights
    ``state`` (None: the spec's initial weights)."""
    vocab = build_tokenizer(spec).vocab_size

    def gradient(variant: str) -> tuple[dict[str, torch.Tensor], set[str]]:
        trainer = native_trainer(variant_spec(spec, variant, keep_bf16_layers), vocab, state, device)
        dtype = torch.float32 if variant == "float32" else torch.bfloat16
        fp8 = {f"{n}.weight" for n, m in trainer.model.named_modules() if isinstance(m, Fp8Linear)}
        return policy_gradient(trainer, batch, rewards, dtype), fp8

    ref, _ = gradient("float32")
    if all(float(torch.linalg.vector_norm(g)) == 0.0 for g in ref.values()):
        raise ValueError(
            f"the batch has no learning signal: every group's rewards are equal (mean reward "
            f"{float(rewards.mean()):.3f}), so every advantage and the gradient are zero; give "
            "--checkpoint a trained run's checkpoint (the initial weights of a task with a warm-up "
            "score 0 everywhere) or more --batches"
        )
    result = GradientAudit(
        checkpoint=None,
        keep_bf16_layers=keep_bf16_layers,
        spec_keep_bf16_layers=tuple(spec.precision.keep_bf16_layers),  # type: ignore[arg-type]
        shapes={n: tuple(g.shape) for n, g in ref.items()},
        sequences=int(batch.prompt_ids.shape[0]),
        tokens=int(batch.response_mask.sum()),
        reward_mean=float(rewards.float().mean()),
    )
    for v in variants:
        grads, fp8 = gradient(v)
        result.variants[v] = compare(grads, ref, fp8)
    return result


def audit(
    spec: JobSpec,
    checkpoint: Path | None,
    variants: tuple[str, ...] = VARIANTS,
    batches: int = 1,
    keep_bf16_layers: tuple[int, int] = (0, 0),
    device: str = "cpu",
) -> GradientAudit:
    """The audit of ``checkpoint``'s weights (None: initial weights) on the job's own RL batch."""
    if batches < 1:
        raise ValueError(f"--batches {batches}: give at least 1")
    state = None if checkpoint is None else load_master_weights(checkpoint)
    batch, rewards = rl_batch(spec, state, batches, device)
    result = audit_batch(spec, state, batch, rewards, variants, keep_bf16_layers, device)
    result.checkpoint = None if checkpoint is None else str(checkpoint)
    return result
