"""The Megatron-Core trainer on one GPU against the native engines (needs the GPU worker image).

A tiny Llama (hidden 256, 2 layers, 2 heads, 1 key/value head, head_dim 128) built from the same
seed by both trainers. Bounds:
- Log-probs, BF16 recipe: both engines compute the same BF16 function with different kernels
  (TE's fused norm+GEMM and flash attention against torch's). BF16's unit roundoff is 2^-9, so
  per-token differences of a few 1e-3 are rounding; 0.05 is a loose cap (a wrong position, an
  off-by-one target or a missing temperature moves log-probs by O(1)); and
  ``token_mult_prob_error`` below 1.01.
- One GRPO step: Adam's first step moves every weight by about lr x sign(gradient), so the two
  engines' updates agree in sign where the gradient is not tiny, and their gradient norms (before
  clipping) agree to BF16 noise (5%); a wrong loss scale (micro-batches, DP) moves the norm by 2x.
- FP8 end to end: the generator computes with the trainer's exported FP8 weights; NVIDIA's
  healthy bound on ``token_mult_prob_error`` is 1.05.
"""

from __future__ import annotations

import os

import pytest
import torch

# Transformer Engine reads this once, at import; the trainer sets it too, but importorskip below
# imports TE first (float32 block scales, the default recipe)
os.environ.setdefault("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
import megatron.core  # noqa: F401  # make engines installs it: missing is an error

te = pytest.importorskip("transformer_engine.pytorch")

from rljob import JobSpec, parse_spec  # noqa: E402
from workers.algo.mismatch import mismatch_metrics  # noqa: E402
from workers.engines.megatron.trainer import MegatronTrainer  # noqa: E402
from workers.engines.native.generator import NativeGenerator  # noqa: E402
from workers.engines.native.trainer import NativeTrainer  # noqa: E402
from workers.engines.protocols import Rollouts  # noqa: E402
from workers.fp8.fp8_tensor import Fp8Tensor  # noqa: E402
from workers.fp8.kv_cache import kv_scale_name  # noqa: E402
from workers.models.tokenizer import ByteTokenizer  # noqa: E402
from workers.weight_sync.payload import fp8_weight_names  # noqa: E402

pytestmark = pytest.mark.gpu
TOK = ByteTokenizer()
# two groups of four, prompts of different lengths (left padding differs per row)
PROMPTS = [TOK.encode(p) for p in ("1+1=", "12+345=", "Calculate 7 + 8. ", "9*9=")] * 2
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])


def spec_for(recipe: str = "bf16", **resources: object) -> JobSpec:
    return parse_spec(
        {
            "model": {
                "tiny": {
                    "hidden_size": 256, "intermediate_size": 512, "num_layers": 2, "num_heads": 2,
                    "num_kv_heads": 1, "max_position_embeddings": 256,
                },
                "init_seed": 0,
            },
            "precision": {"recipe": recipe, "fp8_kv_cache": "generator_engine" in resources},
            "rollout": {"group_size": 4},
            "optimizer": {"micro_batch_size": 4, "lr": 1e-3},  # 8 rows: two micro-batches
            "resources": {"trainer_engine": "megatron", "gpus_per_trainer": 1, "gpus_per_generator": 1,
                          **resources},
        }
    )  # fmt: skip


def native_rollouts(spec: JobSpec) -> tuple[NativeTrainer, Rollouts]:
    native = NativeTrainer(spec, TOK.vocab_size, "cuda")
    gen = NativeGenerator(spec, TOK.vocab_size, TOK.eos_id, TOK.pad_id, "cuda")
    gen.load_weights(native.export_weights(fp8_weight_names(gen.model)))
    return native, gen.generate(PROMPTS, 8, 1.0, 1.0, 0)


def test_same_initial_weights_and_logprobs_as_the_native_trainer() -> None:
    spec = spec_for("bf16")
    native, batch = native_rollouts(spec)
    meg = MegatronTrainer(spec, TOK.vocab_size, "cuda", 0)
    # the float32 main weights, gathered and mapped back to Hugging Face names, are the native ones
    ours, theirs = meg.state_dict()["model"], native.model.state_dict()
    assert ours.keys() == {k for k, _ in native.model.named_parameters()}
    assert all(torch.equal(ours[k].cpu(), theirs[k].float().cpu()) for k in ours)
    mask = batch.response_mask
    lp_meg, lp_nat = meg.logprobs(batch, 0.8), native.logprobs(batch, 0.8)
    assert lp_meg.shape == mask.shape
    assert float(((lp_meg - lp_nat).abs() * mask).max()) < 0.05
    assert mismatch_metrics(lp_meg, lp_nat, mask)["mismatch/token_mult_prob_error"] < 1.01
    assert not (lp_meg * (1 - mask)).any()  # 0 where masked


