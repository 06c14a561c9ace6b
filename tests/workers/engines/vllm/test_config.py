"""The vLLM generator's pure parts, on CPU: layout and refusals, engine and sampling arguments, the
Rollouts built from vLLM's documented output fields, and the worker extension's receive path."""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from rljob import parse_spec
from workers.engines.vllm import generator as vg
from workers.engines.vllm.worker import WeightChannelExtension
from workers.fp8.quant import Fp8Tensor, quantize
from workers.weight_sync import SyncResult


def config(hidden: int = 256, heads: int = 2, kv_heads: int = 1, layers: int = 2, ffn: int = 512) -> Any:
    return LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )


def spec(**precision: Any) -> Any:
    return parse_spec(
        {
            "model": {
                "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_heads": 2, "num_kv_heads": 1}
            },
            "precision": precision,
            "resources": {"generator_engine": "vllm", "gpus_per_generator": 1},
        }
    )


def test_layout_is_the_native_rule_with_layers_kept_in_bf16() -> None:
    fp8, bf16 = vg.generator_layout(config(), spec(keep_bf16_layers=[1, 0]).precision)
    # layer 0 kept: its 7 linears are BF16 (vLLM's ignored_layers); layer 1 is FP8
    assert fp8 == [
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ]
    assert sorted(bf16) == sorted(
        ["lm_head"]
        + [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        + [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    )
    none, everything = vg.generator_layout(config(), spec(recipe="bf16").precision)
    assert none == [] and len(everything) == 15


def test_shapes_of_the_decoder_linears() -> None:
    # head_dim 256 / 2 = 128; one KV head: k/v out = 128
    shapes = {m: s for _, m, s in vg.decoder_linears(config())}
    assert shapes["model.layers.0.self_attn.q_proj"] == (256, 256)
    assert shapes["model.layers.0.self_attn.k_proj"] == (128, 256)
    assert shapes["model.layers.0.self_attn.o_proj"] == (256, 256)
    assert shapes["model.layers.1.mlp.down_proj"] == (256, 512)


def test_a_layout_without_whole_blocks_is_refused_naming_the_layer() -> None:
    small = config(hidden=128, heads=4, kv_heads=2)  # head_dim 32: k_proj has 64 rows
    fp8, _ = vg.generator_layout(small, spec().precision)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.*64.*keep_bf16_layers"):
        vg.check_layout(small, fp8, 1)
    fp8, _ = vg.generator_layout(config(), spec().precision)
    vg.check_layout(config(), fp8, 1)  # every part a multiple of 128
    with pytest.raises(ValueError, match=r"k_proj.*128.*tensor_parallel_size 2"):
        vg.check_layout(config(), fp8, 2)  # one 128-row KV head cannot split over two GPUs


def test_engine_arguments_of_an_fp8_job() -> None:
    job = spec(keep_bf16_layers=[1, 0], fp8_kv_cache=True)
    kwargs = vg.engine_kwargs(job, "/models/tiny", ["model.layers.0.self_attn.q_proj"])
    assert kwargs["quantization"] == "fp8" and kwargs["kv_cache_dtype"] == "fp8"
    qc = kwargs["hf_overrides"]["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["activation_scheme"] == "dynamic"
    assert qc["weight_block_size"] == [128, 128]
    assert qc["ignored_layers"] == ["model.layers.0.self_attn.q_proj"]
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["load_format"] == "dummy"
    assert kwargs["tensor_parallel_size"] == 1 and kwargs["skip_tokenizer_init"]
    module, _, name = kwargs["worker_extension_cls"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is WeightChannelExtension
    plain = vg.engine_kwargs(spec(recipe="bf16"), "m", [])
    assert "quantization" not in plain and "kv_cache_dtype" not in plain
    assert vg.vllm_environment(job.precision) == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
    assert vg.vllm_environment(spec(power_of_two_scales=True).precision)["VLLM_USE_DEEP_GEMM_E8M0"] == "1"


def test_sampling_arguments() -> None:
    s = vg.sampling_kwargs(32, 0.7, 0.9, 5, eos_id=2)
    assert (s["temperature"], s["top_p"], s["max_tokens"], s["seed"]) == (0.7, 0.9, 32, 5)
    assert s["logprobs"] == 0 and s["stop_token_ids"] == [2] and not s["detokenize"] and s["n"] == 1
    assert vg.sampling_kwargs(8, 0.0, 0.9, 1, 2)["top_p"] == 1.0  # greedy


def _output(tokens: list[int], logps: list[float]) -> SimpleNamespace:
    """A RequestOutput as vLLM documents it: outputs[0].token_ids and per-position
    {token id: Logprob(logprob=...)} (logprobs=0: the sampled token only)."""
    lp = [
        {t: SimpleNamespace(logprob=v, rank=1, decoded_token=None)}
        for t, v in zip(tokens, logps, strict=True)
    ]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=lp, finish_reason="stop")])


def test_rollouts_from_vllm_outputs() -> None:
    eos, pad = 9, 0
    prompts = [[5, 6, 7], [8]]
    outputs = [_output([1, 2, eos], [-0.5, -1.0, -0.25]), _output([3, 4], [-2.0, -3.0])]  # 2nd: length
    r = vg.rollouts_from_outputs(prompts, outputs, pad, eos)
    assert r.prompt_ids.tolist() == [[5, 6, 7], [pad, pad, 8]]  # left-padded
    assert r.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert r.response_ids.tolist() == [[1, 2, eos], [3, 4, pad]]
    assert r.response_mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]  # EOS counts
    assert r.logprobs.tolist() == [[-0.5, -1.0, -0.25], [-2.0, -3.0, 0.0]]
    after_eos = vg.rollouts_from_outputs([[1]], [_output([4, eos, 4], [-1.0, -1.0, -1.0])], pad, eos)
    assert after_eos.response_ids.tolist() == [[4, eos]]
    missing = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1], logprobs=None)])
    with pytest.raises(ValueError, match="logprobs=0"):
        vg.rollouts_from_outputs([[1]], [missing], pad, eos)


