"""Decode attention over the static KV cache, in Triton: one query token per sequence against the
cache as it is stored (BF16, or E4M3 dequantized in registers), reading only the positions written
so far.

The torch path of the graph-captured decode loop (:mod:`workers.engines.native.static_decode`)
hands SDPA the whole preallocated cache, masked: every step reads prompt + all new tokens of K
and V (and, for an FP8 cache, first writes a BF16 copy of all of it). This kernel reads K and V
up to ``length`` (a device tensor: the loop bound is read on the GPU, so a captured graph stays
valid as the sequence grows) and never writes a BF16 copy:

- one program per (sequence, KV head, split): the query heads of one GQA group share the K/V
  tile they load; the keys are split into ``splits`` ranges so that small batches still fill the
  GPU (flash-decoding), and a second kernel combines the splits' partial softmaxes;
- an E4M3 tile is dequantized in registers to the values the materialized dequantization gives,
  ``bf16(float32(k) * k_scale)``, so both paths compute attention over the same BF16 keys and values;
  a power-of-two scale (the calibrator's rule) is applied once outside the key loop instead, to
  the scores and to the weighted sum of V: the same bits, without a multiply per element;
- scores and the softmax in float32, the probabilities rounded to BF16 for the product with V
  (as flash attention does), the output BF16.

Which path runs: ``FP8RL_DECODE_ATTENTION=triton`` on a CUDA device with Triton (off by default
until a GPU run has measured it; ``make gpu-check`` runs the rollout benchmark both ways). The
arithmetic is checked against a float64 reference under Triton's interpreter on the CPU
(``tests/workers/engines/native/test_decode_attention.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workers.fp8.dispatch import multiprocessors

ATTENTION_NAME = "fp8rl_decode"  # registered below; models.BOOL_MASKS lists it (a bool mask)
BLOCK_N = 64  # keys per tile (32 until 2026-11-30: half the tensor-core work per loaded tile)


def enabled(device: torch.device) -> bool:
    """Whether the static decode loop on ``device`` uses this kernel (see the module docstring)."""
    from workers.fp8.dispatch import triton_switch

    instead = "torch SDPA over the whole masked cache"
    return triton_switch("FP8RL_DECODE_ATTENTION", "sdpa", "triton", device, instead)


def splits_for(batch: int, kv_heads: int, length: int, device: torch.device) -> int:
    """Key ranges per (sequence, KV head): about two programs per multiprocessor in all, at least
    one tile of keys each. Depends on shapes only, so a captured graph keeps it."""
    sms = multiprocessors(device, elsewhere=8)
    tiles = math.ceil(length / BLOCK_N)
    return max(1, min(tiles, math.ceil(2 * sms / (batch * kv_heads))))


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: torch.Tensor,
    length: torch.Tensor,
    scaling: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scaling, masked) v`` for one query per sequence.

    Args:
        q: ``[B, Hq, D]`` BF16 queries.
        k, v: ``[B, Hkv, T, D]`` the cache, BF16 or E4M3 (then ``k_scale``/``v_scale``, 0-d float32).
        seen: ``[B, T]`` bool, the keys each sequence may attend to (written, not padding).
        length: ``[1]`` int64 on the device, positions written so far; keys at or past it are
            not read.
        scaling: the score scale (``head_dim ** -0.5``).
        splits: key ranges per (sequence, KV head); default :func:`splits_for`.

    Returns ``[B, Hq, D]`` BF16.
    """
    from workers.engines.native import triton_decode

    b, hq, d = q.shape
    _, hkv, t, _ = k.shape
    fp8 = k.dtype == torch.float8_e4m3fn
    if hq % hkv or d & (d - 1) or d < 16:
        raise ValueError(
            f"decode_attention: {hq} query heads over {hkv} KV heads, head_dim {d} (a power of 2 >= 16)"
        )
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("decode_attention: an E4M3 cache needs k_scale and v_scale")
    splits = splits or splits_for(b, hkv, t, q.device)
    out: torch.Tensor = triton_decode.run(
        q, k, v, seen, length, scaling, k_scale, v_scale, splits, BLOCK_N, fp8
    )
    return out


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: torch.Tensor,
    length: int | torch.Tensor,
    scaling: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention in float64 (tests): K and V dequantized as the kernel does, then exact.
    ``length`` may be a one-element tensor on the device (no host sync: a CUDA graph may hold it)."""

    def values(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if x.dtype == torch.float8_e4m3fn:
            assert scale is not None
            x = (x.to(torch.float32) * scale).to(torch.bfloat16)
        return x.to(torch.float64)

    hq, hkv = q.shape[1], k.shape[1]
    kk = values(k, k_scale).repeat_interleave(hq // hkv, dim=1)  # [B, Hq, T, D]
    vv = values(v, v_scale).repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("bhd,bhtd->bht", q.to(torch.float64), kk) * scaling
    keep = seen & (torch.arange(seen.shape[1], device=seen.device) < length)
    scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("bht,bhtd->bhd", torch.softmax(scores, dim=-1), vv)


def attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """The attention function registered as :data:`ATTENTION_NAME`: this kernel for a decode step
    of a static cache that asked for it (:func:`active`), Hugging Face's SDPA otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ctx = _ACTIVE
    if ctx is None or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    out = _attend(ctx, int(module.layer_idx), query[:, :, 0], scaling)
    return out[:, None], None  # [B, 1, Hq, D], as HF's attention functions return


