"""FP8 KV-cache scales for vLLM from the Megatron trainer.

After each step's update, one more forward over the step's rows (at most
``precision.kv_calibration_sequences`` of them, evenly spaced) observes every layer's K (after
RoPE) and V at the real tokens through pre-hooks on the core attention (Transformer Engine's
``TEDotProductAttention`` on a GPU, Megatron's local ``DotProductAttention`` on the CPU: both are
called as ``(query, key, value, attention_mask, ...)`` with ``[s, b, heads, d]`` tensors), and the
scales (:class:`~workers.fp8.kv_cache.KvScaleCalibrator`'s rule, max-reduced over the trainers)
go out with the weights, as the native side does (:mod:`workers.engines.native.kv_calibration`).
With ``precision.fp8_kv_cache_in_training`` a second pre-hook rounds K and V with those scales in
every other forward, as the generators' cache holds them. The trainer holds one only when
:func:`workers.fp8.kv_cache.calibrates_kv` says so.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from workers.engines.megatron.convert import stage_layers
from workers.engines.megatron.schedule import MegatronSchedule
from workers.engines.protocols import Rollouts
from workers.fp8.dispatch import to_device
from workers.fp8.kv_cache import KvScaleCalibrator, KvScales, kv_scale_name, round_kv


class MegatronKvCalibration:
    """Pre-hooks on every core attention of this rank's stage, and the scales they calibrate."""

    def __init__(self, schedule: MegatronSchedule, in_training: bool = False) -> None:
        self.schedule = schedule
        model = schedule.model
        self.layers, self.device = model.shapes.layers, model.device
        self.calibrator = KvScaleCalibrator(self.layers)
        self.seen: set[int] = set()
        self.rows: torch.Tensor | None = None  # real tokens of the micro-batch being calibrated on
        self.calibrating = False
        # the scales of the last calibration, max-reduced over the trainers: [layers] each
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        g = model.groups
        first = stage_layers(self.layers, g.pp, g.pp_rank).start
        for i, layer in enumerate(model.gpt.decoder.layers):
            core = layer.self_attention.core_attention
            core.register_forward_pre_hook(functools.partial(self._observe, first + i), with_kwargs=True)
            if in_training:  # precision.fp8_kv_cache_in_training
                core.register_forward_pre_hook(functools.partial(self._round, first + i), with_kwargs=True)

    def _round(
        self, layer: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Pre-hook of the core attention outside calibration: K and V as the generators' FP8
        cache holds them, with the scales sent (:func:`~workers.fp8.kv_cache.round_kv`: gradient
        straight through); nothing before the first calibration."""
        if self.calibrating or self.k is None or self.v is None:
            return None
        new_args, new_kwargs = list(args), dict(kwargs)
        for pos, name, scale in ((1, "key", self.k[layer]), (2, "value", self.v[layer])):
            if len(new_args) > pos:
                new_args[pos] = round_kv(new_args[pos], scale)
            else:
                new_kwargs[name] = round_kv(new_kwargs[name], scale)
        return tuple(new_args), new_kwargs

    def _observe(self, layer: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Pre-hook of the core attention ``(query, key, value, ...)``: K after RoPE (as the cache
        stores it) and V, ``[s, b, kv heads, d]``, at the real tokens of the calibration pass."""
        rows = self.rows
        if rows is None or rows.numel() == 0:
            return
        key = args[1] if len(args) > 1 else kwargs["key"]
        value = args[2] if len(args) > 2 else kwargs["value"]
        s, b = key.shape[:2]
        self.calibrator.observe(
            layer,
            key.reshape(s * b, -1).index_select(0, rows),
            value.reshape(s * b, -1).index_select(0, rows),
        )
        self.seen.add(layer)

    def _set_rows(self, mb: dict[str, Any]) -> None:
        self.rows = mb["kv_rows"]

    def _no_loss(self, mb: dict[str, Any], logits: torch.Tensor) -> tuple[Any, ...]:
        return self.schedule.scalar(0.0), self.schedule.one, {}

    @torch.no_grad()
    def calibrate(self, full: Rollouts, data: dict[str, torch.Tensor]) -> None:
        """K/V scales of the current weights: one forward over the step's rows, observing the real
        tokens (prompt and response, not padding) of every layer's K and V."""
        self.calibrator.reset()
        self.seen.clear()
        lengths = (full.prompt_mask.sum(-1) + full.response_mask.sum(-1)).long().tolist()  # one read
        micros = self.schedule.micros(data, 0, len(lengths))
        for mb in micros:
            width = mb["ids"].shape[0]  # sbhd: token t of micro-batch row r is row t * width + r
            rows = [torch.arange(lengths[mb["start"] + r]) * width + r for r in range(mb["rows"])]
            mb["kv_rows"] = to_device(
                torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long), self.device
            )
        self.calibrating = True
        try:
            self.schedule.run(micros, self._no_loss, forward_only=True, before_forward=self._set_rows)
        finally:
            self.rows, self.calibrating = None, False
        # max-reduced over every trainer (TP ranks see different heads, PP stages different
        # layers, DP replicas different rows); 1.0 where nothing was observed
        k = torch.zeros(self.layers, dtype=torch.float32, device=self.device)
        v = torch.zeros_like(k)
        for i in sorted(self.seen):
            k[i], v[i] = self.calibrator.layer_scales(i)
        for t in (k, v):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.k, self.v = (torch.where(t > 0, t, torch.ones_like(t)) for t in (k, v))

    def state(self) -> dict[str, Any] | None:
        """The last calibration's scales for a trainer's state (None before the first), as the
        native trainer keeps them (:meth:`workers.fp8.kv_cache.KvScales.state`)."""
        if self.k is None or self.v is None:
            return None
        return KvScales(self.k, self.v, self.calibrator.fmt).state()

    def load(self, state: Mapping[str, Any] | None) -> None:
        """Scales :meth:`state` kept (a trainer started again), as if just calibrated; none: as
        before any calibration."""
        scales = KvScales.from_state(state, self.device)
        self.k, self.v = (scales.k, scales.v) if scales is not None else (None, None)

    def scales(self) -> dict[str, torch.Tensor]:
        """The last calibration's per-layer K/V scales by payload name (none before the first)."""
        if self.k is None or self.v is None:
            return {}
        out = {kv_scale_name(i, "k"): self.k[i].clone() for i in range(self.layers)}
        return out | {kv_scale_name(i, "v"): self.v[i].clone() for i in range(self.layers)}