def test_kv_bytes_and_audit() -> None:
    # 2 layers x (K and V) x 1 KV head x 128 head dim x 2 bytes (BF16) = 1024; FP8: 512
    assert vg.kv_bytes_per_token(config(), False) == 1024 and vg.kv_bytes_per_token(config(), True) == 512
    audit = vg.generator_audit(config(), spec(keep_bf16_layers=[1, 0]).precision)
    assert len(audit.fp8_layers) == 7 and "lm_head" in audit.high_precision_layers
    q = next(r for r in audit.rows if r.name == "model.layers.1.self_attn.q_proj")
    assert q.bytes_after == 256 * 256 + 4 * 4  # FP8 bytes + four 128x128 block scales


def test_the_worker_extension_adds_only_new_names() -> None:
    # vLLM asserts that no attribute of the extension already exists on its worker class
    names = [a for a in dir(WeightChannelExtension) if not a.startswith("__")]
    assert names and all(a.startswith(("fp8rl_", "_fp8rl_")) for a in names)


def test_the_worker_loads_the_trainers_bytes_unchanged() -> None:
    w = quantize(torch.randn(256, 128), "e4m3", (128, 128))
    norm = torch.randn(128)
    loaded: dict[str, torch.Tensor] = {}

    class FakeWorker(WeightChannelExtension):
        rank, device = 0, torch.device("cpu")

        def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
            assert is_checkpoint_format
            loaded.update(dict(weights_iterator))

    class Channel:
        def sync_weights(self, payload: Any) -> SyncResult:
            return SyncResult(
                3, 100, 0.5, 1, {"model.layers.0.mlp.up_proj.weight": w, "model.norm.weight": norm}
            )

    worker = FakeWorker()
    worker._fp8rl_channel = Channel()
    assert worker.fp8rl_receive_weights() == {"version": 3, "bytes": 100, "seconds": 0.5, "buckets": 1}
    up = "model.layers.0.mlp.up_proj"
    assert loaded[f"{up}.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(loaded[f"{up}.weight"].view(torch.uint8), w.data.view(torch.uint8))
    assert torch.equal(loaded[f"{up}.weight_scale_inv"], w.scale) and loaded[
        f"{up}.weight_scale_inv"
    ].shape == (2, 1)
    assert loaded["model.norm.weight"].dtype == torch.bfloat16
    assert isinstance(w, Fp8Tensor)


def test_the_gpu_example_fits_vllms_blocks() -> None:
    from transformers import Qwen2Config

    # Qwen2.5-1.5B (examples/rljob-qwen-gpu.yaml), its published config: head_dim 1536/12 = 128
    qwen = Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
    )
    job = parse_spec({"precision": {"keep_bf16_layers": [1, 1]}})
    fp8, bf16 = vg.generator_layout(qwen, job.precision)
    assert len(fp8) == 26 * 7 and len(bf16) == 2 * 7 + 1
    vg.check_layout(qwen, fp8, 1)  # q 1536, k/v 256, MLP 8960 = 70 x 128
    vg.check_layout(qwen, fp8, 2)  # k/v 128 per GPU
    with pytest.raises(ValueError, match=r"k_proj.*256.*tensor_parallel_size 4 gives 64"):
        vg.check_layout(qwen, fp8, 4)