def test_one_grpo_step_matches_the_native_update() -> None:
    spec = spec_for("bf16")
    native, batch = native_rollouts(spec)
    meg = MegatronTrainer(spec, TOK.vocab_size, "cuda", 0)
    before = {k: v.clone() for k, v in meg.state_dict()["model"].items()}
    lp_before = meg.logprobs(batch, 1.0)
    out = meg.train_step(batch, REWARDS, 1.0)
    ref = native.train_step(batch, REWARDS, 1.0)
    assert out.stats.keys() == ref.stats.keys()
    assert out.stats["train/tokens"] == float(batch.response_mask.sum())
    # the training forward (with grad) and the log-prob pass see the same weights
    torch.testing.assert_close(out.logprobs_old, lp_before, atol=1e-3, rtol=0)
    assert abs(out.stats["train/loss"] - ref.stats["train/loss"]) < 0.02
    assert abs(out.stats["is/weight_mean"] - ref.stats["is/weight_mean"]) < 0.01
    grad_ratio = out.stats["train/grad_norm"] / ref.stats["train/grad_norm"]
    assert 0.95 < grad_ratio < 1.05, grad_ratio
    after = meg.state_dict()["model"]
    theirs = native.model.state_dict()
    moved = agree = 0
    for name, w in after.items():
        ours_delta = (w - before[name]).cpu()
        native_delta = theirs[name].float().cpu() - before[name].cpu()
        big = native_delta.abs() > 0.5 * spec.optimizer.lr
        moved += int(big.sum())
        agree += int((torch.sign(ours_delta[big]) == torch.sign(native_delta[big])).sum())
    assert moved > 0 and agree / moved > 0.95, (agree, moved)


def test_export_loads_into_the_native_generator() -> None:
    spec = spec_for("bf16")
    _, batch = native_rollouts(spec)
    meg = MegatronTrainer(spec, TOK.vocab_size, "cuda", 0)
    meg.train_step(batch, REWARDS, 1.0)
    gen = NativeGenerator(spec, TOK.vocab_size, TOK.eos_id, TOK.pad_id, "cuda")
    payload = meg.export_weights(fp8_weight_names(gen.model))
    state = meg.state_dict()["model"]  # after the step: BF16 payload = main weights rounded once
    assert all(torch.equal(payload[k].cpu(), v.to(torch.bfloat16).cpu()) for k, v in state.items())
    gen.load_weights(payload)
    out = gen.generate(PROMPTS, 8, 1.0, 1.0, 1)
    lp = meg.logprobs(out, 1.0)
    assert float(((lp - out.logprobs).abs() * out.response_mask).max()) < 0.05


def test_sft_step_and_checkpoint_round_trip() -> None:
    spec = spec_for("bf16")
    native, batch = native_rollouts(spec)
    meg = MegatronTrainer(spec, TOK.vocab_size, "cuda", 0)
    loss = meg.sft_step(batch)
    assert 0.0 < loss < 20.0
    assert all(g["lr"] == spec.optimizer.lr for g in meg.model.optimizer.param_groups)  # restored
    meg.load_state_dict(native.state_dict())  # a native checkpoint loads too
    ours = meg.state_dict()["model"]
    assert all(torch.equal(ours[k].cpu(), v.float().cpu()) for k, v in native.model.named_parameters())


@pytest.mark.skipif(
    not te.is_fp8_block_scaling_available(), reason="FP8 block scaling needs sm90+ and CUDA >= 12.9"
)
def test_fp8_end_to_end_step_and_export() -> None:
    spec = spec_for("fp8-e2e")
    _, batch = native_rollouts(spec_for("bf16"))
    meg = MegatronTrainer(spec, TOK.vocab_size, "cuda", 0)
    assert len(meg.audit.fp8_layers) == 8 and "te_blockwise" in meg.audit.format()
    out = meg.train_step(batch, REWARDS, 1.0)
    assert all(torch.isfinite(torch.tensor(v)) for v in out.stats.values())
    gen = NativeGenerator(spec, TOK.vocab_size, TOK.eos_id, TOK.pad_id, "cuda")
    names = fp8_weight_names(gen.model)
    payload = meg.export_weights(names)
    assert names and all(isinstance(payload[n], Fp8Tensor) for n in names)
    gen.load_weights(payload)
    rollouts = gen.generate(PROMPTS, 8, 1.0, 1.0, 2)
    m = mismatch_metrics(meg.logprobs(rollouts, 1.0), rollouts.logprobs, rollouts.response_mask)
    assert m["mismatch/token_mult_prob_error"] < 1.05


def test_kv_scales_are_exported_for_vllm() -> None:
    spec = spec_for("bf16", generator_engine="vllm")
    _, batch = native_rollouts(spec_for("bf16"))
    meg = MegatronTrainer(spec, TOK.vocab_size, "cuda", 0)
    meg.train_step(batch, REWARDS, 1.0)  # calibrates on the updated weights
    payload = meg.export_weights()
    for i in range(2):
        for which in ("k", "v"):
            scale = payload[kv_scale_name(i, which)]
            assert scale.dim() == 0 and scale.dtype == torch.float32
            # p99.9 of |K| (or |V|) x 1.05 / 448: positive and not the "never observed" 1.0
            assert 0.0 < float(scale) < 1.0
