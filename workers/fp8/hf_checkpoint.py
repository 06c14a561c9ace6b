"""Hugging Face block-FP8 checkpoints: the format vLLM, SGLang and transformers' FineGrainedFP8 load.

The layout of DeepSeek-V3 and Qwen3-FP8 checkpoints. For every FP8 linear ``X`` (a Hugging Face
module path such as ``model.layers.0.self_attn.q_proj``)::

    X.weight            float8_e4m3fn  [N, K]
    X.weight_scale_inv  float32        [ceil(N/128), ceil(K/128)]
    W ~= X.weight.float() * X.weight_scale_inv      (each scale broadcast over its 128x128 block)

``weight_scale_inv`` is the dequantization multiplier (the inverse of the scale a quantizer divides
by), which is exactly :attr:`Fp8Tensor.scale` of a ``(128, 128)``-blocked E4M3 weight: the bytes of
the trainer's FP8 weights go into the file unchanged, never re-quantized. The last block of a row or
column may be partial; its scale is stored like any other. Every other tensor (embeddings, norms,
``lm_head``, biases, linears kept in BF16) is stored in bfloat16, except 0-d tensors and KV-cache
scales (``k_scale``/``v_scale``), which stay float32. ``config.json`` carries a
``quantization_config`` (:func:`quantization_config`) naming the linears kept in BF16 twice: vLLM
reads ``ignored_layers``, transformers ``modules_to_not_convert``.

Tensor parallelism (vLLM): column-parallel linears (q/k/v, gate/up) are split by output rows,
row-parallel ones (o, down) by input columns. A GPU's share of a block-FP8 weight must be whole
128x128 blocks, so that it takes whole rows (or columns) of the scale: rank ``r`` of ``tp`` gets rows
``[r*N/tp, (r+1)*N/tp)`` of the weight and rows ``[r*N/tp/128, (r+1)*N/tp/128)`` of the scale.
vLLM cuts each rank's share so as it loads; :func:`check_tp_partitions` says before a load which
layers cannot be cut that way.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.fp8.fp8_tensor import Fp8Tensor
from workers.fp8.linear import Fp8Linear

WEIGHT_BLOCK: tuple[int, int] = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
COLUMN_PARALLEL: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL: tuple[str, ...] = ("o_proj", "down_proj")

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_FLOAT32_SUFFIXES = ("k_scale", "v_scale")  # KV-cache scales: float32 scalars, as vLLM reads them
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def quantization_config(ignored_layers: Sequence[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for 128x128-block E4M3 weights and dynamic
    activation scales; ``ignored_layers``: the linear modules stored in BF16 (module paths)."""
    ignored = list(ignored_layers)
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(WEIGHT_BLOCK),
        "ignored_layers": ignored,  # vLLM
        "modules_to_not_convert": list(ignored),  # transformers
    }


def _scale_shape(shape: Sequence[int]) -> tuple[int, int]:
    return (math.ceil(shape[0] / WEIGHT_BLOCK[0]), math.ceil(shape[1] / WEIGHT_BLOCK[1]))


def _check_fp8_weight(name: str, value: Fp8Tensor) -> None:
    """Raise ValueError unless ``value`` is a 2-D E4M3 weight in float32-scaled 128x128 blocks."""
    problem = None
    if name != "weight" and not name.endswith(".weight"):
        problem = "only linear weights (names ending in .weight) can be stored in FP8"
    elif value.data.dtype != torch.float8_e4m3fn:
        problem = f"its data is {value.data.dtype}; the format stores E4M3 (torch.float8_e4m3fn) weights"
    elif value.block != WEIGHT_BLOCK:
        problem = (
            f"its scaling block is {value.block}; the format needs {WEIGHT_BLOCK[0]}x{WEIGHT_BLOCK[1]} "
            "weight blocks (Fp8LinearConfig.weight_block)"
        )
    elif value.data.dim() != 2:
        problem = f"it has shape {tuple(value.data.shape)}; FP8 weights must be 2-D [out, in]"
    elif value.scale.dtype != torch.float32 or tuple(value.scale.shape) != _scale_shape(value.shape):
        problem = (
            f"its scale is {value.scale.dtype} {tuple(value.scale.shape)}; a {tuple(value.shape)} "
            f"weight needs float32 {_scale_shape(value.shape)} (one per 128x128 block)"
        )
    if problem is not None:
        raise ValueError(f"{name}: cannot be stored as a block-FP8 checkpoint weight: {problem}")


