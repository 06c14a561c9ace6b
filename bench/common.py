"""What the data-plane benchmarks share: model presets, a device, a timer that waits for the GPU."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from rljob.spec import JobSpec, load_spec, parse_spec

T = TypeVar("T")

# Models by size (random init, byte tokenizer: no download). "tiny" is the CPU example's policy;
# "1b" has ~1.0B parameters (16 layers, hidden 2048, MLP 8192, GQA 16/8 heads); "8b-4l" has the
# layers of an 8B model (hidden 4096, MLP 14336, GQA 32/8 heads, as Llama-3-8B) but only 4 of them
# (~1.1B parameters with its vocabulary), so that it fits one GPU and a short run: where FP8's GEMM
# gain can show in training and decode (docs/gpu-checks.md).
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
    },
    "100m": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_layers": 8,
        "num_heads": 16,
        "num_kv_heads": 8,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_layers": 16,
        "num_heads": 16,
        "num_kv_heads": 8,
    },
    "8b-4l": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_layers": 4,
        "num_heads": 32,
        "num_kv_heads": 8,
    },
}


# Vocabulary of each preset: the byte tokenizer's ids are all a benchmark feeds, but a real
# model's output layer and sampling cover ~32k-150k tokens, which the GPU numbers must include.
VOCAB: dict[str, int] = {"100m": 32768, "1b": 32768, "8b-4l": 32768}


def vocab_size(model: str, tokenizer_vocab: int) -> int:
    """The vocabulary a benchmark builds ``model`` with (at least the tokenizer's)."""
    return max(VOCAB.get(model, 0), tokenizer_vocab)


# Real pretrained models by short name (``fp8rl model fetch`` names): ``--model smollm2``. A path
# to a Hugging Face directory works too. Their jobs are the example's (task, prompts, batch shape).
REAL_MODELS: dict[str, str] = {"smollm2": "smollm2-135m-instruct"}
REAL_EXAMPLE = Path(__file__).parents[1] / "examples" / "smollm2-addition.yaml"


def real_model_dir(model: str) -> Path | None:
    """The Hugging Face directory ``model`` names (a :data:`REAL_MODELS` name, fetched into the
    model cache if it is not there yet, or a directory), None for a random-init preset."""
    if model in MODELS:
        return None
    if model in REAL_MODELS:
        from workers.models.store import fetch

        return fetch(REAL_MODELS[model])
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--model {model!r}: not a preset ({', '.join(sorted(MODELS))}), a real model "
            f"({', '.join(sorted(REAL_MODELS))}) or a Hugging Face directory with a config.json"
        )
    return path


def real_spec(path: Path, recipe: str, device: torch.device, **extra: Any) -> JobSpec:
    """The job of ``examples/smollm2-addition.yaml`` (task, chat prompts, tokenizer, batch shape)
    on the model at ``path`` with ``recipe``; ``extra`` overrides whole sections' fields."""
    data = load_spec(REAL_EXAMPLE).model_dump(exclude_unset=True)
    data["model"] = {"name": str(path)}
    gpus = 1 if device.type == "cuda" else 0
    data["resources"] = {**data.get("resources", {}), "gpus_per_generator": gpus, "gpus_per_trainer": gpus}
    data["precision"] = {**data.get("precision", {}), "recipe": recipe}
    for section, fields in extra.items():
        data[section] = {**data.get(section, {}), **fields}
    return parse_spec(data)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: use auto, cpu or cuda")
    return torch.device(device)


def bench_spec(model: str, recipe: str, device: torch.device, positions: int = 1024, **extra: Any) -> JobSpec:
    """A job spec for benchmarking: the preset model (``positions`` long), the recipe, one GPU per
    engine on CUDA."""
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: choose one of {sorted(MODELS)}")
    gpus = 1 if device.type == "cuda" else 0
    data: dict[str, Any] = {
        "model": {"tiny": {**MODELS[model], "max_position_embeddings": positions}},
        "precision": {"recipe": recipe, **extra.pop("precision", {})},
        "resources": {"gpus_per_generator": gpus, "gpus_per_trainer": gpus},
        **extra,
    }
    return parse_spec(data)


def timed(device: torch.device, fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and its seconds, waiting for the GPU at both ends (a benchmark, not a hot loop)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"CPU, {torch.get_num_threads()} threads (torch {torch.__version__})"
