"""What the driver needs from a generator and a trainer, whatever engine is behind them.

Layout shared by both (so a generator's and a trainer's log-probs are comparable token by token):
a batch of ``B`` sequences is ``prompt [B, P]`` left-padded, followed by ``response [B, L]``
right-padded. ``response_mask [B, L]`` is 1 for sampled tokens up to and including EOS.
Position ids count valid tokens only, so padding never shifts a sequence.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from rljob import metrics as m
from workers.fp8.convert import Fp8Audit
from workers.fp8.export import Payload as Payload  # re-exported: what the engines exchange
from workers.weight_sync import SyncResult


class Rollouts(NamedTuple):
    """Sampled responses.

    prompt_ids:     [B, P] int64, left-padded with the tokenizer's pad id
    prompt_mask:    [B, P] int64, 1 on prompt tokens
    response_ids:   [B, L] int64, right-padded after EOS
    response_mask:  [B, L] float32, 1 on sampled tokens (EOS included)
    logprobs:       [B, L] float32, the generator's log p(token) at the sampling temperature
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor


class TrainStats(NamedTuple):
    """One RL update: the trainer's log-probs before it, and scalar statistics."""

    logprobs_old: torch.Tensor  # [B, L] float32: trainer log-probs with the weights that generated
    stats: m.TrainMetrics  # crosses Ray as a plain dict


# Step statistics every trainer sums over the trainers on the device (plus the maxima ``is_max``
# and ``grad_norm``), then reads back once: :func:`train_stats`.
STEP_SUMS = ("loss", "clipped", "is_sum", "kl", "tokens", "adv_abs_sum", "sequences")


def train_stats(totals: dict[str, torch.Tensor]) -> m.TrainMetrics:
    """The ``train/*`` and ``is/*`` statistics of one RL step from its totals (0-d tensors on the
    device, already reduced over the trainers), read back in one transfer."""
    values = dict(zip(totals, torch.stack(list(totals.values())).tolist(), strict=True))
    tokens = max(values["tokens"], 1.0)
    return {
        m.TRAIN_LOSS: values["loss"],
        m.TRAIN_GRAD_NORM: values["grad_norm"],
        m.TRAIN_CLIP_FRACTION: values["clipped"] / tokens,
        m.TRAIN_KL: values["kl"] / tokens,
        m.IS_WEIGHT_MEAN: values["is_sum"] / tokens,
        m.IS_WEIGHT_MAX: values["is_max"],
        m.TRAIN_ADVANTAGE_ABS_MEAN: values["adv_abs_sum"] / max(values["sequences"], 1.0),
        m.TRAIN_TOKENS: values["tokens"],
    }


class Generator(Protocol):
    """What the generator actor calls. Built by :func:`workers.engines.factory.build_generator`."""

    audit: Fp8Audit  # per-layer precision and GEMM kernels, printed at the start of a run
    kv_cache_bytes: int  # bytes the KV cache held at the end of the last generate()

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights hold on the device (FP8 layers: data + scales)."""
        ...

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> Rollouts:
        """Responses to ``prompts``; ``temperature`` 0 is greedy (log-probs then at temperature 1)."""
        ...

    def load_weights(self, payload: Payload) -> None: ...

    def fp8_weight_names(self) -> list[str]:
        """The weights held in FP8: what the trainer must send as FP8 data + scales."""
        ...

    def join_weight_channel(self, address: str, first_rank: int, world_size: int) -> None:
        """Join the NCCL weight channel of a vLLM/Megatron job (:mod:`workers.engines.nccl_channel`)
        as ranks ``first_rank ..`` (one per receiving process)."""
        ...

    def receive_weights(self) -> SyncResult:
        """Receive one version over the weight channel and compute with it from now on."""
        ...


class Trainer(Protocol):
    """What the trainer actor calls. Built by :func:`workers.engines.factory.build_trainer`."""

    audit: Fp8Audit
    device: torch.device  # where the weights live (checkpoints load there)

    @property
    def weight_bytes(self) -> int: ...

    def logprobs(self, batch: Rollouts, temperature: float) -> torch.Tensor: ...

    def train_step(self, batch: Rollouts, rewards: torch.Tensor, temperature: float) -> TrainStats:
        """One RL update; with several trainers the stats cover the whole batch."""
        ...

    def sft_step(self, batch: Rollouts) -> float:
        """One supervised warm-up step; the mean token NLL over every trainer."""
        ...

    def export_weights(self, fp8_names: list[str] | tuple[str, ...] = ()) -> Payload:
        """The payload the generators load (see :mod:`workers.fp8.export`). Called on every
        trainer (a sharded engine gathers here); the first trainer returns it, the others ``{}``."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, P]`` ids and mask, each prompt right-aligned."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only valid tokens: ``[B, T]`` from a ``[B, T]`` mask."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def concat_rollouts(parts: list[Rollouts], pad_id: int) -> Rollouts:
    """Rollouts of several generators as one batch, re-padded to common widths."""
    if len(parts) == 1:
        return parts[0]
    p = max(r.prompt_ids.shape[1] for r in parts)
    length = max(r.response_ids.shape[1] for r in parts)

    def pad(t: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
        extra = width - t.shape[1]
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

    return Rollouts(
        prompt_ids=torch.cat([pad(r.prompt_ids, p, pad_id, True) for r in parts]),
        prompt_mask=torch.cat([pad(r.prompt_mask, p, 0, True) for r in parts]),
        response_ids=torch.cat([pad(r.response_ids, length, pad_id, False) for r in parts]),
        response_mask=torch.cat([pad(r.response_mask, length, 0.0, False) for r in parts]),
        logprobs=torch.cat([pad(r.logprobs, length, 0.0, False) for r in parts]),
    )


def split_rows(batch: Rollouts, sizes: list[int]) -> list[Rollouts]:
    """Consecutive row slices of ``batch`` of the given sizes."""
    out, start = [], 0
    for n in sizes:
        out.append(Rollouts(*(t[start : start + n] for t in batch)))
        start += n
    return out


def even_split(n_groups: int, group_size: int, parts: int) -> list[int]:
    """Rows per worker when ``n_groups`` groups are shared by ``parts`` workers (groups never split)."""
    base, extra = divmod(n_groups, parts)
    return [(base + (1 if i < extra else 0)) * group_size for i in range(parts)]
