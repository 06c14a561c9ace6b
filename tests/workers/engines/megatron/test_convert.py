"""The Megatron trainer's pure parts on CPU: config mapping, names and layouts, TP/PP shards, the
right-aligned sequence layout, log-probs, the payload and the audit.

Expected values are written out by hand (labelled rows, literal configs) or come from a second
method: the fact sheet's own QKV split, a float64 log-softmax, the native trainer's left-padded
forward, and ``quantize`` called directly.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from rljob import JobSpec, parse_spec
from tests.workers.fp8 import reference as ref
from workers.engines.megatron.config import (
    MegatronShapes,
    fp8_environment,
    gpt_model_kwargs,
    megatron_state_shapes,
    transformer_config_kwargs,
)
from workers.engines.megatron.convert import (
    fuse_qkv,
    global_name,
    hf_payload,
    hf_to_megatron,
    local_name,
    megatron_to_hf,
    merge_tp_shards,
    parallel_kind,
    response_logprobs,
    right_align,
    shard_for_rank,
    split_qkv,
    stage_layers,
    stage_owned,
    stage_state,
    token_logprobs,
)
from workers.engines.native.trainer import sequence_logprobs
from workers.engines.protocols import Rollouts
from workers.fp8.linear_config import Fp8LinearConfig
from workers.fp8.quant import quantize


def llama(**kw: Any) -> LlamaConfig:
    base: dict[str, Any] = dict(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=500000.0,
        rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaConfig(**{**base, **kw})


def qwen2(**kw: Any) -> Qwen2Config:
    base: dict[str, Any] = dict(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2Config(**{**base, **kw})


def smollm2_shape(**kw: Any) -> LlamaConfig:
    """SmolLM2-135M's widths, which are not multiples of 128: hidden 576 (4.5 blocks), 9 query
    heads in 3 groups of head_dim 64 (k/v 192 rows: 1.5 blocks), intermediate 1536 (12 blocks)."""
    base: dict[str, Any] = dict(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64
    )
    return llama(**{**base, **kw})


def megatron_spec(recipe: str = "fp8-e2e", tp: int = 1, pp: int = 1, **precision: Any) -> JobSpec:
    return parse_spec(
        {
            "model": {"tiny": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}},
            "precision": {"recipe": recipe, **precision},
            "resources": {
                "trainer_engine": "megatron", "gpus_per_trainer": 1, "trainers": tp * pp,
                "trainer_tensor_parallel_size": tp, "trainer_pipeline_parallel_size": pp,
            },
        }
    )  # fmt: skip


# -- configs ---------------------------------------------------------------------------------------


def test_llama_transformer_config_by_hand() -> None:
    spec = megatron_spec("fp8-e2e", tp=2, keep_bf16_layers=(1, 0))
    kw = transformer_config_kwargs(llama(), spec)
    assert kw == {
        "num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_query_groups": 2,
        "ffn_hidden_size": 512, "kv_channels": 64, "normalization": "RMSNorm", "layernorm_epsilon": 1e-5,
        "gated_linear_unit": True, "activation_func": F.silu, "add_bias_linear": False,
        "add_qkv_bias": False, "hidden_dropout": 0.0, "attention_dropout": 0.0, "bf16": True,
        "params_dtype": torch.float32, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
        "sequence_parallel": False, "fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": False,
        "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 0,
    }  # fmt: skip
    # 1000 rows padded to a multiple of 128 * tp = 256: 4 * 256 = 1024
    assert gpt_model_kwargs(llama(), 2) == {
        "vocab_size": 1024, "max_sequence_length": 4096, "position_embedding_type": "rope",
        "rotary_base": 500000, "share_embeddings_and_output_weights": False, "parallel_output": True,
    }  # fmt: skip


def test_qwen2_transformer_config_by_hand() -> None:
    spec = megatron_spec("bf16", pp=2, master_dtype="bfloat16")
    kw = transformer_config_kwargs(qwen2(), spec)
    assert kw["add_qkv_bias"] is True and kw["kv_channels"] == 64  # 256 / 4 heads
    assert kw["fp8"] is None and "fp8_recipe" not in kw and "first_last_layers_bf16" not in kw
    assert kw["pipeline_dtype"] == torch.bfloat16 and kw["params_dtype"] == torch.bfloat16
    assert kw["layernorm_epsilon"] == 1e-6
    g = gpt_model_kwargs(qwen2(), 1)
    assert g["vocab_size"] == 1024 and g["share_embeddings_and_output_weights"] is True
    assert g["rotary_base"] == 10000 and g["max_sequence_length"] == 2048


def test_fp8_options() -> None:
    kw = transformer_config_kwargs(llama(), megatron_spec("fp8-e2e"))
    assert "first_last_layers_bf16" not in kw  # (0, 0) keeps nothing
    assert fp8_environment(megatron_spec()) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    pow2 = megatron_spec(power_of_two_scales=True)
    assert fp8_environment(pow2) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}


def test_llama3_rope_scaling_maps_to_the_factor() -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # fmt: skip
    g = gpt_model_kwargs(llama(rope_scaling=rope, max_position_embeddings=131072), 1)
    assert g["rope_scaling"] is True and g["rope_scaling_factor"] == 8.0


@pytest.mark.parametrize(
    ("config", "spec", "words"),
    [
        (lambda: llama(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                        "original_max_position_embeddings": 1024}), None, "'yarn'"),
        (lambda: llama(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       max_position_embeddings=131072), None, "low_freq_factor"),
        (lambda: qwen2(use_sliding_window=True, sliding_window=128, max_window_layers=0), None, "sliding"),
        (lambda: MistralConfig(num_hidden_layers=2), None, "model_type 'mistral'"),
        (lambda: llama(attention_bias=True), None, "attention_bias"),
        (lambda: llama(num_key_value_heads=1), megatron_spec(tp=2), "trainer_tensor_parallel_size (2)"),
        (lambda: llama(num_hidden_layers=6), megatron_spec(pp=4), "trainer_pipeline_parallel_size (4)"),
        (llama, megatron_spec(pp=2, keep_bf16_layers=(3, 0)), "precision.keep_bf16_layers"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_refused(config: Any, spec: JobSpec | None, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        transformer_config_kwargs(config(), spec or megatron_spec())


# -- names and layouts -----------------------------------------------------------------------------

# heads 4, kv heads 2 (2 heads per group), head_dim 2, hidden 3
TINY = MegatronShapes(layers=1, heads=4, kv_heads=2, head_dim=2, hidden=3, ffn=4, vocab=5,
                      padded_vocab=8, tied=False, qkv_bias=True)  # fmt: skip


def labelled(labels: list[int], cols: int = 3) -> torch.Tensor:
    """One row per label, every element of the row equal to it."""
    return torch.tensor(labels, dtype=torch.float32)[:, None].repeat(1, cols)


def test_qkv_is_interleaved_per_query_group() -> None:
    q = labelled([100, 100, 101, 101, 102, 102, 103, 103])  # head h: 2 rows of 100 + h
    k = labelled([200, 200, 201, 201])  # group g: 200 + g
    v = labelled([300, 300, 301, 301])
    fused = fuse_qkv(q, k, v, TINY)
    # group 0: its q heads 0, 1, then k0, v0; group 1: heads 2, 3, k1, v1
    expected = [100, 100, 101, 101, 200, 200, 300, 300, 102, 102, 103, 103, 201, 201, 301, 301]
    assert fused[:, 0].tolist() == expected and (fused == fused[:, :1]).all()
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], TINY)  # 1-D biases, same order
    assert bias.tolist() == expected
    for got, want in zip(split_qkv(fused, TINY), (q, k, v), strict=True):
        assert torch.equal(got, want)


def test_qkv_split_agrees_with_megatrons_own_view() -> None:
    """Megatron reads linear_qkv as [ng, (nq/ng + 2) * d, H] and splits it [nq/ng*d, d, d]."""
    cfg = MegatronShapes(1, heads=8, kv_heads=2, head_dim=4, hidden=5, ffn=4, vocab=5, padded_vocab=8,
                         tied=False, qkv_bias=False)  # fmt: skip
    q, k, v = torch.randn(32, 5), torch.randn(8, 5), torch.randn(8, 5)
    grouped = fuse_qkv(q, k, v, cfg).view(2, (4 + 2) * 4, 5)
    mq, mk, mv = grouped[:, :16], grouped[:, 16:20], grouped[:, 20:]
    assert torch.equal(mq.reshape(-1, 5), q) and torch.equal(mk.reshape(-1, 5), k)
    assert torch.equal(mv.reshape(-1, 5), v)


def random_hf_state(config: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


# The two layer specs' names of layer 0's RMSNorm weights, written out (Megatron-Core 0.16's
# TELayerNormColumnParallelLinear.layer_norm_weight vs the local spec's norm modules)
NORMS = {
    "te": ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"),
    "local": ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
}


@pytest.mark.parametrize("layout", ["te", "local"])
@pytest.mark.parametrize("config", [llama, qwen2, smollm2_shape], ids=["llama", "qwen2-tied", "smollm2-576"])
def test_hf_megatron_round_trip_is_exact(config: Any, layout: Any) -> None:
    hf_config = config(num_hidden_layers=2, vocab_size=300)
    cfg = MegatronShapes.from_hf(hf_config, layout=layout)
    state = random_hf_state(hf_config)
    meg = hf_to_megatron(state, cfg)
    assert {k: tuple(v.shape) for k, v in meg.items()} == megatron_state_shapes(cfg)
    assert ("output_layer.weight" in meg) == (not cfg.tied)
    emb = meg["embedding.word_embeddings.weight"]  # 300 rows padded to 384 with zeros
    assert emb.shape[0] == 384 and torch.equal(emb[:300], state["model.embed_tokens.weight"])
    assert not emb[300:].any()
    gate, up = state["model.layers.1.mlp.gate_proj.weight"], state["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(meg["decoder.layers.1.mlp.linear_fc1.weight"], torch.cat([gate, up]))
    attn_norm, mlp_norm = NORMS[layout]
    assert torch.equal(meg[f"decoder.layers.0.{attn_norm}"], state["model.layers.0.input_layernorm.weight"])
    assert torch.equal(
        meg[f"decoder.layers.1.{mlp_norm}"], state["model.layers.1.post_attention_layernorm.weight"]
    )
    other = NORMS["local" if layout == "te" else "te"]
    assert not any(name.endswith(other) for name in meg)  # one layout's names only
    back = megatron_to_hf(meg, cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_the_layouts_differ_only_in_the_norm_names() -> None:
    hf_config = qwen2(num_hidden_layers=2, vocab_size=300)
    te, local = (MegatronShapes.from_hf(hf_config, layout=x) for x in ("te", "local"))
    te_names, local_names = megatron_state_shapes(te), megatron_state_shapes(local)
    renamed = {
        name.replace(NORMS["te"][0], NORMS["local"][0]).replace(NORMS["te"][1], NORMS["local"][1]): shape
        for name, shape in te_names.items()
    }
    assert renamed == local_names
    # 4 norm weights renamed (2 layers x 2), each [hidden], replicated over tensor-parallel ranks
    assert len(set(te_names) - set(local_names)) == 4
    for name in set(local_names) - set(te_names):
        assert local_names[name] == (256,) and parallel_kind(name) == "replicated"
    with pytest.raises(ValueError, match="not a parameter"):
        parallel_kind("decoder.layers.0.post_attention_layernorm.weight")  # the HF name, not Megatron's


def test_hf_state_that_does_not_fit_is_refused() -> None:
    hf_config = llama(num_hidden_layers=1, vocab_size=300)
    cfg = MegatronShapes.from_hf(hf_config)
    state = random_hf_state(hf_config)
    with pytest.raises(ValueError, match="unexpected"):
        hf_to_megatron({**state, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, cfg)
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match=r"model\.norm\.weight is missing"):
        hf_to_megatron(state, cfg)


# -- tensor parallelism ----------------------------------------------------------------------------


def test_tp_shards_hold_whole_query_groups_and_gate_up_pairs() -> None:
    q = labelled([100, 100, 101, 101, 102, 102, 103, 103])
    k, v = labelled([200, 200, 201, 201]), labelled([300, 300, 301, 301])
    qkv = fuse_qkv(q, k, v, TINY)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shard_for_rank(name, qkv, 0, 2, TINY)[:, 0].tolist() == [100, 100, 101, 101, 200, 200, 300, 300]
    assert shard_for_rank(name, qkv, 1, 2, TINY)[:, 0].tolist() == [102, 102, 103, 103, 201, 201, 301, 301]
    fc1 = labelled([1000, 1001, 1002, 1003, 2000, 2001, 2002, 2003])  # [gate rows; up rows]
    fc1_name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert shard_for_rank(fc1_name, fc1, 0, 2, TINY)[:, 0].tolist() == [1000, 1001, 2000, 2001]
    assert shard_for_rank(fc1_name, fc1, 1, 2, TINY)[:, 0].tolist() == [1002, 1003, 2002, 2003]
    proj = torch.arange(12.0).reshape(3, 4)  # row-parallel: columns
    proj_name = "decoder.layers.0.self_attention.linear_proj.weight"
    assert shard_for_rank(proj_name, proj, 1, 2, TINY).tolist() == [[2, 3], [6, 7], [10, 11]]


@pytest.mark.parametrize("layout", ["te", "local"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shard_merge_round_trip(tp: int, layout: Any) -> None:
    hf_config = llama(num_hidden_layers=2, vocab_size=300, num_attention_heads=8, num_key_value_heads=4)
    cfg = MegatronShapes.from_hf(hf_config, tp, layout)
    full = hf_to_megatron(random_hf_state(hf_config), cfg)
    norms = (*NORMS[layout], "final_layernorm.weight")
    for name, t in full.items():
        shards = [shard_for_rank(name, t, r, tp, cfg) for r in range(tp)]
        if name.endswith(norms):
            assert all(s is t for s in shards)
        else:
            assert sum(s.numel() for s in shards) == t.numel()
        assert torch.equal(merge_tp_shards(name, shards, cfg), t), name


# -- pipeline stages -------------------------------------------------------------------------------


def test_stage_layer_renumbering() -> None:
    assert stage_layers(8, 4, 1) == range(2, 4)
    assert (
        local_name("decoder.layers.5.mlp.linear_fc2.weight", 8, 4, 2)
        == "decoder.layers.1.mlp.linear_fc2.weight"
    )
    assert (
        global_name("decoder.layers.1.mlp.linear_fc2.weight", 8, 4, 2)
        == "decoder.layers.5.mlp.linear_fc2.weight"
    )
    assert local_name("embedding.word_embeddings.weight", 8, 4, 0) == "embedding.word_embeddings.weight"
    with pytest.raises(ValueError, match="not on pipeline stage 1"):
        local_name("decoder.layers.5.mlp.linear_fc2.weight", 8, 4, 1)
    with pytest.raises(ValueError, match="equal stages"):
        stage_layers(6, 4, 0)


def test_stage_states_split_the_model_and_copy_tied_embeddings() -> None:
    hf_config = qwen2(num_hidden_layers=4, vocab_size=300)  # tied
    cfg = MegatronShapes.from_hf(hf_config)
    full = hf_to_megatron(random_hf_state(hf_config), cfg)
    first, last = stage_state(full, cfg, 2, 0), stage_state(full, cfg, 2, 1)
    assert "embedding.word_embeddings.weight" in first and "decoder.final_layernorm.weight" not in first
    assert torch.equal(
        last["decoder.layers.0.self_attention.linear_proj.weight"],
        full["decoder.layers.2.self_attention.linear_proj.weight"],
    )
    assert last["output_layer.weight"] is full["embedding.word_embeddings.weight"]  # the tied copy
    owned = stage_owned(cfg, 2, 0) + stage_owned(cfg, 2, 1)
    assert sorted(owned) == sorted(full) and len(set(owned)) == len(owned)  # each name once
    assert "output_layer.weight" not in stage_owned(cfg, 2, 1)


# -- sequences -------------------------------------------------------------------------------------


def overwriting_ce(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Megatron's vocab_parallel_cross_entropy at tp=1, overwriting its input as it does."""
    x -= x.max(-1, keepdim=True).values
    return x.exp().sum(-1).log() - x.gather(-1, target[..., None]).squeeze(-1)


