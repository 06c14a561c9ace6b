"""What one RL step needs from the job's trainers and generators, whatever runs them.

:mod:`workers.rl.step` orchestrates over :class:`StepActors` and never sees the transport:
:class:`workers.job.actor_group.JobActors` runs the trainers and generators as Ray actors (the only code
in the RL loop that knows Ray); the tests run the same step on a native trainer and generator in
one process. Each method says what runs concurrently inside it; a method returns once all of it
is done, so two calls never overlap, except :meth:`StepActors.start_generate`, which returns at
once: the RL loop (:mod:`workers.rl.loop`; with ``rollout.max_staleness`` >= 1) trains while
the generators work, and collects their rollouts later. Each generator runs its calls one at a time
in the order they were made, so a weight sync asked for after a ``start_generate`` reaches the
generators when that generation is done: weights change only between batches.

Every argument and result is plain data (tensors, NamedTuples, dicts): it crosses a process
boundary as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from rljob.spec import JobSpec
from workers.engines.layer_diff import Trace
from workers.engines.protocols import Rollouts, TrainStats
from workers.models.tokenizer import Tokenizer
from workers.tasks import Task
from workers.weight_sync.data import WeightReport


class Generated(NamedTuple):
    """One generator's answer to its chunk of prompts."""

    rollouts: Rollouts
    kv_cache_bytes: int  # bytes its KV cache held at the end of the generation
    weight_bytes: int  # bytes its weights hold on the device (FP8 layers: data + scales)
    started: float = 0.0  # wall clock (Unix seconds) when the generator began this chunk
    finished: float = 0.0  # ... and when it was done (timing/overlap_s of the asynchronous loop)


class PendingRollouts(Protocol):
    """A generation asked for and not yet collected (:meth:`StepActors.start_generate`)."""

    def result(self) -> list[Generated]:
        """The generators' answers, waiting for them if need be (never polling); the same list
        on every call."""
        ...


class WeightTransfer(NamedTuple):
    """One weight sync: what trainer 0 sent, and what each generator holds after it."""

    bytes: int  # bytes trainer 0 sent (each generator receives the same)
    sent: WeightReport  # trainer 0's report of what it sent (workers.weight_sync.contract.sent_report)
    received: list[WeightReport]  # [G] each generator's report of what it holds, in generator order


class StepActors(Protocol):
    """The job's trainers (``0..T-1``, data-parallel replicas) and generators (``0..G-1``)."""

    @property
    def num_trainers(self) -> int: ...

    @property
    def num_generators(self) -> int: ...

    def generate(
        self, chunks: list[list[list[int]]], seeds: list[int], temperature: float | None = None
    ) -> list[Generated]:
        """Generator ``i`` samples responses to ``chunks[i]`` (token ids) with ``seeds[i]``, one
        chunk and one seed per generator; all generators run in parallel, and one whose chunk is
        empty sits out. Returns one :class:`Generated` per non-empty chunk, in chunk order.
        ``temperature`` overrides ``rollout.temperature`` (validation; 0 = greedy)."""
        ...

    def start_generate(
        self, chunks: list[list[list[int]]], seeds: list[int], temperature: float | None = None
    ) -> PendingRollouts:
        """:meth:`generate` asked for now and collected with ``.result()``: the generators run it
        after the calls made to them before, and before any made after (a weight sync included)."""
        ...

    def train(self, parts: list[Rollouts], rewards: list[torch.Tensor]) -> list[TrainStats]:
        """Trainer ``i`` takes one RL update on ``parts[i]`` with ``rewards[i]`` (``[B_i]``); the
        trainers run in parallel (gradients all-reduced), so every trainer's stats cover the whole
        batch. Under ``precision.exact`` a trainer that finds a log-prob differing from the
        generator's raises :class:`~workers.engines.layer_diff.ExactMismatchError` before
        any update; ``trainer_index`` names it and ``row`` is a row of its own part."""
        ...

    def sft_step(self, parts: list[Rollouts]) -> float:
        """One supervised warm-up step, trainer ``i`` on ``parts[i]``, the trainers in parallel;
        the mean token NLL over the whole batch."""
        ...

    def calibrate_kv(self, parts: list[Rollouts]) -> None:
        """Trainer ``i`` calibrates the K/V-cache scales of its next export on ``parts[i]``."""
        ...

    def trace_token(self, trainer: int, prompt: torch.Tensor, response: torch.Tensor) -> tuple[Trace, Trace]:
        """Per-module outputs at the last token of ``response`` after the unpadded ``prompt``:
        generator 0's way and trainer ``trainer``'s way, the two in parallel
        (:mod:`workers.engines.layer_diff`; native engines only)."""
        ...

    def send_and_receive_weights(self) -> WeightTransfer:
        """Trainer 0 sends its current weights while every generator receives them (the other
        trainers export alongside: a sharded trainer gathers), all at once; returns once every
        generator computes with them."""
        ...

    def save(self, directory: Path) -> None:
        """Every trainer takes part (a sharded trainer gathers), in parallel; trainer 0 writes
        ``trainer.pt`` into ``directory``."""
        ...

    def load(self, directory: Path) -> None:
        """Every trainer loads ``trainer.pt`` from ``directory``, in parallel."""
        ...


@dataclass(frozen=True)
class StepContext:
    """What every phase of a run works with (the steps, warm-up, validation, KV calibration): the
    job's spec, its task, its tokenizer and its trainers and generators."""

    spec: JobSpec
    task: Task
    tok: Tokenizer
    actors: StepActors
