"""Pure helpers of the Megatron-Core trainer: parameter names and layouts, tensor- and
pipeline-parallel shards, the sequence layout, log-probs and the weight-sync payload (its
configuration is in :mod:`workers.engines.megatron.config`).

Nothing here imports Megatron-Core or Transformer Engine, so all of it is tested on CPU; the
adapter (:mod:`workers.engines.megatron.trainer`) wires it to the real model.

Layouts (Megatron-Core 0.16, Transformer Engine's layer spec or its local one; Hugging Face
Llama/Qwen2):

- ``linear_qkv.weight`` ``[(nq + 2*ng) * d, H]`` is interleaved *per query group*: for each of
  the ``ng`` groups, that group's ``nq/ng`` query heads, then its key head, then its value head
  (``q1 q2 k1 v1 | q3 q4 k2 v2 | ..``); the Qwen2 bias likewise. Under tensor parallelism a rank
  holds ``ng/tp`` whole groups: a contiguous slice of the fused rows.
- ``linear_fc1.weight`` is ``[gate; up]`` (the GLU applies the activation to the first half);
  under tensor parallelism rank ``r`` holds ``[gate_r; up_r]``, not a slice of ``[gate; up]``.
- Column-parallel (split along dim 0): ``linear_qkv``, ``linear_fc1``, word embeddings, output
  layer (the vocabulary). Row-parallel (dim 1): ``linear_proj``, ``linear_fc2``. The RMSNorm
  weights are replicated: with TE fused into ``linear_qkv`` / ``linear_fc1`` as
  ``layer_norm_weight``, with the local spec ``input_layernorm`` / ``pre_mlp_layernorm`` modules
  (:attr:`~workers.engines.megatron.config.MegatronShapes.norm_names`).
- Pipeline stages hold consecutive layers, numbered from 0 in each stage's state dict.
- The vocabulary is padded to a multiple of ``128 * tp``: every rank's share of the embedding and
  output layer must be equal, and 128 keeps those GEMMs tensor-core shaped. The padded rows are
  never looked up, and their logits are masked to -inf (:func:`token_logprobs`), so the
  softmax runs over the Hugging Face vocabulary exactly.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from workers.engines.megatron.config import (
    MegatronShapes,
    megatron_state_shapes,
)
from workers.engines.protocols import Rollouts
from workers.fp8.fp8_tensor import Fp8Tensor
from workers.fp8.linear_config import Fp8LinearConfig

# -- names and layouts (full model) ------------------------------------------------------------------


def _layer_renames(cfg: MegatronShapes) -> tuple[tuple[str, str], ...]:
    """Per-layer one-to-one names: (Hugging Face suffix, Megatron suffix) in ``cfg.layout``."""
    attn_norm, mlp_norm = cfg.norm_names
    return (
        ("input_layernorm.weight", attn_norm),
        ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
        ("post_attention_layernorm.weight", mlp_norm),
        ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
    )


_GLOBAL_RENAMES = (
    ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    ("model.norm.weight", "decoder.final_layernorm.weight"),
    ("lm_head.weight", "output_layer.weight"),
)
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: MegatronShapes) -> torch.Tensor:
    """``linear_qkv`` rows from q ``[nq*d, ...]``, k and v ``[ng*d, ...]`` (weights or biases)."""
    g, hpg, d = cfg.kv_heads, cfg.heads_per_group, cfg.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, hpg * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(g * (hpg + 2) * d, *rest)  # [ng*(hpg+2)*d, ...]


def split_qkv(fused: torch.Tensor, cfg: MegatronShapes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: ``(q, k, v)``."""
    g, hpg, d = cfg.kv_heads, cfg.heads_per_group, cfg.head_dim
    rest = fused.shape[1:]
    q, k, v = torch.split(fused.reshape(g, (hpg + 2) * d, *rest), [hpg * d, d, d], dim=1)
    return q.reshape(g * hpg * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def _take(state: Mapping[str, torch.Tensor], name: str, direction: str) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"{direction}: {name} is missing; the state does not fit the model config")
    return state[name]


