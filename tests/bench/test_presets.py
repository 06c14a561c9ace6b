"""The benchmark model presets (bench/common.py) build the models they say, counted on ``meta``
(no memory) against parameter counts worked out by hand from the layer shapes."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from bench.common import bench_spec, vocab_size
from workers.engines.models import model_config


def llama_parameters(hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, vocab: int) -> int:
    """A Llama decoder with untied embeddings, by hand: per layer q and o (hidden^2 each), k and v
    (hidden x kv_heads x head_dim each), gate/up/down (hidden x mlp each), two RMSNorm weights;
    then the embedding, the lm_head and the final norm."""
    head_dim = hidden // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * mlp + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def test_the_8b_shaped_preset_has_an_8b_models_layers() -> None:
    spec = bench_spec("8b-4l", "bf16", torch.device("cpu"))
    vocab = vocab_size("8b-4l", 259)
    assert vocab == 32768
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(spec, vocab))
    # Llama-3-8B's layer: hidden 4096, MLP 14336, 32 query heads, 8 KV heads of 128
    want = llama_parameters(4096, 14336, 4, 32, 8, 32768)
    assert sum(p.numel() for p in model.parameters()) == want == 1_140_887_552
    mlp = model.model.layers[0].mlp
    assert tuple(mlp.gate_proj.weight.shape) == (14336, 4096)
    assert tuple(mlp.down_proj.weight.shape) == (4096, 14336)
    assert tuple(model.model.layers[0].self_attn.k_proj.weight.shape) == (1024, 4096)
