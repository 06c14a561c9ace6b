"""Gradient audit: the comparison maths by hand, then each variant against the float32 reference.

Bounds (tiny 2-layer Llama, random init, one RL batch with fixed mixed rewards):
- ``bf16``: BF16's unit roundoff is 2^-9 ~ 0.2%; rounding the operands of every GEMM and the
  activations between them leaves a gradient within ~1% of float32 (cos = 1 - rel^2/2 ~ 0.9999).
  cos > 0.99 is loose; a wrong gradient (a missing term, a detached path) has cos far from 1.
- ``e4m3``: E4M3 keeps 3 mantissa bits (unit roundoff 2^-4, 16x BF16's) on both operands of all
  three GEMMs, so each layer's gradient is off by a few % to ~10% (cos ~0.997); cos > 0.95 per layer
  and > 0.99 for the whole model are loose, and the error must be visibly larger than BF16's.
- ``float32`` is the reference recomputed: the same operations on the same inputs on one CPU,
  so exactly equal (cos 1, rel 0). That checks determinism only, not that the reference is right.
- The reference itself is checked against a float64 gradient taken by another route
  (:func:`float64_gradient`): each sequence alone without padding, HF's own eager attention, one
  piece instead of micro-batches, advantages and the on-policy loss written out by hand. The two
  differ only by float32 rounding: measured rel 2-5e-7 per parameter (a few float32 units
  u = 2^-24 ~ 6e-8, grown through two layers); rel < 1e-5 is 20x loose. A wrong reference is far
  outside it: computed in BF16, rel 5e-3 to 1e-2; the last response token dropped, ~0.5; the loss
  share of the batch doubled, 1; the advantages' sign flipped, 2.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bench import gradients as ga
from rljob import JobSpec, parse_spec
from tests.helpers import TWO_LAYER_MODEL
from workers.engines.native.trainer import NativeTrainer
from workers.engines.protocols import Rollouts
from workers.fp8.linear import Fp8Linear
from workers.models.checkpoint import load_master_weights
from workers.models.tokenizer import ByteTokenizer


def test_cosine_and_relative_error_by_hand() -> None:
    g, ref = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])
    # <g, r> = 1, |g| = 1, |r| = sqrt 2 -> cos = 1/sqrt 2; g - r = [0, -1] -> rel = 1/sqrt 2
    assert ga.cosine(g, ref) == pytest.approx(1 / math.sqrt(2), rel=1e-12)
    assert ga.relative_error(g, ref) == pytest.approx(1 / math.sqrt(2), rel=1e-12)
    # twice the reference: same direction (cos 1), off by its own length (rel 1)
    assert ga.cosine(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])) == 1.0
    assert ga.relative_error(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])) == 1.0
    # orthogonal: cos 0, rel = |[-1, 1]| / 1 = sqrt 2; opposite: cos -1, rel 2
    assert ga.cosine(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])) == 0.0
    assert ga.relative_error(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])) == pytest.approx(
        math.sqrt(2)
    )
    assert ga.cosine(torch.tensor([-3.0, 0.0]), torch.tensor([1.0, 0.0])) == -1.0
    assert ga.relative_error(torch.tensor([-1.0, 0.0]), torch.tensor([1.0, 0.0])) == 2.0
    # a vector against itself: exactly 1 and 0, whatever its values (2-D: flattened)
    x = torch.randn(7, 5)
    assert ga.cosine(x, x.clone()) == 1.0 and ga.relative_error(x, x.clone()) == 0.0
    # zero gradients: no direction (NaN); zero error when both are zero, infinite otherwise
    zero = torch.zeros(2)
    assert math.isnan(ga.cosine(zero, ref)) and math.isnan(ga.cosine(zero, zero))
    assert ga.relative_error(zero, zero) == 0.0 and ga.relative_error(ref, zero) == math.inf


def test_compare_summarises_layers_and_the_whole_model() -> None:
    ref = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([2.0, 0.0])}
    grads = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([2.0, 0.0])}
    f = ga.compare(grads, ref, fp8={"a"})
    assert f.layers["a"].fp8 and not f.layers["b"].fp8
    assert f.min_cos[0] == "a" and f.min_cos[1] == pytest.approx(1 / math.sqrt(2))
    assert f.max_rel[0] == "a" and f.max_rel[1] == pytest.approx(1 / math.sqrt(2))
    # whole model: g = [1, 0, 2, 0], r = [1, 1, 2, 0]: <g, r> = 5, |g| = sqrt 5, |r| = sqrt 6
    assert f.global_cos == pytest.approx(5 / math.sqrt(30))
    assert f.global_rel == pytest.approx(1 / math.sqrt(6))  # |g - r| = |[0, -1, 0, 0]| = 1


def test_bad_options_name_the_option() -> None:
    assert ga.parse_variants(" e4m3,hybrid ") == ("e4m3", "hybrid")
    with pytest.raises(ValueError, match=r"--variants 'e5m2'.*unknown e5m2.*bf16, e4m3, hybrid"):
        ga.parse_variants("e5m2")
    with pytest.raises(ValueError, match=r"--variants ','.*empty"):
        ga.parse_variants(",")
    assert ga.parse_keep_layers("1,0") == (1, 0)
    for bad in ("1", "a,b", "-1,0", "1,2,3"):
        with pytest.raises(ValueError, match=r"--keep-bf16-layers.*FIRST,LAST"):
            ga.parse_keep_layers(bad)


def test_checkpoint_errors_say_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--checkpoint .*missing: no such file.*step_N"):
        load_master_weights(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"no trainer.pt in that directory"):
        load_master_weights(tmp_path)
    torch.save({"weights": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"not a trainer checkpoint"):
        load_master_weights(tmp_path / "other.pt")


def tiny_spec() -> JobSpec:
    return parse_spec(
        {
            "model": {"tiny": TWO_LAYER_MODEL, "init_seed": 0},
            "task": {"size": 20},
            "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4},
            # two micro-batches: the audit accumulates them as the trainer does
            "optimizer": {"micro_batch_size": 8},
            "precision": {"keep_bf16_layers": [1, 0]},
        }
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Master weights unlike the initial ones (init_seed 1), saved as a run saves them."""
    spec = tiny_spec()
    spec.model.init_seed = 1
    path = tmp_path_factory.mktemp("ckpt") / "step_00000001"
    path.mkdir()
    torch.save(
        {"model": NativeTrainer(spec, ByteTokenizer().vocab_size).state_dict()["model"]}, path / "trainer.pt"
    )
    return path


