"""K/V-cache scales in vLLM 0.32's attention layers: where they live, how the trainer's get there.

Every ``Attention`` layer (``vllm/model_executor/layers/attention/attention.py``) holds its scales
in several places, all set together:
- ``_k_scale`` / ``_v_scale``: float32 0-d buffers on the device, read by the GPU kernels (CUDA
  graphs captured these very tensors, so they are written in place);
- ``_k_scale_float`` / ``_v_scale_float``: Python floats, read by the CPU attention backend
  (``vllm/v1/attention/backends/cpu_attn.py``: ``cpu_attn_reshape_and_cache`` and
  ``cpu_attention_with_kv_cache`` take ``k_scale=layer._k_scale_float``) and some GPU backends;
- ``_k_scale_cpu`` / ``_v_scale_cpu``: host tensors for backends that want them there.

With a quantization config (FP8 weights) the layer also has ``k_scale`` / ``v_scale``
*parameters*, created by its KV-cache method (``BaseKVCacheMethod``), and ``load_weights`` maps
``model.layers.{i}.self_attn.k_scale`` onto them (the quantization config's scale-name mapper);
the method's ``process_weights_after_loading`` then fills the three copies above. Then vLLM loads
the trainer's scales itself (:attr:`AttentionLayers.loads_scales`).

Without one (BF16 weights with ``kv_cache_dtype="fp8"``) there is no such parameter:
``load_weights`` refuses the name, and the layer's ``process_weights_after_loading`` resets every
scale to 1.0 (vLLM's ``set_default_quant_scales``) whenever it runs, the layerwise reload
included. So :meth:`AttentionLayers.apply_scales` writes the trainer's scales into all three
copies after the reload, the way the KV-cache method would, and only into layers whose cache is
quantized (vLLM keeps 1.0 for a BF16 cache). ``_q_scale`` stays vLLM's (1.0): it matters for FP8
attention kernels only, which the trainer does not calibrate for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.utils.torch_utils import is_quantized_kv_cache

from workers.fp8.kv_cache import quantize_kv
from workers.weight_sync.contract import dtype_name, kv_dtype_name, kv_scales_of
from workers.weight_sync.data import KvHeld

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class AttentionLayers:
    """A model's attention layers by decoder layer index, and their K/V scales."""

    def __init__(self, model: torch.nn.Module) -> None:
        # vLLM's Attention modules (typed Any: their scale attributes are set outside __init__)
        self.by_layer: dict[int, Any] = {}
        for name, module in model.named_modules():
            if isinstance(module, Attention):
                match = _LAYER_INDEX.search(name)
                if match is None:
                    raise ValueError(f"attention layer {name}: no decoder layer index in its name")
                self.by_layer[int(match.group(1))] = module
        # vLLM loads the scales itself when the layers carry a KV-cache quantization method
        self.loads_scales = any(
            isinstance(getattr(layer, "quant_method", None), BaseKVCacheMethod)
            for layer in self.by_layer.values()
        )
        self.scales_sent = False  # whether any update carried K/V scales (else none are reported)
        for layer in self.by_layer.values():
            if is_quantized_kv_cache(layer.kv_cache_dtype) and layer._k_scale.device.type == "cpu":
                layer.register_forward_pre_hook(round_kv_to_nearest, with_kwargs=True)

    def apply_scales(self, scales: Mapping[str, torch.Tensor]) -> None:
        """Write ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (0-d float32) into layer
        ``i``'s copies (see the module docstring). Every layer's pair must be there."""
        k, v = kv_scales_of(scales)
        if sorted(self.by_layer) != list(range(len(k))):
            raise ValueError(
                f"K/V scales for {len(k)} layers arrived; the model has attention in layers "
                f"{sorted(self.by_layer)}: trainer and generator run different models"
            )
        for i, layer in self.by_layer.items():
            if is_quantized_kv_cache(layer.kv_cache_dtype):
                _set_scales(layer, k[i], v[i])

    def held(self) -> KvHeld:
        """The cache dtype and the scales the layers compute with (empty lists while no update has
        carried scales). A layer whose device and host copies disagree reports NaN, which matches
        no sent scale."""
        order = [self.by_layer[i] for i in sorted(self.by_layer)]
        names = sorted({_cache_dtype(layer) for layer in order})
        dtype = names[0] if len(names) == 1 else f"mixed ({', '.join(names)})"
        if not self.scales_sent or not order:
            return KvHeld(dtype=dtype, k_scales=[], v_scales=[])
        device_k = torch.stack([layer._k_scale.float() for layer in order]).cpu().tolist()
        device_v = torch.stack([layer._v_scale.float() for layer in order]).cpu().tolist()
        k = [_agreed(float(layer._k_scale_float), d) for layer, d in zip(order, device_k, strict=True)]
        v = [_agreed(float(layer._v_scale_float), d) for layer, d in zip(order, device_v, strict=True)]
        return KvHeld(dtype=dtype, k_scales=k, v_scales=v)


def round_kv_to_nearest(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """A forward pre-hook of a CPU attention layer with an FP8 cache: K and V rounded to nearest
    on the E4M3 grid of the layer's scales before vLLM's cache kernel casts them.

    That kernel (``csrc/cpu/cpu_attn_fp8.hpp``, ``float_to_fp8e4m3_scalar``) multiplies by
    ``1 / scale`` and drops the low mantissa bits: it rounds toward zero, a bias of about half an
    E4M3 step towards smaller |K| and |V| that GPU kernels and the native cache (round to nearest)
    do not have. A value already on the grid passes that cast unchanged when ``x / scale`` is
    exact, which the power-of-two scales fp8rl calibrates (:mod:`workers.fp8.kv_cache`) make it;
    so the cache then holds what a round-to-nearest cast stores. Attention reads K and V from the
    cache, so the values the layer attends with are the same either way."""
    query, key, value, *rest = args
    key = quantize_kv(key, layer._k_scale).dequantize(key.dtype)
    value = quantize_kv(value, layer._v_scale).dequantize(value.dtype)
    return (query, key, value, *rest), kwargs


def _set_scales(layer: Any, k: float, v: float) -> None:
    layer._k_scale.fill_(k)  # in place: kernels and CUDA graphs hold these tensors
    layer._v_scale.fill_(v)
    layer._k_scale_float = k
    layer._v_scale_float = v
    for name, value in (("_k_scale_cpu", k), ("_v_scale_cpu", v)):
        host = getattr(layer, name, None)
        if isinstance(host, torch.Tensor):
            host.fill_(value)


def _agreed(host: float, device: float) -> float:
    return host if host == device else float("nan")


def _cache_dtype(layer: Any) -> str:
    """The element dtype of a layer's KV cache: FP8 caches by their format (vLLM stores them as
    uint8), others by the torch dtype vLLM allocates (``auto``: the model's)."""
    name = str(layer.kv_cache_dtype)
    return kv_dtype_name(name) if name.startswith("fp8") else dtype_name(layer.kv_cache_torch_dtype)
