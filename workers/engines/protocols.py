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
from workers.weight_sync.data import Payload, SyncResult, WeightReport


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
        """Join the NCCL weight channel of a vLLM/Megatron job (:mod:`workers.weight_sync.channel`)
        as ranks ``first_rank ..`` (one per receiving process)."""
        ...

    def receive_weights(self) -> SyncResult:
        """Receive one version over the weight channel and compute with it from now on."""
        ...

    def weight_report(self) -> WeightReport:
        """What the generator holds after the last weight update, per weight: the checksums of the
        bytes it received and the precision each layer computes with, and its KV cache's dtype and
        scales (:mod:`workers.weight_sync.contract`). Plain data: it crosses Ray."""
        ...

    def trace_token(self, prompt: torch.Tensor, response: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every module's output, float32, at the last token of ``prompt + response`` (a single
        sequence) computed as :meth:`generate` computes it: prefill, then decode steps
        (:mod:`workers.engines.layer_diff`). An engine that cannot trace raises
        :class:`NotImplementedError` saying so."""
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

    def calibrate_kv(self, batch: Rollouts) -> None:
        """Calibrate the K/V-cache scales the next export carries on ``batch`` (this trainer's
        rows) with the current weights; a no-op unless the trainer calibrates them for vLLM."""
        ...

    def export_weights(self, fp8_names: list[str] | tuple[str, ...] = ()) -> Payload:
        """The payload the generators load (see :mod:`workers.weight_sync.payload`). Called on every
        trainer (a sharded engine gathers here); the first trainer returns it, the others ``{}``."""
        ...

    def trace_token(self, prompt: torch.Tensor, response: torch.Tensor) -> dict[str, torch.Tensor]:
        """As :meth:`Generator.trace_token`, computed as the trainer scores a token: one
        full-sequence forward. An engine that cannot trace raises :class:`NotImplementedError`."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