# a random policy scores 0 everywhere: mixed rewards by hand, so every group has a signal
REWARDS = [1.0, 0.0, 0.0, 1.0] * 4  # [16]: 4 groups of 4 (group_size), each [1, 0, 0, 1]


@dataclass
class AuditRun:
    """One ``audit_batch`` call, its inputs, and the reference gradient it compared against."""

    audit: ga.GradientAudit
    reference: dict[str, torch.Tensor]  # float32, as audit_batch computed it
    state: dict[str, torch.Tensor]
    batch: Rollouts


# 13-28 s on a shared 2-core machine (measured): the tests that use it are marked slow
@pytest.fixture(scope="module")
def audit_run(checkpoint: Path) -> AuditRun:
    spec = tiny_spec()
    state = load_master_weights(checkpoint)
    batch, _ = ga.rl_batch(spec, state)
    rewards = torch.tensor(REWARDS)  # [16]
    # record each gradient audit_batch computes; it computes the float32 reference first
    computed: list[dict[str, torch.Tensor]] = []
    real = ga.policy_gradient

    def recorded(*args: object, **kwargs: object) -> dict[str, torch.Tensor]:
        computed.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return computed[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ga, "policy_gradient", recorded)
        audit = ga.audit_batch(
            spec, state, batch, rewards, ("bf16", "e4m3", "float32"), keep_bf16_layers=(0, 0)
        )
    return AuditRun(audit, computed[0], state, batch)


