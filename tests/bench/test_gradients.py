"""Gradient audit: the comparison maths by hand, then each variant against the float32 reference.

Bounds (tiny 2-layer Llama, random init, one RL batch with fixed mixed rewards):
- ``bf16``: BF16's unit roundoff is 2^-9 ~ 0.2%; rounding the operands of every GEMM and the
  activations between them leaves a gradient within ~1% of float32 (cos = 1 - rel^2/2 ~ 0.9999).
  cos > 0.99 is loose; a wrong gradient (a missing term, a detached path) has cos far from 1.
- ``e4m3``: E4M3 keeps 3 mantissa bits (unit roundoff 2^-4, 16x BF16's) on both operands of all
  three GEMMs, so each layer's gradient is off by a few % to ~10% (cos ~0.997); cos > 0.95 per layer
  and > 0.99 for the whole model are loose, and the error must be visibly larger than BF16's.
- ``float32`` is the reference recomputed: the same operations on the same inputs on one CPU,
  so exactly equal (cos 1, rel 0).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bench import gradients as ga
from rljob import JobSpec, parse_spec
from tests.helpers import TWO_LAYER_MODEL
from workers.checkpoint import load_master_weights
from workers.engines.native.trainer import NativeTrainer
from workers.tokenizer import ByteTokenizer


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


# 13-28 s on a shared 2-core machine (measured): the tests that use it are marked slow
@pytest.fixture(scope="module")
def audited(checkpoint: Path) -> ga.GradientAudit:
    spec = tiny_spec()
    state = load_master_weights(checkpoint)
    batch, _ = ga.rl_batch(spec, state)
    # a random policy scores 0 everywhere: mixed rewards by hand, so every group has a signal
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * 4)  # [16]
    return ga.audit_batch(spec, state, batch, rewards, ("bf16", "e4m3", "float32"), keep_bf16_layers=(0, 0))


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
def test_reference_against_itself_is_exact(audited: ga.GradientAudit) -> None:
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