def hand_batch() -> Rollouts:
    """Row 0: prompt [5, 6] (one pad), response [7, 8] then a pad; row 1: prompt [9, 10, 11],
    response [12] then pads. Pad id 99."""
    return Rollouts(
        prompt_ids=torch.tensor([[99, 5, 6], [9, 10, 11]]),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        response_ids=torch.tensor([[7, 8, 99], [12, 99, 99]]),
        response_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
        logprobs=torch.zeros(2, 3),
    )


def test_right_align_by_hand() -> None:
    aligned = right_align(hand_batch())
    assert aligned.ids.tolist() == [[5, 6, 7, 8, 99, 0], [9, 10, 11, 12, 99, 99]]
    assert aligned.targets.tolist() == [[6, 7, 8, 99, 0, 0], [10, 11, 12, 99, 99, 0]]
    # response token k of a row with prompt length n is predicted at position n - 1 + k
    assert aligned.response_index.tolist() == [[1, 2, 3], [2, 3, 4]]
    assert aligned.targets.gather(1, aligned.response_index).tolist() == [[7, 8, 99], [12, 99, 99]]
    assert right_align(hand_batch(), multiple=16).ids.shape == (2, 16)
    token_logp = torch.arange(12.0).reshape(2, 6) + 0.5
    assert response_logprobs(token_logp, aligned.response_index, hand_batch().response_mask).tolist() == [
        [1.5, 2.5, 0.0],
        [8.5, 0.0, 0.0],
    ]


