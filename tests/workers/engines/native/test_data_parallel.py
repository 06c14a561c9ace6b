"""Data parallelism: two trainers over gloo report what one trainer reports on the same batch.

Two processes (torch.distributed, gloo) each hold a :class:`NativeTrainer` with the same initial
weights and train on their half of a batch (whole GRPO groups each); a third trainer, alone,
trains on the whole batch. The second method is the single trainer: loss, gradient norm, token
count, clip fraction, IS weights, KL and advantage magnitude must agree, and so must the weights
after the step. With several optimizer steps per RL step (``minibatches``), each trainer splits
its own rows, so minibatch ``m`` of the pair is "trainer 0's m-th chunk + trainer 1's m-th
chunk": the single trainer gets its batch in that order. Micro-batches are the same sequences on
both sides (size 2): FP8 wgrad tiles run along tokens, so a different micro-batch split would
group tokens differently and round them differently (that is FP8, not data parallelism).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from rljob import JobSpec, parse_spec
from tests.helpers import TWO_LAYER_MODEL
from workers.engines.batching import left_pad, split_rows
from workers.engines.native.trainer import NativeTrainer
from workers.engines.protocols import Rollouts
from workers.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
KEYS = (
    "train/loss", "train/grad_norm", "train/tokens", "train/clip_fraction", "is/weight_mean",
    "is/weight_max", "train/kl", "train/advantage_abs_mean",
)  # fmt: skip


def spec(minibatches: int) -> JobSpec:
    return parse_spec(
        {
            "model": {"tiny": TWO_LAYER_MODEL, "init_seed": 3},
            "precision": {"recipe": "fp8-e2e"},
            "rollout": {"group_size": 2},
            "algorithm": {"minibatches": minibatches, "kl": {"coef": 0.05}},
            "optimizer": {"lr": 1e-3, "micro_batch_size": 2},
        }
    )


def make_batch() -> tuple[Rollouts, torch.Tensor]:
    """8 sequences (4 groups of 2), responses of varied length, generator log-probs off the
    trainer's by a little (so the IS weights are not all 1)."""
    g = torch.Generator().manual_seed(0)
    prompts = [TOK.encode(f"{a} + {a + 1} =") for a in range(8)]
    ids, mask = left_pad(prompts, TOK.pad_id)
    lengths = torch.tensor([5, 2, 4, 5, 1, 3, 5, 4])
    response_mask = (torch.arange(5)[None, :] < lengths[:, None]).float()
    response = torch.randint(48, 58, (8, 5), generator=g) * response_mask.long()
    trainer = NativeTrainer(spec(1), TOK.vocab_size)
    base = Rollouts(ids, mask, response, response_mask, torch.zeros(8, 5))
    logp_gen = (trainer.logprobs(base, 1.0) + 0.05 * torch.randn(8, 5, generator=g)) * response_mask
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0])
    return Rollouts(ids, mask, response, response_mask, logp_gen), rewards


def _member(rank: int, init: str, minibatches: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        batch, rewards = make_batch()
        part = split_rows(batch, [4, 4])[rank]
        trainer = NativeTrainer(spec(minibatches), TOK.vocab_size, "cpu", dist.group.WORLD)
        stats = trainer.train_step(part, rewards[4 * rank : 4 * rank + 4], 1.0).stats
        if rank == 0:
            weights = {k: v.tolist() for k, v in trainer.model.state_dict().items()}
            Path(out).write_text(json.dumps({"stats": stats, "weights": weights}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("minibatches", [1, 2])
def test_two_trainers_equal_one_on_the_same_batch(tmp_path: Path, minibatches: int) -> None:
    out = tmp_path / "rank0.json"
    spawn(_member, args=(f"file://{tmp_path}/init", minibatches, str(out)), nprocs=2, join=True)
    pair: dict[str, Any] = json.loads(out.read_text())
    batch, rewards = make_batch()
    if minibatches == 2:  # minibatch m = trainer 0's m-th chunk + trainer 1's m-th chunk
        order = [0, 1, 4, 5, 2, 3, 6, 7]
        batch = Rollouts(*(t[order] for t in batch))
        rewards = rewards[order]
    alone = NativeTrainer(spec(minibatches), TOK.vocab_size)
    stats: Mapping[str, Any] = alone.train_step(batch, rewards, 1.0).stats
    assert stats["train/tokens"] == 29.0  # by hand: 5+2+4+5+1+3+5+4
    for key in KEYS:
        assert pair["stats"][key] == pytest.approx(stats[key], rel=1e-5, abs=1e-7), key
    assert stats["train/grad_norm"] > 0 and stats["is/weight_max"] != 1.0
    for name, value in alone.model.state_dict().items():
        torch.testing.assert_close(torch.tensor(pair["weights"][name]), value, rtol=1e-5, atol=1e-6)
