"""K/V scales the native trainer calibrates for a vLLM generator's FP8 KV cache, checked against a
second route: Hugging Face's own cache filled by a plain BF16 forward, and a float64 percentile."""

from __future__ import annotations

import copy
import math

import torch

from rljob import JobSpec, parse_spec
from tests.helpers import TWO_LAYER_MODEL
from workers.engines.batching import left_pad
from workers.engines.native.trainer import NativeTrainer
from workers.engines.protocols import Rollouts
from workers.fp8.kv_cache import kv_scale_name
from workers.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def spec(generator_engine: str = "vllm", fp8_kv_cache: bool = True) -> JobSpec:
    return parse_spec(
        {
            "model": {"tiny": TWO_LAYER_MODEL},
            "precision": {"recipe": "bf16", "fp8_kv_cache": fp8_kv_cache},
            "optimizer": {"micro_batch_size": 2},
            "rollout": {"group_size": 3},
            "resources": {"generator_engine": generator_engine, "gpus_per_generator": 1},
        }
    )


def batch() -> Rollouts:
    """Three sequences with different prompt and response lengths (left/right padding)."""
    prompts = [[256, 50, 51, 52, 53], [256, 60], [256, 70, 71]]
    prompt_ids, prompt_mask = left_pad(prompts, TOK.pad_id)
    response_ids = torch.tensor([[10, 11, 257, 258], [12, 13, 14, 15], [16, 257, 258, 258]])
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    return Rollouts(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(3, 4))


def nearest_rank_scale(values: torch.Tensor) -> float:
    """p99.9 of |x| by the nearest-rank definition, in float64 by sorting; x 1.05 / 448."""
    flat = values.abs().double().reshape(-1).sort().values
    rank = math.ceil(0.999 * flat.numel())
    return float(flat[rank - 1]) * 1.05 / 448.0


def reference_scales(trainer: NativeTrainer, b: Rollouts) -> list[tuple[float, float]]:
    """The model in BF16 (what a generator holds), a plain forward with Hugging Face's cache."""
    from transformers import DynamicCache

    from workers.engines.batching import positions
    from workers.engines.models import attention_mask_4d

    model = copy.deepcopy(trainer.model).to(torch.bfloat16)
    for m in model.modules():  # RoPE frequencies stay float32, as in both engines
        if hasattr(m, "inv_freq"):
            m.inv_freq = m.inv_freq.float()
    ids = torch.cat([b.prompt_ids, b.response_ids], 1)
    attn = torch.cat([b.prompt_mask, b.response_mask.long()], 1)
    cache = DynamicCache()
    impl = str(model.config._attn_implementation)
    with torch.no_grad():
        model(
            input_ids=ids,
            attention_mask=attention_mask_4d(attn, ids.shape[1], torch.bfloat16, impl),
            position_ids=positions(attn),
            past_key_values=cache,
            use_cache=True,
        )
    real = attn.bool()  # [B, T]
    out = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys"), getattr(layer, "values")  # noqa: B009  # [B, H, T, D]
        k = keys.transpose(1, 2)[real]  # [real tokens, H, D]
        v = values.transpose(1, 2)[real]
        out.append((nearest_rank_scale(k), nearest_rank_scale(v)))
    return out


def test_scales_are_p999_of_real_tokens_after_the_update() -> None:
    trainer = NativeTrainer(spec(), TOK.vocab_size)
    with torch.no_grad():  # padding whose layer-0 K is far larger than any real token's
        k_row = trainer.model.model.layers[0].self_attn.k_proj.weight[0]
        trainer.model.model.embed_tokens.weight[TOK.pad_id] = k_row / k_row.norm()
    b = batch()
    assert kv_scale_name(0, "k") not in trainer.export_weights()  # nothing calibrated yet
    trainer.train_step(b, torch.tensor([1.0, 0.0, 1.0]), 1.0)
    payload = trainer.export_weights()
    expected = reference_scales(trainer, b)  # the weights after the update
    for i, (k, v) in enumerate(expected):
        got_k, got_v = payload[kv_scale_name(i, "k")], payload[kv_scale_name(i, "v")]
        assert got_k.dtype == torch.float32 and got_k.dim() == 0
        assert math.isclose(float(got_k), k, rel_tol=1e-6), (i, float(got_k), k)
        assert math.isclose(float(got_v), v, rel_tol=1e-6), (i, float(got_v), v)


def test_only_a_vllm_generator_with_an_fp8_kv_cache_gets_scales() -> None:
    for s in (spec("native"), spec("vllm", fp8_kv_cache=False)):
        trainer = NativeTrainer(s, TOK.vocab_size)
        trainer.train_step(batch(), torch.tensor([1.0, 0.0, 1.0]), 1.0)
        assert not any(name.endswith(("k_scale", "v_scale")) for name in trainer.export_weights())
