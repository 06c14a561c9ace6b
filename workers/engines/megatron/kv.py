"""FP8 KV-cache scales for vLLM from the Megatron trainer.

After each step's update, one more forward over the step's rows observes every layer's K (after
RoPE) and V at the real tokens through pre-hooks on the core attention, and the scales
(``p99.9(|x|) x 1.05 / 448``, max-reduced over the trainers) go out with the weights, as the
native side does (:mod:`workers.engines.native.kv_calibration`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from rljob.spec import JobSpec
from workers.engines.megatron.convert import stage_layers
from workers.engines.megatron.schedule import MegatronSchedule
from workers.engines.models import to_device
from workers.engines.protocols import Rollouts
from workers.fp8.kv_cache import KvScaleCalibrator, kv_scale_name


class MegatronKvCalibration(MegatronSchedule):
    """A trainer rank that calibrates vLLM's K/V scales when the spec asks for an FP8 KV cache."""

    def __init__(self, spec: JobSpec, vocab_size: int, device: str = "cuda", rank: int = 0) -> None:
        super().__init__(spec, vocab_size, device, rank)
        if spec.precision.fp8_kv_cache and spec.resources.generator_engine == "vllm":
            self._kv = KvScaleCalibrator(self.shapes.layers)
            self._install_kv_hooks()

    def _install_kv_hooks(self) -> None:
        first = stage_layers(self.shapes.layers, self.pp, self.pp_rank).start
        for i, layer in enumerate(self.gpt.decoder.layers):
            hook = functools.partial(self._observe_kv, first + i)
            layer.self_attention.core_attention.register_forward_pre_hook(hook, with_kwargs=True)

    def _observe_kv(self, layer: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Pre-hook of TEDotProductAttention(query, key, value, ...): K after RoPE (as the cache
        stores it) and V, ``[s, b, heads, d]``, at the real tokens of the calibration pass."""
        rows = self._kv_rows
        if rows is None or self._kv is None or rows.numel() == 0:
            return
        key = args[1] if len(args) > 1 else kwargs["key"]
        value = args[2] if len(args) > 2 else kwargs["value"]
        s, b = key.shape[:2]
        self._kv.observe(
            layer,
            key.reshape(s * b, -1).index_select(0, rows),
            value.reshape(s * b, -1).index_select(0, rows),
        )
        self._kv_seen.add(layer)

    def _no_loss(self, mb: dict[str, Any], logits: torch.Tensor) -> tuple[Any, ...]:
        return self._scalar(0.0), self._one, {}

    @torch.no_grad()
    def _calibrate_kv(self, full: Rollouts, data: dict[str, torch.Tensor]) -> None:
        """KV-cache scales of the updated weights: one forward over the step's rows, observing
        the real tokens (prompt and response, not padding) of every layer's K and V."""
        if self._kv is None:
            return
        self._kv.reset()
        self._kv_seen.clear()
        lengths = (full.prompt_mask.sum(-1) + full.response_mask.sum(-1)).long().tolist()  # one read
        micros = self._micros(data, 0, len(lengths))
        for mb in micros:
            width = mb["ids"].shape[0]  # sbhd: token t of micro-batch row r is row t * width + r
            rows = [torch.arange(lengths[mb["start"] + r]) * width + r for r in range(mb["rows"])]
            mb["kv_rows"] = to_device(
                torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long), self.device
            )
        try:
            self._schedule(micros, self._no_loss, forward_only=True)
        finally:
            self._kv_rows = None

    def _kv_scales(self) -> dict[str, torch.Tensor]:
        """Per-layer K/V scales, max-reduced over every trainer (TP ranks see different heads, PP
        stages different layers, DP replicas different rows); 1.0 where nothing was observed."""
        assert self._kv is not None
        n = self.shapes.layers
        k = torch.zeros(n, dtype=torch.float32, device=self.device)
        v = torch.zeros_like(k)
        for i in sorted(self._kv_seen):
            k[i], v[i] = self._kv.layer_scales(i)
        for t in (k, v):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        k, v = (torch.where(t > 0, t, torch.ones_like(t)) for t in (k, v))
        out = {kv_scale_name(i, "k"): k[i].clone() for i in range(n)}
        return out | {kv_scale_name(i, "v"): v[i].clone() for i in range(n)}
