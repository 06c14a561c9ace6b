"""What a job spec costs, estimated from the spec alone (no model or tokenizer is read), for the
caps the control plane and the operator put on one job (``service.admission``,
``operators.admission``).

- **parameters** of a ``model.tiny`` (a pretrained model's size is what its files hold: its
  checkpoint is bounded by the file system, not here): embeddings, per layer the attention
  projections (grouped K/V), the gated MLP and two norms, the final norm, and the LM head unless
  tied. The vocabulary is the byte tokenizer's 259, or ``HF_VOCAB_BOUND`` for a Hugging Face one,
  padded to a multiple of 16 as the engines build it.
- **tokens per step**: every response of a step at its longest, ``prompts_per_step x group_size x
  max_new_tokens``: what the generators produce and the trainers train on at most.
- **threads**: the torch threads of every actor, ``(trainers + generators) x threads_per_actor``
  (0 counts as one per actor: the cores shared out).
- **params bytes**: ``task.params`` as compact JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from rljob.spec import JobSpec, TinyModel

BYTES_VOCAB = 259  # workers.models.tokenizer's byte-level tokenizer: 256 bytes and 3 specials
VOCAB_MULTIPLE = 16  # the engines pad the vocabulary to this (workers.engines.models.padded_vocab)
HF_VOCAB_BOUND = 262_144  # the largest vocabulary of the Hugging Face families we run (Gemma 3's)


def tiny_parameters(tiny: TinyModel, vocab: int) -> int:
    """Parameters of a Llama/Qwen2 decoder built from ``tiny`` (Qwen2's Q/K/V biases included)."""
    h, inter, heads, kv = tiny.hidden_size, tiny.intermediate_size, tiny.num_heads, tiny.num_kv_heads
    head_dim = h // heads
    attention = h * h * 2 + 2 * h * kv * head_dim  # q, o; k, v
    if tiny.arch == "qwen2":
        attention += h + 2 * kv * head_dim  # the q, k, v biases
    layer = attention + 3 * h * inter + 2 * h  # gate, up, down; two RMSNorms
    padded = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    embeddings = padded * h * (1 if tiny.tie_word_embeddings else 2)
    return embeddings + tiny.num_layers * layer + h


@dataclass(frozen=True)
class Costs:
    parameters: int  # 0 for a pretrained model (its files bound it)
    tokens_per_step: int
    actors: int
    threads: int
    params_bytes: int


def costs(spec: JobSpec) -> Costs:
    """The estimates of the module docstring."""
    tiny = spec.model.tiny
    vocab = BYTES_VOCAB if spec.tokenizer.kind == "bytes" else HF_VOCAB_BOUND
    r = spec.resources
    actors = r.trainers + r.generators
    return Costs(
        parameters=tiny_parameters(tiny, vocab) if tiny is not None else 0,
        tokens_per_step=spec.rollout.prompts_per_step * spec.rollout.group_size * spec.rollout.max_new_tokens,
        actors=actors,
        threads=actors * max(1, r.threads_per_actor),
        params_bytes=len(json.dumps(spec.task.params, separators=(",", ":"))),
    )
