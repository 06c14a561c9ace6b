"""K/V scales for a generator's FP8 KV cache, calibrated on the trainer at every sync.

vLLM 0.32 computes KV-cache scales at most once, and the weights change every RL step, so the
scales would go stale. As NeMo RL does, the trainer calibrates them instead (for the native
generator too, so that both engines and the trainer's forward use the same scales): after its
update, and before the first sync on the first step's prompts, it runs a forward pass (no
gradients; over at most ``precision.kv_calibration_sequences`` of the rows, evenly spaced),
observes every decoder layer's K (after RoPE, what the cache stores) and V at the real tokens,
and turns them into per-layer scales (:class:`~workers.fp8.kv_cache.KvScaleCalibrator`'s
rule); the scales travel with the weights under :func:`~workers.fp8.kv_cache.kv_scale_name`.

Only real tokens count: the rows of padding are dropped with an index built from the host's copy
of the mask, so the device never waits for the host.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from workers.engines.batching import positions
from workers.engines.models import COMPUTE_DTYPE, attention_mask_4d, compute_params
from workers.engines.protocols import Rollouts
from workers.fp8.dispatch import to_device
from workers.fp8.kv_cache import KvScaleCalibrator, KvScales, kv_scale_name


class _ObservingCache(DynamicCache):
    """A cache that stores nothing: each layer's ``update`` shows its K and V to the calibrator."""

    def __init__(self, calibrator: KvScaleCalibrator, rows: torch.Tensor) -> None:
        super().__init__()
        self.calibrator, self.rows = calibrator, rows

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [B, H_kv, T, D] -> [B*T, H_kv*D] -> the real tokens' rows
        b, h, t, d = key_states.shape
        k = key_states.transpose(1, 2).reshape(b * t, h * d).index_select(0, self.rows)
        v = value_states.transpose(1, 2).reshape(b * t, h * d).index_select(0, self.rows)
        self.calibrator.observe(layer_idx, k, v)
        return key_states, value_states


def real_token_rows(prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Flat indices (into ``[B*T]``) of the real tokens of a host-side batch, on the host."""
    mask = torch.cat([prompt_mask.bool(), response_mask.bool()], dim=1)  # [B, T]
    return mask.reshape(-1).nonzero().squeeze(-1)


@torch.no_grad()
def observe_kv(
    model: Any,
    host: Rollouts,
    calibrator: KvScaleCalibrator,
    micro_batch_size: int,
    compute_dtype: torch.dtype = COMPUTE_DTYPE,
) -> None:
    """Run ``model`` over ``host`` (a batch on the host) in micro-batches, observing K and V."""
    device = next(model.parameters()).device
    impl = str(model.config._attn_implementation)
    params = compute_params(model, compute_dtype)
    for start in range(0, host.prompt_ids.shape[0], micro_batch_size):
        part = Rollouts(*(t[start : start + micro_batch_size] for t in host))
        rows = to_device(real_token_rows(part.prompt_mask, part.response_mask), device)
        ids = to_device(torch.cat([part.prompt_ids, part.response_ids], dim=1), device)  # [b, T]
        attn = to_device(torch.cat([part.prompt_mask, part.response_mask.long()], dim=1), device)
        inputs = {
            "input_ids": ids,
            "attention_mask": attention_mask_4d(attn, ids.shape[1], compute_dtype, impl),
            "position_ids": positions(attn),
            "past_key_values": _ObservingCache(calibrator, rows),
            "use_cache": True,
            "logits_to_keep": 1,  # the logits are not needed
        }
        torch.func.functional_call(model, params, (), inputs, tie_weights=True, strict=False)


def kv_scale_payload(scales: KvScales) -> dict[str, torch.Tensor]:
    """``{model.layers.{i}.self_attn.k_scale: 0-d float32, ...}`` for every layer."""
    out: dict[str, torch.Tensor] = {}
    for i in range(scales.k.shape[0]):
        out[kv_scale_name(i, "k")] = scales.k[i].to(torch.float32)
        out[kv_scale_name(i, "v")] = scales.v[i].to(torch.float32)
    return out
