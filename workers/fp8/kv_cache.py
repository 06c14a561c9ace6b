"""FP8 KV cache: per-layer K and V scales, calibrated from observed magnitudes.

A KV cache entry is written once and read at every later decoding step, so its scale must be
fixed before the values arrive: one float32 scale per layer for K and one for V (the layout vLLM's
``k_scale``/``v_scale`` use). They are calibrated from the K and V the model actually produces:

    scale = 2 ** ceil(log2(amax(|x|) * margin / fmt.max))        (margin = KV_MARGIN = 1, E4M3)

- **The amax, not a percentile.** E4M3 is a floating format: its relative precision (1/16) is the
  same from 2^-6 to 448, so a scale set by the largest value costs ordinary values nothing until
  they are 2^15 times smaller. The earlier rule, ``p99.9 x 1.05 / 448`` (NeMo RL's, an integer
  format's habit), saturated the 0.1% largest K values: on real models those are outlier channels
  that carry attention, and they caused the mismatch spikes (docs/results.md). The amax is also one
  reduction, where a percentile needs a sort or ``kthvalue`` (single-block and slow on CUDA).
- **Powers of two**, rounded up: the calibrated amax never saturates; E4M3's relative precision
  is unchanged; dividing by the scale is exact, which lets a kernel that truncates instead of
  rounding (vLLM's CPU cache writer) store exactly what a round to nearest would
  (:func:`workers.engines.vllm.kv_scales.round_kv_to_nearest`).
- **Where**: the trainer calibrates on the prompts of the first rollout before the first sync, and
  after every update on the step's sequences (at most ``precision.kv_calibration_sequences`` of
  them, evenly spaced), and sends the scales with the weights; both
  generators use them until the next sync. With ``precision.fp8_kv_cache_in_training`` the
  trainer's forward reads K and V rounded with the same scales (:class:`KvRoundingCache`), so
  trainer and generator attend over the same values. A generator that never received scales
  calibrates each batch's prefill (the offline tools).
A new value above the calibrated range (a later token's K larger than any observed) saturates at
``fmt.max x scale``; the power-of-two rounding leaves 1-2x headroom above the amax.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from transformers import DynamicCache

from rljob.spec import JobSpec
from workers.fp8.formats import Fp8Format, get_format, to_float32
from workers.fp8.fp8_tensor import Fp8Tensor
from workers.fp8.guard import check_input
from workers.fp8.quant import cast_to_fp8

KV_MARGIN = 1.0  # headroom above the calibrated amax, before the power-of-two rounding (module docstring)


def calibrates_kv(spec: JobSpec) -> bool:
    """Whether the trainer calibrates K/V-cache scales (before the first rollout and after every
    update) and sends them with the weights: with an FP8 KV cache, on either generator. vLLM
    computes its scales at most once; the native generator could calibrate each prefill, but
    then its decode tokens and the trainer's forward (``precision.fp8_kv_cache_in_training``)
    would not see the same scales. Every trainer engine asks this, and only this."""
    return spec.precision.fp8_kv_cache


def check_percentile(percentile: float) -> None:
    """Refuse a percentile outside (0, 100]."""
    if not 0.0 < percentile <= 100.0:
        raise ValueError(f"percentile={percentile} must be in (0, 100]")


def abs_percentile(x: torch.Tensor, percentile: float, where: str = "KV calibration") -> torch.Tensor:
    """The ``percentile``-th percentile of ``|x|`` (nearest rank, exact): a float32 0-d tensor on
    ``x``'s device, computed there (no host sync; NaN/inf is checked as in ``quantize``)."""
    check_percentile(percentile)
    flat = x.detach().reshape(-1).abs().to(torch.float32)
    if flat.numel() == 0:
        raise ValueError("abs_percentile of an empty tensor")
    check_input(x, flat.amax(), None, where)
    # nearest-rank definition, in exact rationals: 99.9 / 100 * 1000 is 999.0000000000001 in floats
    rank = max(1, math.ceil(Fraction(repr(float(percentile))) * flat.numel() / 100))
    return torch.kthvalue(flat, rank).values


def abs_magnitude(x: torch.Tensor, percentile: float = 100.0, where: str = "KV calibration") -> torch.Tensor:
    """``max |x|`` (``percentile`` 100: one reduction, fast on every device) or
    :func:`abs_percentile`: a float32 0-d tensor on ``x``'s device, NaN/inf checked."""
    if percentile != 100.0:
        return abs_percentile(x, percentile, where)
    flat = x.detach().reshape(-1)
    if flat.numel() == 0:
        raise ValueError("abs_magnitude of an empty tensor")
    amax = flat.abs().amax().to(torch.float32)
    check_input(x, amax, None, where)
    return amax


