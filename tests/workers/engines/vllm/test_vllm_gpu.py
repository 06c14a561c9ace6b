"""The vLLM generator on a GPU with vLLM installed (the worker image): it starts from the spec,
loads the trainer's FP8 payload as checkpoint tensors, and samples sequences whose log-probs the
native trainer reproduces. Skipped without a GPU, and without vLLM (``pytest.importorskip``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rljob import parse_spec
from workers.algo.mismatch import mismatch_metrics
from workers.fp8.hf_checkpoint import checkpoint_tensors
from workers.tokenizer import ByteTokenizer

pytestmark = pytest.mark.gpu
TOK = ByteTokenizer()


def spec(recipe: str) -> Any:
    # head_dim 128 and one KV head: every FP8 layer is whole 128x128 blocks, as vLLM needs
    return parse_spec(
        {
            "model": {
                "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_heads": 2, "num_kv_heads": 1}
            },
            "precision": {"recipe": recipe},
            "rollout": {"max_new_tokens": 16, "temperature": 1.0},
            "resources": {"generator_engine": "vllm", "gpus_per_generator": 1, "gpus_per_trainer": 1},
        }
    )


@pytest.mark.parametrize("recipe", ["bf16", "fp8-e2e"])
def test_vllm_samples_what_the_trainer_scores(recipe: str) -> None:
    pytest.importorskip("vllm")
    from workers.engines.native.trainer import NativeTrainer
    from workers.engines.vllm.generator import VllmGenerator

    job = spec(recipe)
    gen = VllmGenerator(job, TOK.vocab_size, TOK.eos_id, TOK.pad_id, "cuda")
    trainer = NativeTrainer(job, TOK.vocab_size, "cuda")
    payload = trainer.export_weights(gen.fp8_weight_names())
    gen.llm.collective_rpc(
        "fp8rl_load_tensors", args=({k: v.cpu() for k, v in checkpoint_tensors(payload).items()},)
    )
    gen.llm.reset_prefix_cache()
    prompts = [TOK.encode(f"{a}+{a}=") for a in range(16)]
    rollouts = gen.generate(prompts, 16, 1.0, 1.0, seed=0)
    assert rollouts.response_mask.sum() > 0 and torch.isfinite(rollouts.logprobs).all()
    logp_train = trainer.logprobs(rollouts, 1.0)
    metrics = mismatch_metrics(logp_train, rollouts.logprobs, rollouts.response_mask)
    # the same weights (FP8: the same bytes) in both engines: far below the 1.05 of a bug
    assert metrics["mismatch/token_mult_prob_error"] < 1.02, metrics
