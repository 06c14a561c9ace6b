"""Weights as a weight-sync payload, and the inverse load.

``export_weights(model)`` gives ``{parameter name: Fp8Tensor | Tensor}``:
- the weight of every :class:`Fp8Linear` as the trainer's *own* FP8 copy (the one its forward pass
  used), so a generator that loads it computes with exactly the trainer's quantized weights;
- weights named in ``fp8_names`` that the sender holds in high precision, quantized now with the
  receiver's settings (recipe ``fp8-gen``: BF16 trainer, FP8 generator), all at once
  (:func:`workers.fp8.weights.quantize_weights`: one launch on a GPU);
- everything else (embeddings, norms, lm_head, biases) as the tensor itself.

``load_weights(model, payload)`` is the inverse: FP8 entries go into the receiver's
``Fp8Linear`` layers unchanged (no re-quantization), tensors are copied into parameters. Names,
shapes and kinds are checked; an error names the parameter and says what to do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from workers.fp8.fp8_tensor import Fp8Tensor
from workers.fp8.linear import Fp8Linear
from workers.fp8.linear_config import Fp8LinearConfig
from workers.fp8.weights import quantize_weights
from workers.weight_sync.data import Payload


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return (model.get_submodule(module_name) if module_name else model), attr


def fp8_weight_names(model: nn.Module) -> list[str]:
    """Names of the parameters that ``model`` holds as FP8 weights."""
    return [
        f"{name}.weight" if name else "weight"
        for name, m in model.named_modules()
        if isinstance(m, Fp8Linear)
    ]


@torch.no_grad()
def export_weights(
    model: nn.Module,
    fp8_names: Iterable[str] = (),
    config: Fp8LinearConfig | None = None,
) -> Payload:
    """The model's parameters as a weight-sync payload (see the module docstring)."""
    cfg = config or Fp8LinearConfig()
    quantize_now = set(fp8_names)
    entries: dict[str, Fp8Tensor | torch.Tensor | None] = {}  # None: quantized below, all at once
    masters: list[tuple[str, torch.Tensor]] = []
    for name, param in model.named_parameters():
        module, attr = _owner(model, name)
        if isinstance(module, Fp8Linear) and attr == "weight":
            entries[name] = module.fp8_weight()
        elif name in quantize_now:
            entries[name] = None
            masters.append((name, param))
        else:
            entries[name] = param.detach()
    unknown = quantize_now - entries.keys()
    if unknown:
        raise ValueError(f"export_weights: fp8_names not in the model: {sorted(unknown)[:5]}")
    entries.update(zip((name for name, _ in masters), quantize_weights(masters, cfg), strict=True))
    return {name: value for name, value in entries.items() if value is not None}


def payload_bytes(payload: Mapping[str, Fp8Tensor | torch.Tensor]) -> int:
    """Bytes a payload puts on the wire (FP8 data + float32 scales + other tensors)."""
    total = 0
    for value in payload.values():
        if isinstance(value, Fp8Tensor):
            total += value.nbytes
        else:
            total += value.numel() * value.element_size()
    return total


@torch.no_grad()
def load_weights(model: nn.Module, payload: Mapping[str, Fp8Tensor | torch.Tensor]) -> None:
    """Load a payload from :func:`export_weights` into ``model`` (all names must match)."""
    params = dict(model.named_parameters())
    missing = sorted(params.keys() - payload.keys())
    unexpected = sorted(payload.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(
            "load_weights: sender and receiver models differ: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}; build both from "
            "the same model config"
        )
    for name, value in payload.items():
        module, attr = _owner(model, name)
        param = params[name]
        if isinstance(value, Fp8Tensor):
            if not (isinstance(module, Fp8Linear) and attr == "weight"):
                raise ValueError(
                    f"load_weights: {name} arrives in FP8 but the receiver holds it in "
                    f"{param.dtype}; convert the receiver with convert_model() using the same "
                    "recipe and keep_bf16 as the sender"
                )
            module.load_fp8_weight(value)
            continue
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"load_weights: {name} has shape {tuple(value.shape)}, receiver expects {tuple(param.shape)}"
            )
        if isinstance(module, Fp8Linear) and attr == "weight":
            raise ValueError(
                f"load_weights: {name} arrives in {value.dtype} but the receiver's layer is FP8; "
                "export with fp8_names=fp8_weight_names(receiver) (recipe fp8-gen)"
            )
        param.copy_(value.to(device=param.device, dtype=param.dtype))