def hf_to_megatron(state: Mapping[str, torch.Tensor], cfg: MegatronShapes) -> dict[str, torch.Tensor]:
    """Hugging Face names and layouts -> Megatron's, full model (vocabulary padded with zeros)."""
    where = "hf_to_megatron"
    out: dict[str, torch.Tensor] = {}
    for hf, meg in _GLOBAL_RENAMES:
        if hf == "lm_head.weight" and cfg.tied:
            continue
        t = _take(state, hf, where)
        out[meg] = F.pad(t, (0, 0, 0, cfg.padded_vocab - cfg.vocab)) if meg in _VOCAB_ROWS else t
    for i in range(cfg.layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf, meg in _layer_renames(cfg):
            out[m + meg] = _take(state, h + hf, where)
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = (_take(state, f"{h}self_attn.{p}_proj.{kind}", where) for p in "qkv")
            out[f"{m}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, cfg)
        gate, up = (_take(state, f"{h}mlp.{p}_proj.weight", where) for p in ("gate", "up"))
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
    extra = set(state) - _hf_names(cfg) - ({"lm_head.weight"} if cfg.tied else set())
    if extra:
        raise ValueError(
            f"{where}: unexpected names {sorted(extra)[:5]}; the state does not fit the model config"
        )
    return out


def megatron_to_hf(state: Mapping[str, torch.Tensor], cfg: MegatronShapes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron` (vocabulary padding dropped; no ``lm_head`` when tied)."""
    where = "megatron_to_hf"
    out: dict[str, torch.Tensor] = {}
    for hf, meg in _GLOBAL_RENAMES:
        if meg == "output_layer.weight" and cfg.tied:
            continue
        t = _take(state, meg, where)
        out[hf] = t[: cfg.vocab] if meg in _VOCAB_ROWS else t
    for i in range(cfg.layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf, meg in _layer_renames(cfg):
            out[h + hf] = _take(state, m + meg, where)
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = split_qkv(_take(state, f"{m}self_attention.linear_qkv.{kind}", where), cfg)
            for p, t in zip("qkv", (q, k, v), strict=True):
                out[f"{h}self_attn.{p}_proj.{kind}"] = t
        gate, up = _take(state, m + "mlp.linear_fc1.weight", where).chunk(2)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
    return out


def _hf_names(cfg: MegatronShapes) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if cfg.tied else {"lm_head.weight"})
    for i in range(cfg.layers):
        h = f"model.layers.{i}."
        names |= {h + hf for hf, _ in _layer_renames(cfg)}
        names |= {f"{h}self_attn.{p}_proj.weight" for p in "qkv"} | {
            f"{h}mlp.{p}_proj.weight" for p in ("gate", "up")
        }
        if cfg.qkv_bias:
            names |= {f"{h}self_attn.{p}_proj.bias" for p in "qkv"}
    return names


# -- tensor parallelism -------------------------------------------------------------------------------


def parallel_kind(name: str) -> str:
    """How a Megatron parameter is split over tensor-parallel ranks: ``column`` (dim 0), ``fc1``
    (``[gate_r; up_r]``), ``row`` (dim 1) or ``replicated``."""
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith(
        ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
    ):
        return "column"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    if name.endswith(
        ("layer_norm_weight", "input_layernorm.weight", "pre_mlp_layernorm.weight", "final_layernorm.weight")
    ):
        return "replicated"
    raise ValueError(f"{name}: not a parameter of the Megatron GPT model this trainer builds")


def _chunk(t: torch.Tensor, parts: int, dim: int, name: str) -> tuple[torch.Tensor, ...]:
    if t.shape[dim] % parts:
        raise ValueError(
            f"{name}: dim {dim} of shape {tuple(t.shape)} does not split into {parts} equal shards"
        )
    return t.chunk(parts, dim)


def shard_for_rank(
    name: str, tensor: torch.Tensor, tp_rank: int, tp: int, cfg: MegatronShapes
) -> torch.Tensor:
    """Rank ``tp_rank``'s share of a full Megatron parameter (see the module docstring)."""
    kind = parallel_kind(name)
    if kind == "replicated" or tp == 1:
        return tensor
    if kind == "column":
        if "linear_qkv" in name and cfg.kv_heads % tp:
            raise ValueError(f"{name}: {cfg.kv_heads} query groups do not split over {tp} ranks")
        return _chunk(tensor, tp, 0, name)[tp_rank].contiguous()
    if kind == "row":
        return _chunk(tensor, tp, 1, name)[tp_rank].contiguous()
    gate, up = _chunk(tensor, 2, 0, name)
    return torch.cat([_chunk(gate, tp, 0, name)[tp_rank], _chunk(up, tp, 0, name)[tp_rank]])


def merge_tp_shards(name: str, shards: list[torch.Tensor], cfg: MegatronShapes) -> torch.Tensor:
    """Inverse of :func:`shard_for_rank`: the full parameter from every rank's share, in rank order."""
    kind = parallel_kind(name)
    if kind == "replicated" or len(shards) == 1:
        return shards[0]
    if kind == "column":
        return torch.cat(shards, 0)
    if kind == "row":
        return torch.cat(shards, 1)
    halves = [s.chunk(2, 0) for s in shards]  # [(gate_r, up_r)]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)


# -- pipeline stages ------------------------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Global indices of the decoder layers pipeline stage ``stage`` of ``pp`` holds."""
    if num_layers % pp or not 0 <= stage < pp:
        raise ValueError(f"{num_layers} layers over {pp} stages (stage {stage}): need equal stages")
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def _renumber(name: str, shift: Callable[[int], int]) -> str:
    m = _LAYER.match(name)
    return name if m is None else f"decoder.layers.{shift(int(m.group(1)))}.{name[m.end() :]}"


def local_name(name: str, num_layers: int, pp: int, stage: int) -> str:
    """Global layer numbering -> the stage's own (Megatron numbers layers from 0 in each stage)."""
    layers = stage_layers(num_layers, pp, stage)

    def shift(i: int) -> int:
        if i not in layers:
            raise ValueError(
                f"{name}: layer {i} is not on pipeline stage {stage} (layers {layers.start}.."
                f"{layers.stop - 1})"
            )
        return i - layers.start

    return _renumber(name, shift)


def global_name(name: str, num_layers: int, pp: int, stage: int) -> str:
    """Inverse of :func:`local_name`."""
    start = stage_layers(num_layers, pp, stage).start
    return _renumber(name, lambda i: i + start)


def stage_owned(cfg: MegatronShapes, pp: int, stage: int) -> list[str]:
    """Global names of the full-model parameters that stage ``stage`` owns, sorted (the order the
    export sends them in). A tied output layer's copy on the last stage is not owned."""
    layers = stage_layers(cfg.layers, pp, stage)
    owned = []
    for name in megatron_state_shapes(cfg):
        m = _LAYER.match(name)
        if m is not None:
            keep = int(m.group(1)) in layers
        else:
            keep = stage == 0 if name.startswith("embedding.") else stage == pp - 1
        if keep:
            owned.append(name)
    return sorted(owned)


def stage_state(
    full: Mapping[str, torch.Tensor], cfg: MegatronShapes, pp: int, stage: int
) -> dict[str, torch.Tensor]:
    """What stage ``stage``'s model holds of a full Megatron state, with stage-local names. With
    tied embeddings and several stages, the last stage holds its own copy of the word embeddings
    as ``output_layer.weight`` (Megatron keeps the copies equal by all-reducing their gradients)."""
    out = {local_name(n, cfg.layers, pp, stage): full[n] for n in stage_owned(cfg, pp, stage)}
    if cfg.tied and pp > 1 and stage == pp - 1:
        out["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    return out


# -- sequences -------------------------------------------------------------------------------------------


class AlignedBatch(NamedTuple):
    """A batch with every row's tokens starting at position 0 (Megatron's RoPE positions).

    ids:            [B, T] int64, prompt then response, pads after (0)
    targets:        [B, T] int64, ``ids`` shifted left by one: position t predicts targets[t]
    response_index: [B, L] int64, the position whose prediction is response token k
    """

    ids: torch.Tensor
    targets: torch.Tensor
    response_index: torch.Tensor


def right_align(batch: Rollouts, multiple: int = 1) -> AlignedBatch:
    """Move each row's prompt padding to the end, on the batch's device without a host read.

    Megatron's RoPE uses positions ``0..T-1`` whatever the position ids, so a left-padded prompt
    would put its first token at position ``#pads``; the generator put it at 0. Causal attention
    keeps the pads after a row's tokens from affecting them. ``T`` is ``P + L`` rounded up to
    ``multiple`` (FP8 GEMMs want the token count a multiple of 16).
    """
    prompt_ids, prompt_mask, response_ids = batch.prompt_ids, batch.prompt_mask, batch.response_ids
    p = prompt_ids.shape[1]
    length = response_ids.shape[1]
    width = p + length
    t = -(-width // multiple) * multiple
    ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B, P+L]
    prompt_len = prompt_mask.long().sum(-1)  # [B]
    source = torch.arange(t, device=ids.device)[None, :] + (p - prompt_len)[:, None]  # [B, T]
    inside = source < width
    aligned = torch.where(inside, ids.gather(1, source.clamp(max=width - 1)), 0)  # [B, T]
    targets = F.pad(aligned[:, 1:], (0, 1))  # [B, T]
    index = (prompt_len - 1).clamp(min=0)[:, None] + torch.arange(length, device=ids.device)[None, :]
    return AlignedBatch(aligned, targets, index)  # index: [B, L]


def response_logprobs(
    token_logp: torch.Tensor, response_index: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``[B, L]`` log-probs of the response tokens from ``[B, T]`` aligned ones (0 where masked)."""
    return token_logp.gather(1, response_index) * response_mask


def _padding_columns(width: int, valid_vocab: int, vocab_start: int, device: torch.device) -> torch.Tensor:
    """``[width]`` bool, True on the columns whose global token id is padding (>= ``valid_vocab``)."""
    return torch.arange(width, device=device) + vocab_start >= valid_vocab


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    vocab_parallel_ce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    *,
    valid_vocab: int | None = None,
    vocab_start: int = 0,
) -> torch.Tensor:
    """log p(target) at ``temperature`` in float32: ``[B, T]`` from ``logits [B, T, V(/tp)]``.

    ``vocab_parallel_ce``: Megatron's ``tensor_parallel.vocab_parallel_cross_entropy`` (the
    negative log-prob over a vocabulary split across the tensor-parallel ranks; it overwrites its
    input, which is the temporary ``logits / T`` here). Without it, ``log_softmax`` over a full
    vocabulary. ``valid_vocab``: columns from this global id on are padding (set to -inf, so they
    take no probability; this rank's columns start at ``vocab_start``), masked in place in the
    temporary, so the logits are copied once.
    """
    scaled = logits.float() / temperature  # a new tensor: the caller's logits stay untouched
    if valid_vocab is not None and vocab_start + scaled.shape[-1] > valid_vocab:
        scaled.masked_fill_(
            _padding_columns(scaled.shape[-1], valid_vocab, vocab_start, scaled.device), -math.inf
        )
    if vocab_parallel_ce is not None:
        return -vocab_parallel_ce(scaled, targets)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


# -- weight sync ----------------------------------------------------------------------------------------


def hf_payload(
    hf_state: Mapping[str, torch.Tensor], fp8_names: Iterable[str], config: Fp8LinearConfig
) -> dict[str, Fp8Tensor | torch.Tensor]:
    """The weight-sync payload from Hugging Face-named weights: ``fp8_names`` quantized with the
    trainer's recipe (E4M3, 128x128 blocks, float32 scales unless power-of-two), the rest BF16.

    We quantize each unfused Hugging Face weight rather than export Transformer Engine's FP8 copy
    of the fused ``linear_qkv`` / ``linear_fc1``: TE's 128x128 blocks of the fused weight are the
    blocks of q, k, v (gate, up) only when every query group's q part, its k and its v (and each
    tensor-parallel shard's gate and up) are whole multiples of 128 rows. When they are not, a TE
    block straddles two HF weights and its scale differs, so TE's in-GEMM FP8 weight may differ
    from these bytes by a rounding step in the straddling blocks. What the generator receives is
    always the quantization of the trainer's weight with the trainer's recipe, block-aligned to
    the layer the generator computes with.
    """
    names = set(fp8_names)
    unknown = names - hf_state.keys()
    if unknown:
        raise ValueError(f"export_weights: fp8_names not in the model: {sorted(unknown)[:5]}")
    payload: dict[str, Fp8Tensor | torch.Tensor] = {}
    for name, w in hf_state.items():
        if name in names:
            payload[name] = config.quantize_weight(w, name)
        else:
            payload[name] = w.detach().to(torch.bfloat16)
    return payload