def checkpoint_tensors(payload: Mapping[str, Fp8Tensor | torch.Tensor]) -> dict[str, torch.Tensor]:
    """A weight-sync payload (:func:`~workers.weight_sync.payload.export_weights`) as checkpoint tensors.

    ``Fp8Tensor`` at ``X.weight`` -> ``X.weight`` (its float8 data, unchanged) and
    ``X.weight_scale_inv`` (its float32 scale, unchanged). Floating tensors -> bfloat16, except
    0-d tensors and ``*k_scale``/``*v_scale`` (float32). Other tensors as they are.
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in payload.items():
        if isinstance(value, Fp8Tensor):
            _check_fp8_weight(name, value)
            scale_name = name + SCALE_SUFFIX
            if scale_name in payload:
                raise ValueError(f"{scale_name}: the payload has it already, and also {name} in FP8")
            out[name] = value.data.contiguous()  # [N, K] float8_e4m3fn
            out[scale_name] = value.scale.contiguous()  # [ceil(N/128), ceil(K/128)] float32
        elif value.dtype in _FLOAT8:
            raise ValueError(
                f"{name}: a {value.dtype} tensor without its scales; pass it as an Fp8Tensor "
                "(data and scale) so that it is stored with its weight_scale_inv"
            )
        elif not value.is_floating_point():
            out[name] = value
        elif value.dim() == 0 or name.endswith(_FLOAT32_SUFFIXES):
            out[name] = value.to(torch.float32)
        else:
            out[name] = value.to(torch.bfloat16)
    return out


def ignored_linear_names(model: nn.Module) -> list[str]:
    """Module paths of the ``nn.Linear`` layers that are not :class:`Fp8Linear` (the decoder
    linears kept in BF16, and ``lm_head``), sorted: the checkpoint's ``ignored_layers``."""
    return sorted(
        name for name, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, Fp8Linear)
    )


# --- tensor parallelism (vLLM) ----------------------------------------------------------------


def _parallel_style(name: str) -> str | None:
    """``column`` | ``row`` for a tensor-parallel linear's weight (or module) name, else None."""
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    if leaf in COLUMN_PARALLEL:
        return "column"
    if leaf in ROW_PARALLEL:
        return "row"
    return None