@pytest.fixture(scope="module")
def audited(audit_run: AuditRun) -> ga.GradientAudit:
    return audit_run.audit


def float64_gradient(
    spec: JobSpec, state: dict[str, torch.Tensor], batch: Rollouts
) -> dict[str, torch.Tensor]:
    """The GRPO gradient of ``batch`` with :data:`REWARDS`, in float64, by a route of its own.

    On-policy the PPO ratio is exp(logp - logp_old) = 1 with gradient d logp, inside the clip range,
    and the IS weights are 1, so the token-mean loss is

        L = -(1 / N) sum_b A_b sum_t logp_bt,    N = the batch's response tokens

    Advantages by hand: every group's rewards are [1, 0, 0, 1], mean 1/2, unbiased std
    sqrt(4 * (1/2)^2 / 3) = sqrt(1/3), so A = +-(1/2) / (sqrt(1/3) + 1e-6) (eps 1e-6) ~ +-0.866.
    Each sequence runs alone: its real prompt tokens then its sampled ones, no padding, no mask,
    positions 0..n-1, through HF's eager attention; log-probs by a plain float64 log-softmax.
    """
    plain = spec.model_copy(deep=True)  # the job's model with nn.Linear layers (no FP8) in float32
    plain.precision.recipe, plain.precision.master_dtype = "bf16", "float32"
    model = NativeTrainer(plain, ByteTokenizer().vocab_size).model
    model.load_state_dict(state)
    model = model.double()
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    model.config._attn_implementation = "eager"  # transformers' own, not fp8rl's CPU kernel
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    advantages = [a if r == 1.0 else -a for r in REWARDS]  # [1, 0, 0, 1] -> [+a, -a, -a, +a]
    tokens = float(batch.response_mask.sum())  # N
    for b, advantage in enumerate(advantages):
        prompt = batch.prompt_ids[b][batch.prompt_mask[b] > 0]  # [p]
        n = int(batch.response_mask[b].sum())
        ids = torch.cat([prompt, batch.response_ids[b][:n]])  # [p + n]
        logits = model(input_ids=ids[None]).logits[0]  # [p + n, V] float64
        logp = torch.log_softmax(logits[:-1] / spec.rollout.temperature, dim=-1)  # row t predicts t + 1
        chosen = logp.gather(-1, ids[1:, None])[-n:, 0]  # [n]: the sampled tokens
        (-advantage * chosen.sum() / tokens).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_every_parameter_is_audited_and_fp8_layers_are_marked(audited: ga.GradientAudit) -> None:
    names = set(audited.shapes)
    linears = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    )}  # fmt: skip
    others = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert linears | others <= names and len(names) == 14 + 3 + 4  # + 2 norms per layer
    assert audited.shapes["model.layers.0.mlp.down_proj.weight"] == (64, 128)
    # keep_bf16_layers (0, 0) overrides the spec's (1, 0): every decoder linear is FP8 in e4m3
    assert {n for n, p in audited.variants["e4m3"].layers.items() if p.fp8} == linears
    assert not any(p.fp8 for p in audited.variants["bf16"].layers.values())
    assert audited.keep_bf16_layers == (0, 0) and audited.spec_keep_bf16_layers == (1, 0)
    assert audited.sequences == 16 and 16 <= audited.tokens <= 64 and audited.reward_mean == 0.5