def _attend(ctx: _Context, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
    cache = ctx.cache
    k_scale, v_scale = (cache.k_scale[layer], cache.v_scale[layer]) if cache.fp8 else (None, None)
    return decode_attention(
        query, cache.k[layer], cache.v[layer], ctx.seen, ctx.length, scaling, k_scale, v_scale
    )


@dataclass(frozen=True)
class _Context:
    cache: Any  # a StaticKvCache
    seen: torch.Tensor
    rope: bool  # RoPE and the K/V write in one launch (fuse_rope)
    length: torch.Tensor  # [1]: the cache's index + 1, the keys of this step, once for every layer


_ACTIVE: _Context | None = None


class active:
    """Inside the block, decode steps of ``cache`` (a StaticKvCache) attend through this kernel,
    with ``seen [B, T]`` as the mask; with ``rope`` (and the model's attention modules given to
    :func:`fuse_rope`), their RoPE and K/V write run in one launch too. Made inside the step (or
    its capture): it computes the step's key count once, for every layer's attention."""

    def __init__(self, cache: Any, seen: torch.Tensor, rope: bool = False) -> None:
        self.ctx = _Context(cache, seen, rope, cache.index + 1)

    def __enter__(self) -> None:
        global _ACTIVE
        self.prev, _ACTIVE = _ACTIVE, self.ctx

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = self.prev


# the attention modules whose projections, RoPE and attention fuse_rope knows (Qwen3's q/k norms,
# partial rotary and the like are not among them: those keep Hugging Face's forward)
ROPE_MODULES = ("LlamaAttention", "Qwen2Attention")


def fuse_rope(model: nn.Module) -> int:
    """Give the model's attention modules a decode-step forward that applies RoPE to q and k and
    writes K and V into the static cache in one Triton launch
    (:func:`workers.fp8.triton_kv.rope_write_kv`), then attends through this kernel: inside
    :func:`active` with ``rope``, for one new token per sequence. Everything else (the prefill, the
    eager loop, the trainer) runs Hugging Face's forward as before. The rotated q and K are those
    of ``apply_rotary_pos_emb`` bit for bit, so the step computes what the unfused one computes.
    Returns how many modules it took (0: none of :data:`ROPE_MODULES`)."""
    from workers.fp8.fused import take_forward

    return sum(take_forward(m, _rope_forward) for m in model.modules() if type(m).__name__ in ROPE_MODULES)


def _rope_forward(module: Any, *args: Any, **kwargs: Any) -> Any:
    ctx = _ACTIVE
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    rope = kwargs.get("position_embeddings")
    if ctx is None or not ctx.rope or hidden is None or hidden.shape[1] != 1 or rope is None:
        return module.fp8rl_hf_forward(*args, **kwargs)
    from workers.fp8.triton_kv import rope_write_kv

    cache, layer, d = ctx.cache, int(module.layer_idx), int(module.head_dim)
    b = hidden.shape[0]
    cos, sin = rope  # [B, 1, D]
    q = module.q_proj(hidden).view(b, -1, d)  # [B, Hq, D]: the projections' outputs, not copied
    k = module.k_proj(hidden).view(b, -1, d)
    v = module.v_proj(hidden).view(b, -1, d)
    k_buf, v_buf = cache.k[layer], cache.v[layer]
    q = rope_write_kv(
        q, k, v, cos[:, 0], sin[:, 0], cache.k_scale[layer], cache.v_scale[layer], cache.index, k_buf, v_buf
    )
    out = _attend(ctx, layer, q, float(module.scaling))  # [B, Hq, D]
    return module.o_proj(out.reshape(b, 1, -1)), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


register()