def _splits_into_blocks(size: int, tp: int, block: int) -> bool:
    return size % tp == 0 and (size // tp) % block == 0


def _split_message(layer: str, which: str, size: int, tp: int) -> str:
    per = str(size // tp) if size % tp == 0 else f"{size / tp:.2f}"
    return (
        f"{layer}: its {which} size {size} split over tensor_parallel_size {tp} gives {per} per GPU, "
        f"not a multiple of {WEIGHT_BLOCK[0]} (vLLM's block-FP8 weights need whole "
        f"{WEIGHT_BLOCK[0]}x{WEIGHT_BLOCK[1]} blocks per GPU); use a tensor_parallel_size that gives "
        "multiples of 128 if one does; else this model cannot be FP8 on vLLM (precision.keep_bf16_layers "
        "keeps whole decoder layers: enough only when the layer is one of those): precision.recipe bf16, "
        "or resources.generator_engine native, which runs partial blocks"
    )


def _check_tp(tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tensor_parallel_size {tp}: need tp >= 1")


def check_tp_partitions(
    shapes: Mapping[str, tuple[int, int]], tp: int, require_whole_blocks: bool = True
) -> None:
    """Raise ValueError listing every FP8 weight vLLM cannot split over ``tp`` GPUs.

    ``shapes``: FP8 weight name (``...q_proj.weight``) -> ``[N, K]``. Column-parallel layers need
    ``N/tp`` a whole number of 128 blocks, row-parallel ones ``K/tp`` when ``tp > 1``.
    ``require_whole_blocks``: also at ``tp = 1``, column-parallel layers need ``N`` a multiple of
    128, because vLLM fuses q/k/v and gate/up into one weight and each part must start on a block.
    (vLLM exempts the last part, v_proj and up_proj; they have k_proj's and gate_proj's shapes in
    Llama and Qwen, so checking them too refuses nothing vLLM would load.)
    Other names (``lm_head``, anything replicated) are not checked.
    """
    _check_tp(tp)
    problems = []
    for name, (n, k) in shapes.items():
        style, layer = _parallel_style(name), name.removesuffix(".weight")
        if style == "column" and (tp > 1 or require_whole_blocks):
            if not _splits_into_blocks(n, tp, WEIGHT_BLOCK[0]):
                problems.append(_split_message(layer, "output", n, tp))
        elif style == "row" and tp > 1 and not _splits_into_blocks(k, tp, WEIGHT_BLOCK[1]):
            problems.append(_split_message(layer, "input", k, tp))
    if problems:
        raise ValueError("\n".join(problems))


# --- files --------------------------------------------------------------------------------------


def _storable(tensors: Mapping[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Host tensors safetensors accepts: contiguous, each with a storage of its own.

    safetensors refuses tensors that share memory. A tied ``lm_head.weight`` (``tied``: the config
    says tie_word_embeddings) is dropped, as Hugging Face saves tied models; any other tensor that
    shares or only partly fills its storage is copied.
    """
    out: dict[str, torch.Tensor] = {}
    owners: dict[int, str] = {}
    for name, value in tensors.items():
        t = value.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        shared = t.numel() > 0 and storage.data_ptr() in owners
        if shared and tied and name.split(".")[-2:] == ["lm_head", "weight"]:
            continue
        if shared or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        if t.numel() > 0:
            owners[t.untyped_storage().data_ptr()] = name
        out[name] = t
    return out


def _shards(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive tensors packed into shards of at most ``max_shard_bytes``; an FP8 weight and its
    scale go into the same shard, and a unit larger than the limit gets a shard of its own."""
    units: list[list[str]] = []
    for name in tensors:
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in tensors:
            continue  # travels with its weight
        scale = name + SCALE_SUFFIX
        units.append([name, scale] if scale in tensors else [name])
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for unit in units:
        n = sum(tensors[k].numel() * tensors[k].element_size() for k in unit)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update((k, tensors[k]) for k in unit)
        size += n
    return shards


def write_checkpoint(
    out_dir: Path,
    tensors: Mapping[str, torch.Tensor],
    config: dict[str, Any],
    max_shard_bytes: int = 5 * 2**30,
) -> list[Path]:
    """Write ``tensors`` as safetensors and ``config`` as ``config.json`` into ``out_dir``.

    One ``model.safetensors``, or (over ``max_shard_bytes``) ``model-0000i-of-0000n.safetensors``
    and ``model.safetensors.index.json`` whose ``weight_map`` names each tensor's file. Everything
    is written into a temporary directory beside ``out_dir`` and renamed into place, so a crash
    leaves nothing half-written. ``out_dir`` must not exist or be empty. Returns the files written.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be at least 1")
    if not tensors:
        raise ValueError(f"{out_dir}: no tensors to write")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(
            f"{out_dir} already exists and is not an empty directory; remove it or choose another"
        )
    storable = _storable(tensors, bool(config.get("tie_word_embeddings", False)))
    shards = _shards(storable, max_shard_bytes)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        for file, shard in zip(names, shards, strict=True):
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
        written = list(names)
        if n > 1:
            index = {
                "metadata": {"total_size": sum(t.numel() * t.element_size() for t in storable.values())},
                "weight_map": {
                    name: file for file, shard in zip(names, shards, strict=True) for name in shard
                },
            }
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            written.append(INDEX_FILE)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        written.append("config.json")
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); os.replace needs the name free
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out_dir / f for f in written]