@dataclass
class KvScales:
    """Per-layer dequantization scales: ``k[i]``, ``v[i]`` for decoder layer ``i`` (float32 [L])."""

    k: torch.Tensor
    v: torch.Tensor
    fmt: Fp8Format

    def to_dict(self) -> dict[str, list[float] | str]:
        return {"fmt": self.fmt.name, "k_scale": self.k.tolist(), "v_scale": self.v.tolist()}

    def state(self) -> dict[str, Any]:
        """What a trainer's state keeps of them (:meth:`from_state` reads it): the float32 tensors,
        bit for bit, on the CPU."""
        return {"fmt": self.fmt.name, "k": self.k.detach().cpu().clone(), "v": self.v.detach().cpu().clone()}

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None, device: torch.device | str) -> KvScales | None:
        """:meth:`state`'s scales on ``device``; None for none (a state saved before the first
        calibration, or by a version that did not keep them)."""
        if not state:
            return None
        k, v = (state[w].to(device, torch.float32) for w in ("k", "v"))
        return cls(k, v, get_format(state["fmt"]))


class KvScaleCalibrator:
    """Collects per-layer K/V magnitudes and turns them into :class:`KvScales`.

    The rule (module docstring): ``2 ** ceil(log2(amax * margin / fmt.max))`` with the defaults
    ``percentile=100`` (the amax: a reduction, no sort or ``kthvalue``), ``margin`` =
    :data:`KV_MARGIN` and ``power_of_two=True``. A lower ``percentile`` (nearest rank, exact) and
    ``power_of_two=False`` give the earlier rule, ``p99.9 x 1.05 / 448``, for comparisons.
    Everything stays on the device of the observed tensors: observing never waits for the GPU.
    """

    def __init__(
        self,
        num_layers: int,
        fmt: str | Fp8Format = "e4m3",
        percentile: float = 100.0,
        margin: float | None = None,
        power_of_two: bool = True,
    ) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers={num_layers} must be positive")
        margin = KV_MARGIN if margin is None else margin
        if margin < 1.0:
            raise ValueError(f"margin={margin} must be >= 1.0 (headroom above the calibrated magnitude)")
        check_percentile(percentile)  # once, here
        self.num_layers = num_layers
        self.fmt = get_format(fmt)
        self.percentile = percentile
        self.margin = margin
        self.power_of_two = power_of_two
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
            p = abs_magnitude(x, self.percentile, f"KV calibration of layer {layer} ({name})")
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
        if self.power_of_two:  # rounded up: the calibrated magnitude never saturates
            t = torch.exp2(torch.ceil(torch.log2(t)))
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
    """A ``DynamicCache`` that stores keys and values as E4M3 with per-layer scales: ``scales``
    (the trainer's, received with the weights), or without them calibrated on each layer's first
    update (the prefill)."""

    def __init__(self, num_layers: int, scales: KvScales | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calibrator = KvScaleCalibrator(num_layers)
        self.k_scales: dict[int, torch.Tensor] = {}
        self.v_scales: dict[int, torch.Tensor] = {}
        if scales is not None:
            self.k_scales = dict(enumerate(scales.k.unbind()))
            self.v_scales = dict(enumerate(scales.v.unbind()))

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


class _RoundKv(torch.autograd.Function):
    """Forward: ``x`` rounded to nearest on the FP8 grid of ``scale`` (saturating), in ``x``'s
    dtype, exactly the values an FP8 cache with that scale stores and reads back. Backward: the
    gradient passes straight through (the rounding's derivative is taken as 1)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
        return quantize_kv(x, scale, fmt).dequantize(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def round_kv(x: torch.Tensor, scale: torch.Tensor, fmt: str | Fp8Format = "e4m3") -> torch.Tensor:
    """K or V as an FP8 cache with ``scale`` holds it (see :class:`_RoundKv`); differentiable."""
    name = fmt if isinstance(fmt, str) else fmt.name
    out: torch.Tensor = _RoundKv.apply(x, scale.reshape(()), name)  # type: ignore[no-untyped-call]
    return out


class KvRoundingCache(DynamicCache):
    """The trainer's side of an FP8 KV cache: a cache that stores nothing and hands attention
    every layer's K and V rounded as the generators' FP8 cache holds them (``scales``: the ones
    sent with the weights), gradient straight through. A full-sequence forward with it attends
    over the same K/V values as the generator's prefill and decode steps."""

    def __init__(self, scales: KvScales) -> None:
        super().__init__()
        self.scales = scales

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fmt = self.scales.fmt
        return (
            round_kv(key_states, self.scales.k[layer_idx], fmt),
            round_kv(value_states, self.scales.v[layer_idx], fmt),
        )


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