def test_right_aligned_forward_equals_the_left_padded_one() -> None:
    """A second method: the native trainer's forward (left padding, position ids counting valid
    tokens, padding mask) and a plain causal forward on right-aligned rows (positions 0..T-1, as
    Megatron computes) give the same float32 log-probs."""
    torch.manual_seed(0)
    config = llama(num_hidden_layers=2, vocab_size=64, hidden_size=64, intermediate_size=128, head_dim=16)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    lengths = [2, 5, 7]
    prompt_ids = torch.zeros(3, 7, dtype=torch.long)
    prompt_mask = torch.zeros(3, 7, dtype=torch.long)
    for i, n in enumerate(lengths):
        prompt_ids[i, 7 - n :] = torch.randint(1, 64, (n,))
        prompt_mask[i, 7 - n :] = 1
    response_mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    batch = Rollouts(prompt_ids, prompt_mask, torch.randint(1, 64, (3, 4)), response_mask, torch.zeros(3, 4))
    with torch.no_grad():
        native = sequence_logprobs(model, batch, 0.7, compute_dtype=torch.float32)
        aligned = right_align(batch, multiple=16)
        logits = model(input_ids=aligned.ids).logits  # causal, positions 0..T-1
        ours = response_logprobs(
            token_logprobs(logits, aligned.targets, 0.7), aligned.response_index, response_mask
        )
    torch.testing.assert_close(ours, native, atol=1e-5, rtol=0)


