"""FP8 KV cache: per-layer K and V scales calibrated from observed magnitudes.

A KV cache entry is written once and read at every later decoding step, so its scale must be
fixed before the values arrive: one float32 scale per layer for K and one for V (the layout vLLM's
``k_scale``/``v_scale`` use). They are calibrated from the K and V the model actually produces:

    scale = percentile_p(|x|) * margin / fmt.max          (default p = 99.9, margin = 1.05, E4M3)

A percentile rather than the max, so that a handful of outliers does not push every ordinary
value towards the subnormal range; the margin leaves headroom for the next step's slightly
larger values; the rare values above it saturate at ``fmt.max``. With several observations (one
per batch) the calibrator keeps, per layer, the largest percentile it has seen. Weights change
every RL step, so the driver calls :meth:`KvScaleCalibrator.reset` and recalibrates each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from transformers import DynamicCache

from workers.fp8.formats import Fp8Format, get_format, to_float32
from workers.fp8.guard import check_input
from workers.fp8.quant import Fp8Tensor, cast_to_fp8


def abs_percentile(x: torch.Tensor, percentile: float, where: str = "KV calibration") -> torch.Tensor:
    """The ``percentile``-th percentile of ``|x|`` (nearest rank, exact): a float32 0-d tensor on
    ``x``'s device, computed there (no host sync; NaN/inf is checked as in ``quantize``)."""
    if not 0.0 < percentile <= 100.0:
        raise ValueError(f"percentile={percentile} must be in (0, 100]")
    flat = x.detach().reshape(-1).abs().to(torch.float32)
    if flat.numel() == 0:
        raise ValueError("abs_percentile of an empty tensor")
    check_input(x, flat.amax(), None, where)
    # nearest-rank definition, in exact rationals: 99.9 / 100 * 1000 is 999.0000000000001 in floats
    rank = max(1, math.ceil(Fraction(repr(float(percentile))) * flat.numel() / 100))
    return torch.kthvalue(flat, rank).values


@dataclass
class KvScales:
    """Per-layer dequantization scales: ``k[i]``, ``v[i]`` for decoder layer ``i`` (float32 [L])."""

    k: torch.Tensor
    v: torch.Tensor
    fmt: Fp8Format

    def to_dict(self) -> dict[str, list[float] | str]:
        return {"fmt": self.fmt.name, "k_scale": self.k.tolist(), "v_scale": self.v.tolist()}


class KvScaleCalibrator:
    """Collects per-layer K/V magnitudes and turns them into :class:`KvScales`.

    Everything stays on the device of the observed tensors: observing never waits for the GPU.
    """

    def __init__(
        self,
        num_layers: int,
        fmt: str | Fp8Format = "e4m3",
        percentile: float = 99.9,
        margin: float = 1.05,
    ) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers={num_layers} must be positive")
        if margin < 1.0:
            raise ValueError(f"margin={margin} must be >= 1.0 (it is headroom above the percentile)")
        abs_percentile(torch.ones(1), percentile)  # validate once, here
        self.num_layers = num_layers
        self.fmt = get_format(fmt)
        self.percentile = percentile
        self.margin = margin
        self.reset()

    def reset(self) -> None:
        """Forget what was observed (call when the weights change)."""
        self._k: list[torch.Tensor | None] = [None] * self.num_layers
        self._v: list[torch.Tensor | None] = [None] * self.num_layers
        self.observations = 0

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Record the K and V produced by ``layer`` for one batch (any shape)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} out of range [0, {self.num_layers})")
        for seen, x, name in ((self._k, k, "K"), (self._v, v, "V")):
            p = abs_percentile(x, self.percentile, f"KV calibration of layer {layer} ({name})")
            prev = seen[layer]
            seen[layer] = p if prev is None else torch.maximum(prev, p)
        self.observations += 1

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)`` of one layer: float32 0-d tensors on the observed device."""
        return self._to_scale(self._k[layer]), self._to_scale(self._v[layer])

    def _to_scale(self, pct: torch.Tensor | None) -> torch.Tensor:
        if pct is None:
            return torch.ones((), dtype=torch.float32)
        t = pct * self.margin / self.fmt.max
        return torch.where(t > 0, t, torch.ones_like(t))

    def scales(self) -> KvScales:
        """Scales from what was observed; a layer never observed (or all zeros) gets scale 1.0."""
        pairs = [self.layer_scales(i) for i in range(self.num_layers)]
        device = next((p.device for p in self._k if p is not None), torch.device("cpu"))
        k = torch.stack([kp.to(device) for kp, _ in pairs])
        v = torch.stack([vp.to(device) for _, vp in pairs])
        return KvScales(k, v, self.fmt)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | float, fmt: str | Fp8Format = "e4m3") -> Fp8Tensor:
    """Quantize K or V of one layer with its calibrated (tensorwise) scale; saturating."""
    s = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    return cast_to_fp8(x, s.reshape(()), fmt, None)


def kv_scale_name(layer: int, which: str) -> str:
    """The payload (and checkpoint) name of decoder layer ``layer``'s K or V scale (``which``:
    ``k`` | ``v``): the Hugging Face-side name vLLM's model loaders map onto their attention
    layer's ``k_scale`` / ``v_scale``. A 0-d float32 tensor: dequantized = data x scale."""
    if which not in ("k", "v"):
        raise ValueError(f"which={which!r}: expected 'k' or 'v'")
    return f"model.layers.{layer}.self_attn.{which}_scale"


class Fp8KvCache(DynamicCache):
    """A ``DynamicCache`` that stores keys and values as E4M3 with per-layer scales."""

    def __init__(self, num_layers: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calibrator = KvScaleCalibrator(num_layers)
        self.k_scales: dict[int, torch.Tensor] = {}
        self.v_scales: dict[int, torch.Tensor] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx not in self.k_scales:  # first call for this layer = the prefill: calibrate
            self.calibrator.observe(layer_idx, key_states, value_states)
            self.k_scales[layer_idx], self.v_scales[layer_idx] = self.calibrator.layer_scales(layer_idx)
        k_scale, v_scale = self.k_scales[layer_idx], self.v_scales[layer_idx]
        k_q = quantize_kv(key_states, k_scale)
        v_q = quantize_kv(value_states, v_scale)
        keys, values = super().update(k_q.data, v_q.data, layer_idx, *args, **kwargs)  # the whole cache, FP8
        return _dequantize(keys, k_scale, key_states.dtype), _dequantize(values, v_scale, value_states.dtype)


def _dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # the same arithmetic as Fp8Tensor.dequantize: float32 product, then the model's dtype
    return (to_float32(data) * scale).to(dtype)


def kv_cache_bytes(cache: DynamicCache) -> int:
    """Bytes the cache holds: its stored keys and values, plus per-layer scales if FP8."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    for scales in (getattr(cache, "k_scales", {}), getattr(cache, "v_scales", {})):  # an FP8 cache's
        total += sum(s.numel() * s.element_size() for s in scales.values())
    return total
