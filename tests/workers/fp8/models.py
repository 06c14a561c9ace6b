"""Tiny Hugging Face Llama and Qwen2 models built from a config (no download)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHS = ("llama", "qwen2")


def tiny_model(arch: str = "llama", layers: int = 4, hidden: int = 64, seed: int = 0) -> Any:
    """A randomly initialised model in eval mode (typed Any: HF models are dynamic)."""
    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)).eval()