def test_token_logprobs_against_float64() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11) * 4
    targets = torch.randint(0, 11, (2, 5))
    reference = torch.log_softmax(logits.double() / 0.6, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, targets, 0.6), reference.float(), atol=1e-5, rtol=0)

    before = logits.clone()
    got = token_logprobs(logits, targets, 0.6, overwriting_ce)
    torch.testing.assert_close(got, reference.float(), atol=1e-5, rtol=0)
    assert torch.equal(logits, before)  # the caller's logits are untouched


def test_padded_vocab_columns_take_no_probability() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 8)  # 6 real tokens, 2 padding columns
    targets = torch.randint(0, 6, (2, 3))
    reference = torch.log_softmax(logits[..., :6].double(), -1).gather(-1, targets[..., None]).squeeze(-1)
    # unmasked, the padding columns take probability
    assert not torch.allclose(token_logprobs(logits, targets, 1.0), reference.float(), atol=1e-3)
    # masked inside token_logprobs, on its own temporary
    before = logits.clone()
    got = token_logprobs(logits, targets, 1.0, overwriting_ce, valid_vocab=6)
    torch.testing.assert_close(got, reference.float(), atol=1e-6, rtol=0)
    assert torch.equal(logits, before)
    # two tensor-parallel ranks of 4 columns each: rank 1 holds global ids 4..7, of which 6 and 7 pad
    seen: list[torch.Tensor] = []

    def capture(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        seen.append(x.clone())
        return torch.zeros(t.shape)

    for rank in range(2):
        token_logprobs(
            logits[..., 4 * rank : 4 * rank + 4], targets, 1.0, capture, valid_vocab=6, vocab_start=4 * rank
        )
    assert torch.isfinite(seen[0]).all() and torch.isfinite(seen[1][..., :2]).all()
    assert torch.isinf(seen[1][..., 2:]).all()


# -- payload and audit -----------------------------------------------------------------------------


@pytest.mark.parametrize("power_of_two", [False, True])
def test_hf_payload_quantizes_the_named_weights(power_of_two: bool) -> None:
    torch.manual_seed(0)
    q_name, norm_name = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"
    state = {q_name: torch.randn(256, 192), norm_name: torch.randn(192)}
    config = Fp8LinearConfig(power_of_two_scales=power_of_two)
    payload = hf_payload(state, [q_name], config)
    expected = quantize(state[q_name], "e4m3", (128, 128), power_of_two=power_of_two)
    got = payload[q_name]
    assert not isinstance(got, torch.Tensor)
    assert got.block == (128, 128) and got.scale.shape == (2, 2)
    assert torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8))
    assert torch.equal(got.scale, expected.scale)
    if power_of_two:
        assert torch.equal(got.scale, torch.exp2(torch.log2(got.scale).round()))
    norm = payload[norm_name]
    assert isinstance(norm, torch.Tensor) and norm.dtype == torch.bfloat16
    assert torch.equal(norm, state[norm_name].to(torch.bfloat16))
    with pytest.raises(ValueError, match="not in the model"):
        hf_payload(state, ["model.layers.7.mlp.up_proj.weight"], config)


