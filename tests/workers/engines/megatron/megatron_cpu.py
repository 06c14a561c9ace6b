"""What the Megatron-Core CPU tests share: tiny Llama/Qwen2 job specs, Hugging Face models with
every weight random (norms and biases too, so a swapped or dropped mapping shows), a fixed batch,
and process-group cleanup. Not a test module: the spawned workers of
test_megatron_parallel.py import it too."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rljob import JobSpec, parse_spec
from workers.engines.models import model_config
from workers.engines.protocols import Rollouts
from workers.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
VOCAB = TOK.vocab_size
# Llama: grouped-query attention (4 heads share 2 KV heads), untied; Qwen2: q/k/v biases, tied
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
              "num_heads": 4, "num_kv_heads": 2},
    "qwen2": {"arch": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
              "num_heads": 4, "num_kv_heads": 2, "tie_word_embeddings": True},
}  # fmt: skip
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])


def cpu_spec(arch: str = "llama", recipe: str = "bf16", **sections: Any) -> JobSpec:
    """A Megatron job on the CPU; ``sections`` replace whole top-level sections, except
    ``resources``, whose keys are added to the Megatron ones."""
    data: dict[str, Any] = {
        "model": {"tiny": MODELS[arch], "init_seed": 3},
        "precision": {"recipe": recipe},
        "rollout": {"group_size": 4},
        # 8 rows in micro-batches of 3, 3, 2; a step large enough to move every weight visibly
        "optimizer": {"micro_batch_size": 3, "lr": 1e-3},
        **{k: v for k, v in sections.items() if k != "resources"},
        "resources": {"trainer_engine": "megatron", **sections.get("resources", {})},
    }
    return parse_spec(data)


def random_hf_model(spec: JobSpec, seed: int = 7) -> Any:
    """The spec's Hugging Face architecture (built from its config, nothing downloaded) with every
    parameter drawn at random, float32, eager attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(spec, VOCAB), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if name.endswith("norm.weight") else 0.0  # norms near 1, the rest near 0
            p.copy_(centre + 0.1 * torch.randn_like(p))
    return model.float().eval()


def hf_state(model: Any) -> dict[str, torch.Tensor]:
    """Parameters by name (a tied lm_head appears once, as the embedding)."""
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def fixed_batch(rows: int = 8, prompt: int = 5, length: int = 6, seed: int = 0) -> Rollouts:
    """``rows`` sequences of random byte ids: left-padded prompts of different lengths (row r has
    ``r % 3`` pads) and responses of different lengths (row r ends ``r % 4`` tokens early), with
    generator log-probs near the trainer's (importance weights near 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, prompt + length), generator=g)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    response_mask = torch.ones(rows, length)
    for r in range(rows):
        prompt_mask[r, : r % 3] = 0
        response_mask[r, length - r % 4 :] = 0
    prompt_ids = torch.where(prompt_mask.bool(), ids[:, :prompt], TOK.pad_id)
    logprobs = (-5.0 - 0.1 * torch.rand(rows, length, generator=g)) * response_mask
    return Rollouts(prompt_ids, prompt_mask, ids[:, prompt:], response_mask, logprobs)


def rows_of(batch: Rollouts, rank: int, world: int) -> Rollouts:
    """Trainer ``rank``'s share of ``batch``: consecutive rows, as the driver splits them."""
    per = batch.prompt_ids.shape[0] // world
    return Rollouts(*(t[rank * per : (rank + 1) * per] for t in batch))


def megatron_logits(trainer: Any, ids: torch.Tensor) -> torch.Tensor:
    """``[B, T, V/tp]`` float logits of this rank's vocabulary columns (the padded vocabulary) for
    right-aligned rows (positions 0..T-1, causal), from the trainer's Megatron model."""
    from workers.engines.megatron.without_cuda import causal_mask

    model = trainer.model
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    mask = causal_mask(ids.shape[1], ids.device)
    with torch.no_grad(), model.calls():
        logits: torch.Tensor = model.model(input_ids=ids, position_ids=positions, attention_mask=mask)
    return logits.float()


def assert_same_stats(got: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """A step's statistics to 1e-5 relative; the loss to 1e-6 absolute (it sums advantage-weighted
    log-probs of size ~5 that nearly cancel, so its relative error is large)."""
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        print(f"{key}: {got[key]:.8g} vs {value:.8g}")
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6 if key == "train/loss" else 1e-8), key


def assert_same_state(got: dict[str, Any], expected: dict[str, Any]) -> None:
    """Two checkpoints hold the same bits (weights, Adam's steps and moments)."""
    assert got["model"].keys() == expected["model"].keys()
    assert all(torch.equal(got["model"][k], v) for k, v in expected["model"].items())
    assert got["optimizer"]["steps"] == expected["optimizer"]["steps"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert all(torch.equal(got["optimizer"][key][k], v) for k, v in expected["optimizer"][key].items())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def release_megatron() -> None:
    """Megatron's parallel state and the default process group, as before the test."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def one_rank_group() -> Iterator[None]:
    """A 1-rank gloo process group (the trainer actor's group of one trainer) for the test."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        release_megatron()
