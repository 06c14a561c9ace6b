"""The vLLM generator on a GPU with vLLM installed (the worker image): it starts from the spec,
receives the trainer's payload through vLLM's weight-transfer API, and samples sequences whose
log-probs the native trainer reproduces.

GPU only: vLLM's block-FP8 linear layers (recipes fp8-gen and fp8-e2e) need CUDA (or Intel AMX,
which CPU CI machines lack); the CPU path with BF16 weights is test_vllm_cpu.py. The weights go
over the gloo weight channel (``device="cpu"``) because trainer and vLLM share the one GPU here,
and NCCL cannot put two ranks on one GPU; vLLM's workers then copy them to the GPU. Skipped
without a GPU, and without vLLM."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rljob import parse_spec
from tests.workers.engines.vllm.engine import Sender
from workers.algo.mismatch import mismatch_metrics
from workers.fp8.formats import E4M3
from workers.fp8.fp8_tensor import Fp8Tensor
from workers.fp8.kv_cache import KvScales
from workers.models.tokenizer import ByteTokenizer
from workers.weight_sync.contract import compare, sent_report

pytestmark = pytest.mark.gpu
TOK = ByteTokenizer()


def spec(recipe: str, fp8_kv_cache: bool = False) -> Any:
    # head_dim 128 and one KV head: every FP8 layer is whole 128x128 blocks, as vLLM needs
    return parse_spec(
        {
            "model": {
                "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_heads": 2, "num_kv_heads": 1}
            },
            "precision": {"recipe": recipe, "fp8_kv_cache": fp8_kv_cache},
            "rollout": {"max_new_tokens": 16, "temperature": 1.0},
            "resources": {"generator_engine": "vllm", "gpus_per_generator": 1, "gpus_per_trainer": 1},
        }
    )


@pytest.mark.parametrize(("recipe", "fp8_kv_cache"), [("bf16", False), ("fp8-e2e", False), ("fp8-e2e", True)])
def test_vllm_samples_what_the_trainer_scores(recipe: str, fp8_kv_cache: bool) -> None:
    import vllm  # noqa: F401  # make engines installs it: missing is an error

    from workers.engines.native.trainer import NativeTrainer
    from workers.engines.vllm.generator import VllmGenerator

    job = spec(recipe, fp8_kv_cache)
    gen = VllmGenerator(job, TOK.vocab_size, TOK.eos_id, TOK.pad_id, "cuda", max_prompt_tokens=32)
    try:
        trainer = NativeTrainer(job, TOK.vocab_size, "cuda")
        if fp8_kv_cache:  # scales as the trainer calibrates them; with FP8 weights vLLM loads them itself
            k, v = torch.full((2,), 0.02, device="cuda"), torch.full((2,), 0.03, device="cuda")
            trainer.kv_scales = KvScales(k, v, E4M3)
        payload = trainer.export_weights(gen.fp8_weight_names())
        sender = Sender()
        sender.join(gen, device="cpu")
        result = sender.sync(gen, payload)
        assert result.version == 1
        kv_dtype = "float8_e4m3fn" if fp8_kv_cache else "bfloat16"
        held = gen.weight_report()
        check = compare(sent_report(payload, kv_dtype), held)
        assert check.ok, check.mismatches
        fp8 = {n for n, v in payload.items() if isinstance(v, Fp8Tensor)}
        assert (recipe != "bf16") == bool(fp8) and all(held["weights"][n]["holds"] == "fp8" for n in fp8)
        if fp8_kv_cache:
            assert held["kv"]["k_scales"] == [0.019999999552965164] * 2  # float32(0.02)
        prompts = [TOK.encode(f"{a}+{a}=") for a in range(16)]
        rollouts = gen.generate(prompts, 16, 1.0, 1.0, seed=0)
        assert rollouts.response_mask.sum() > 0 and torch.isfinite(rollouts.logprobs).all()
        logp_train = trainer.logprobs(rollouts, 1.0)
        metrics = mismatch_metrics(logp_train, rollouts.logprobs, rollouts.response_mask)
        # the same weights (FP8: the same bytes) in both engines: far below the 1.05 of a bug
        # (an FP8 KV cache, which the trainer does not have, adds a few percent)
        assert metrics["mismatch/token_mult_prob_error"] < (1.06 if fp8_kv_cache else 1.02), metrics
    finally:
        gen.shutdown()