@pytest.mark.slow
def test_the_float32_reference_equals_a_float64_gradient_by_another_route(audit_run: AuditRun) -> None:
    spec = tiny_spec()
    assert spec.algorithm.loss_aggregation == "token-mean"  # the loss float64_gradient writes out
    assert spec.algorithm.advantage_normalization == "std" and spec.rollout.group_size == 4
    exact = float64_gradient(spec, audit_run.state, audit_run.batch)
    reference = {n: g.double() for n, g in audit_run.reference.items()}
    f = ga.compare(reference, exact, fp8=set())
    assert set(f.layers) == set(audit_run.audit.shapes)
    worst = {n: (f"1-cos {1 - p.cos:.1e}", f"rel {p.rel:.1e}") for n, p in f.layers.items() if p.rel >= 1e-5}
    assert not worst, worst
    assert all(p.cos > 1 - 1e-9 for p in f.layers.values()), f.min_cos
    assert f.global_rel < 1e-5 and f.global_cos > 1 - 1e-9


@pytest.mark.slow
def test_the_float32_variant_reproduces_the_reference_exactly(audited: ga.GradientAudit) -> None:
    """Determinism of the reference route (the same operations on one CPU), not its correctness:
    that is the float64 test above."""
    f = audited.variants["float32"]
    assert all(p.cos == 1.0 and p.rel == 0.0 for p in f.layers.values())
    assert f.global_cos == 1.0 and f.global_rel == 0.0


@pytest.mark.slow
def test_bf16_gradients_follow_float32(audited: ga.GradientAudit) -> None:
    f = audited.variants["bf16"]
    assert all(p.cos > 0.99 and p.rel < 0.1 for p in f.layers.values()), f.min_cos
    assert f.global_rel > 0.0  # BF16 rounding is there, and small


@pytest.mark.slow
def test_fp8_gradients_show_quantization_within_bounds(audited: ga.GradientAudit) -> None:
    fp8, bf16 = audited.variants["e4m3"], audited.variants["bf16"]
    assert all(0.95 < p.cos < 1.0 for p in fp8.layers.values()), fp8.min_cos
    assert 0.99 < fp8.global_cos < bf16.global_cos
    assert fp8.global_rel > 2 * bf16.global_rel  # 3 mantissa bits against BF16's 7


@pytest.mark.slow
def test_json_has_the_documented_keys(audited: ga.GradientAudit, tmp_path: Path) -> None:
    path = tmp_path / "out" / "gradients.json"
    audited.write_json(path, "tiny.yaml")
    data = json.loads(path.read_text())
    assert {"spec", "checkpoint", "batch", "variants", "keep_bf16_layers"} <= set(data)
    assert data["spec"] == "tiny.yaml"
    assert data["batch"] == {"sequences": 16, "tokens": audited.tokens, "reward_mean": 0.5}
    e4m3 = data["variants"]["e4m3"]
    assert {"layers", "global_cos", "global_rel", "min_cos", "max_rel"} <= set(e4m3)
    q = e4m3["layers"]["model.layers.0.self_attn.q_proj.weight"]
    assert set(q) == {"cos", "rel", "fp8"} and q["fp8"] is True
    assert e4m3["min_cos"]["value"] == min(p["cos"] for p in e4m3["layers"].values())


@pytest.mark.slow
def test_table_has_a_row_per_parameter_and_a_summary_per_variant(audited: ga.GradientAudit) -> None:
    lines = audited.format_table().splitlines()
    assert lines[0].split()[:4] == ["layer", "param", "shape", "fp8"]
    assert "e4m3 cos" in lines[0] and "float32 rel" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[2 : 2 + len(audited.shapes)]}
    assert rows["layers.1.mlp.up_proj.weight"][1:3] == ["128x64", "yes"]
    assert rows["norm.weight"][1:3] == ["64", "-"]
    summaries = [line for line in lines if "whole model" in line]
    assert [s.split()[0] for s in summaries] == ["bf16", "e4m3", "float32"]


def test_no_learning_signal_is_an_error(checkpoint: Path) -> None:
    spec = tiny_spec()
    state = load_master_weights(checkpoint)
    batch, _ = ga.rl_batch(spec, state)
    with pytest.raises(ValueError, match=r"no learning signal.*--checkpoint"):
        ga.audit_batch(spec, state, batch, torch.ones(16), ("bf16",))
