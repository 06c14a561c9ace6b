"""Asynchronous RL (``rollout.max_staleness`` = k >= 1): the generators produce the next batches
while the trainers train, so a step costs about max(generation, training) instead of their sum.

Policy versions: ``v_n`` is the weights after ``n`` optimizer steps; step ``s`` trains from
``v_{s-1}``, and every batch carries the version that generated it, so its lag when trained is
``(s - 1) - version``. The synchronous loop (``workers.rl_step.rl_step``, k = 0) trains every batch
at lag 0.

Weights change only between batches (veRL's one-step-off style, not PipelineRL's in-flight
updates): after step ``s`` the trainers publish ``v_s``, and each generator, running one call at a
time in order, receives it once the batches asked of it before are done; batches asked for after
the sync are generated with ``v_s``. So a sequence is never sampled by two policies.

Admission control (as AReaL and SkyRL): batch ``s`` is asked for only while the generators' newest
version ``v`` keeps it within the bound, ``(s - 1) - v <= k``; at most ``k + 1`` batches are in
flight. With one generator pool and a sync every step, k = 1 already overlaps every training with
the next generation; a larger k only adds slack (and lag). The trainer still checks each batch and
refuses one older than k (counted in ``staleness/dropped_batches``; it regenerates it with the
newest weights) as a last line of defence: dropping batches would starve slow, hard prompts and
bias the data, so admission is what keeps the bound.

Correction: the trainer's ``prev_logprobs`` come from the weights it trains from, so the IS weights
``exp(prev - gen)`` correct FP8 mismatch and lag together; ``mismatch/*`` measures both, and
``mismatch_lag0/*`` the same metrics over the lag-0 sequences only (FP8 alone), on the steps that
have any (the first after a start or resume, and batches regenerated after a refusal).

Resume: a checkpoint holds the trainers only; the batches in flight at a crash are lost and
regenerated after the resume, from the same prompts and seeds (functions of (seed, step)) but with
the checkpoint's weights, so each step is trained exactly once.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, cast

import torch

from rljob import metrics as m
from rljob.metrics import AsyncStepMetrics
from rljob.spec import JobSpec
from workers.algo.mismatch import mismatch_metrics
from workers.faults import ActorFault
from workers.rl_step import Batch, start_batch, train_and_sync
from workers.step_protocol import Generated, StepActors
from workers.tasks import Task
from workers.tokenizer import Tokenizer


def lag(step: int, version: int) -> int:
    """Policy versions between the weights that generated a batch and those step ``step`` trains
    from (``v_{step-1}``)."""
    return step - 1 - version


def busy_overlap(a: tuple[float, float], outs: list[Generated]) -> float:
    """Seconds of interval ``a`` during which some generator worked on ``outs``."""
    spans = sorted((o.started, o.finished) for o in outs)
    total, end = 0.0, a[0]
    for s, f in spans:  # the union of the spans, clipped to a
        s, f = max(s, end), min(f, a[1])
        if f > s:
            total += f - s
            end = f
    return total


class AsyncLoop:
    """The asynchronous steps of one run from ``first_step`` on, over actors whose generators hold
    ``v_{first_step-1}`` (synced before the first step)."""

    def __init__(
        self, spec: JobSpec, task: Task, tok: Tokenizer, actors: StepActors, first_step: int
    ) -> None:
        if spec.rollout.max_staleness < 1:
            raise ValueError("the asynchronous loop needs rollout.max_staleness >= 1")
        self.spec, self.task, self.tok, self.actors = spec, task, tok, actors
        self.k = spec.rollout.max_staleness
        self.version = first_step - 1  # the newest version the generators were sent
        self.next_step = first_step  # the next batch to ask for
        self.queue: deque[Batch] = deque()  # batches asked for, in step order
        self.dropped = 0  # batches refused as older than k, this run

    def admit(self) -> list[Batch]:
        """Ask for every batch the bound admits with the generators' newest weights; the new ones."""
        new = []
        while self.next_step <= self.spec.steps and lag(self.next_step, self.version) <= self.k:
            new.append(start_batch(self.spec, self.task, self.tok, self.actors, self.next_step, self.version))
            self.next_step += 1
        self.queue.extend(new)
        return new

    def step(self, step: int) -> AsyncStepMetrics:
        """Train step ``step`` on its batch (asked for earlier, or now) while the generators work on
        the next ones; then publish the new weights."""
        t0 = time.perf_counter()
        new = self.admit()
        batch = self.queue.popleft()
        if batch.step != step:
            raise RuntimeError(f"asynchronous loop out of order: step {step} got the batch of {batch.step}")
        outs = batch.pending.result()
        dropped = 0
        while lag(step, batch.version) > self.k:  # never train on it: regenerate with the newest weights
            dropped += 1
            batch = start_batch(self.spec, self.task, self.tok, self.actors, step, self.version)
            new.append(batch)
            outs = batch.pending.result()
        gen_s = max(o.finished for o in outs) - min(o.started for o in outs)
        done = train_and_sync(
            self.spec, self.task, self.tok, self.actors, step, batch.problems, outs, t0, gen_s
        )
        self.version = step  # the sync above sent v_step; the batches asked for so far are done
        self.dropped += dropped
        try:
            overlap = sum(busy_overlap(done.train_wall, b.pending.result()) for b in new if b is not batch)
        except ActorFault as fault:  # a generator lost on a later batch: this step is trained
            fault.after_training(done.row)
            raise

        lags = torch.full((len(batch.problems),), float(lag(step, batch.version)))  # [B] one version a batch
        row: dict[str, Any] = {
            **done.row,
            m.STALENESS_MEAN: float(lags.mean()),
            m.STALENESS_MAX: float(lags.max()),
            m.STALENESS_DROPPED: float(dropped),
            m.TIMING_OVERLAP_S: overlap,
        }
        fresh = lags == 0  # [B]
        if fresh.any():
            isc = self.spec.algorithm.importance_sampling
            rows = done.batch.response_mask * fresh[:, None]  # [B, L] the lag-0 sequences' tokens
            lag0 = mismatch_metrics(done.logp_old, done.batch.logprobs, rows, isc.low, isc.high, isc.mode)
            row.update({m.lag0_key(k): v for k, v in lag0.items()})
        return cast(AsyncStepMetrics, row)
