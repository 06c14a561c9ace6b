"""The native generator: batched sampling with a KV cache on a Hugging Face Llama/Qwen2 in torch.

Weights are BF16 (as vLLM serves them); under ``fp8-gen`` and ``fp8-e2e`` the decoder linears are
:class:`~workers.fp8.linear.Fp8Linear` and take the FP8 weights the trainer sends, unchanged.

FP8 KV cache: keys and values are rounded to E4M3 with one scale per layer for K and one for V,
calibrated on each batch's prefill (``p99.9(|x|) * 1.05 / 448``, :class:`KvScaleCalibrator`) and
kept for the decode steps of that batch. This engine stores the rounded values dequantized, so it
reproduces the *numerics* of an FP8 KV cache (what the mismatch metrics see) but not its memory
saving; vLLM's ``kv_cache_dtype="fp8"`` gives both on GPU. ``kv_cache_bytes`` reports FP8 bytes.

Log-probs are those of the sampled token under the temperature-scaled distribution *before* top-p
filtering, the convention of vLLM's ``logprobs`` and the one the trainer reproduces.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from rljob.spec import JobSpec
from workers.engines.models import apply_recipe, build_policy
from workers.engines.protocols import Payload, Rollouts, left_pad, positions
from workers.fp8.convert import Fp8Audit
from workers.fp8.export import load_weights
from workers.fp8.kv_cache import KvScaleCalibrator, quantize_kv


class Fp8KvCache(DynamicCache):
    """A ``DynamicCache`` whose new keys/values are rounded to E4M3 with per-layer scales."""

    def __init__(self, num_layers: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calibrator = KvScaleCalibrator(num_layers)
        self.k_scales: dict[int, torch.Tensor] = {}
        self.v_scales: dict[int, torch.Tensor] = {}
        self.fp8_bytes = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx not in self.k_scales:  # first call for this layer = the prefill: calibrate
            self.calibrator.observe(layer_idx, key_states, value_states)
            scales = self.calibrator.scales()
            self.k_scales[layer_idx] = scales.k[layer_idx]
            self.v_scales[layer_idx] = scales.v[layer_idx]
        k_q = quantize_kv(key_states, self.k_scales[layer_idx])
        v_q = quantize_kv(value_states, self.v_scales[layer_idx])
        self.fp8_bytes += k_q.data.numel() + v_q.data.numel()
        return super().update(
            k_q.dequantize(key_states.dtype), v_q.dequantize(value_states.dtype), layer_idx, *args, **kwargs
        )


def sample_top_p(probs: torch.Tensor, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """One token per row from ``probs [B, V]`` restricted to the smallest set of mass >= top_p."""
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
        choice = torch.multinomial(sorted_p, 1, generator=gen)  # [B, 1] index into sorted
        return order.gather(-1, choice).squeeze(-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # [B]


class NativeGenerator:
    """Generator protocol on a torch model (CPU or one GPU)."""

    def __init__(self, spec: JobSpec, vocab_size: int, eos_id: int, pad_id: int, device: str = "cpu") -> None:
        self.spec, self.eos_id, self.pad_id, self.device = spec, eos_id, pad_id, torch.device(device)
        self.model = build_policy(spec, vocab_size, torch.bfloat16, self.device)
        self.model.requires_grad_(False)
        self.audit: Fp8Audit = apply_recipe(self.model, spec.precision, "generator")
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.kv_cache_bytes = 0

    def load_weights(self, payload: Payload) -> None:
        load_weights(self.model, payload)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> Rollouts:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id)  # [B, P]
        ids, attn = prompt_ids.to(self.device), prompt_mask.to(self.device)
        b = ids.shape[0]
        cache: DynamicCache = (
            Fp8KvCache(self.num_layers) if self.spec.precision.fp8_kv_cache else DynamicCache()
        )
        pos = positions(attn)  # [B, P]
        out = self.model(
            input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True
        )
        next_pos = pos[:, -1] + 1  # [B]
        tokens, logps, valid = [], [], []
        finished = torch.zeros(b, dtype=torch.bool, device=self.device)
        for _ in range(max_new_tokens):
            logits = out.logits[:, -1, :].float() / temperature  # [B, V]
            logp_all = torch.log_softmax(logits, dim=-1)
            tok = sample_top_p(logp_all.exp(), top_p, gen)  # [B]
            tok = torch.where(finished, torch.full_like(tok, self.pad_id), tok)
            valid.append(~finished)
            logps.append(logp_all.gather(-1, tok[:, None]).squeeze(-1))
            tokens.append(tok)
            finished = finished | (tok == self.eos_id)
            if bool(finished.all()):
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            next_pos = next_pos + 1
        mask = torch.stack(valid, 1).float()  # [B, L]
        self.kv_cache_bytes = cache.fp8_bytes if isinstance(cache, Fp8KvCache) else _cache_bytes(cache)
        return Rollouts(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=torch.stack(tokens, 1).cpu(),
            response_mask=mask.cpu(),
            logprobs=(torch.stack(logps, 1) * mask).cpu(),
        )


def _cache_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