def test_audit_rows_say_what_is_fp8_and_why() -> None:
    from workers.engines.megatron.config import megatron_audit

    shapes = MegatronShapes.from_hf(llama())
    audit = megatron_audit(shapes, megatron_spec("fp8-e2e", keep_bf16_layers=(1, 0)).precision)
    rows = {r.name: r for r in audit.rows}
    linears = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    assert audit.fp8_layers == [f"decoder.layers.{i}.{m}" for i in (1, 2, 3) for m in linears]
    assert "first 1 kept in BF16" in rows["decoder.layers.0.mlp.linear_fc1"].reason
    qkv = rows["decoder.layers.1.self_attention.linear_qkv"]
    # (4 + 2*2) heads * 64 = 512 rows x 256: 131072 bytes of E4M3 + 4 x 2 blocks of float32 scales
    assert qkv.shape == (512, 256) and qkv.bytes_after == 131072 + 8 * 4 and qkv.bytes_before == 262144
    assert qkv.kernels == {"fprop": "te_blockwise", "dgrad": "te_blockwise", "wgrad": "te_blockwise"}
    assert rows["embedding.word_embeddings"].kind == "embedding" and rows["output_layer"].kind == "lm_head"
    assert rows["decoder.layers.2.mlp.linear_fc1.layer_norm"].precision == "bfloat16"
    assert "float32 scales" in audit.formats
    bf16 = megatron_audit(shapes, megatron_spec("bf16").precision)
    assert not bf16.fp8_layers and not bf16.kernel_reasons
    assert rows["decoder.final_layernorm"].kind == "norm"
    assert bf16.rows[1].reason == "norms stay high precision"
    assert all("recipe bf16" in r.reason for r in bf16.rows if r.kind == "linear")
    assert math.isclose(float(audit.summary()["fp8_layers"]), 12)


def test_audit_of_the_cpu_trainer_names_the_local_norms_and_its_compute_dtype() -> None:
    from workers.engines.megatron.config import megatron_audit

    shapes = MegatronShapes.from_hf(llama(num_hidden_layers=2), layout="local")
    audit = megatron_audit(shapes, megatron_spec("bf16").precision, "CPU", torch.float32)
    rows = {r.name: r for r in audit.rows}
    assert [n for n, r in rows.items() if r.kind == "norm"] == [
        "decoder.layers.0.input_layernorm", "decoder.layers.0.pre_mlp_layernorm",
        "decoder.layers.1.input_layernorm", "decoder.layers.1.pre_mlp_layernorm", "decoder.final_layernorm",
    ]  # fmt: skip
    qkv = rows["decoder.layers.0.self_attention.linear_qkv"]
    # (4 + 2*2) heads * 64 = 512 rows x 256, 4 bytes each in float32
    assert qkv.precision == "float32" and qkv.bytes_before == 512 * 256 * 4
    assert qkv.reason == "recipe bf16: the trainer runs float32" and audit.device == "CPU"
    assert not audit.fp8_layers


# -- partial 128-blocks (SmolLM2's 576-wide layers) -------------------------------------------------


def test_a_576_wide_model_fuses_and_shards_by_query_group() -> None:
    # 9 heads of 64 in 3 groups: group g of linear_qkv is q heads 3g..3g+2 (192 rows), k_g (64),
    # v_g (64): 320 rows, starting at 320 g, a multiple of 64 but not of 128 (written out by hand)
    hf_config = smollm2_shape(num_hidden_layers=1, vocab_size=300)
    state = random_hf_state(hf_config)
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    tp = 3
    cfg = MegatronShapes.from_hf(hf_config, tp)
    meg = hf_to_megatron(state, cfg)
    qkv = meg["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert tuple(qkv.shape) == (960, 576)
    for g in range(3):
        rows = qkv[320 * g : 320 * (g + 1)]
        assert torch.equal(rows[:192], q[192 * g : 192 * (g + 1)])
        assert torch.equal(rows[192:256], k[64 * g : 64 * (g + 1)]) and torch.equal(
            rows[256:], v[64 * g : 64 * (g + 1)]
        )
        assert torch.equal(
            shard_for_rank("decoder.layers.0.self_attention.linear_qkv.weight", qkv, g, tp, cfg), rows
        )
    fc2 = meg["decoder.layers.0.mlp.linear_fc2.weight"]  # [576, 1536], row-parallel: 512 inputs each
    assert torch.equal(
        shard_for_rank("decoder.layers.0.mlp.linear_fc2.weight", fc2, 2, tp, cfg), fc2[:, 1024:]
    )


def test_a_576_wide_payload_has_ceil_scale_grids_and_dequantizes_within_fp8_error() -> None:
    # The Megatron trainer's payload: its state back in Hugging Face names (megatron_to_hf), every
    # decoder linear quantized in 128x128 blocks with partial last blocks: scale grids
    # ceil(N/128) x ceil(K/128) by hand, and data * scale within reference.py's E4M3 bound of
    # the master weight.
    hf_config = smollm2_shape(num_hidden_layers=1, vocab_size=300)
    cfg = MegatronShapes.from_hf(hf_config)
    state = random_hf_state(hf_config)
    linears = [n for n in state if n.endswith("_proj.weight")]
    payload = hf_payload(megatron_to_hf(hf_to_megatron(state, cfg), cfg), linears, Fp8LinearConfig())
    grids = {
        "q": (5, 5),
        "k": (2, 5),
        "v": (2, 5),
        "o": (5, 5),
        "gate": (12, 5),
        "up": (12, 5),
        "down": (5, 12),
    }
    for name in linears:
        got = payload[name]
        assert not isinstance(got, torch.Tensor)
        proj = name.split(".")[-2].removesuffix("_proj")
        assert tuple(got.scale.shape) == grids[proj], name
        n, k = state[name].shape
        scale = got.scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        err = (got.data.double() * scale - state[name].double()).abs()
        assert bool((err <= ref.error_bound(state[name], (128, 128), "e4m3")).all()), name
