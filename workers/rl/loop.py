"""The RL loop: the steps of a run, synchronous (``rollout.max_staleness`` = k = 0) or
asynchronous (k >= 1: the generators produce the next batches while the trainers train, so a step
costs about max(generation, training) instead of their sum). Synchronous RL is the k = 0 case of
the same code: batch ``s`` is asked for only once ``v_{s-1}`` is synced, so nothing overlaps, every
batch is trained at lag 0, and the rows hold no ``staleness/*``, ``mismatch_lag0/*`` or
``timing/overlap_s`` keys (they would all repeat what the row says).

Each step ends in a :class:`StepOutcome`: its line once trained and synced, or the actor fault
that ended it with the line as far as the step got (trained or not): the recovery
(:meth:`workers.job.job_run.JobRun.recover`) goes on from that, so a trained step is never trained
twice.

Policy versions: ``v_n`` is the weights after ``n`` optimizer steps; step ``s`` trains from
``v_{s-1}``, and every batch carries the version that generated it, so its lag when trained is
``(s - 1) - version``.

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
from typing import Any, NamedTuple, cast

import torch

from rljob import metrics as m
from rljob.metrics import AsyncStepMetrics
from workers.algo.mismatch import mismatch_metrics
from workers.rl.attribution import Probe, probes_of, traceable
from workers.rl.faults import ActorFault
from workers.rl.protocol import Generated, StepContext
from workers.rl.step import Batch, start_batch, train_and_sync


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


class StepOutcome(NamedTuple):
    """How a step of :class:`RlLoop` ended: trained and synced (``fault`` None, ``row`` its line),
    or cut short by ``fault``, with ``row`` the step's line as far as it got (None: not trained;
    else trained, and synced unless the fault hit the sync)."""

    step: int
    row: AsyncStepMetrics | None
    fault: ActorFault | None = None
    probes: tuple[Probe, ...] = ()  # the step's tokens to trace for the per-layer attribution


class RlLoop:
    """The steps of one run from ``first_step`` on (``rollout.max_staleness`` k >= 0), over actors
    whose generators hold ``v_{first_step-1}`` (synced before the first step). After a fault, a
    new loop starts from the step to go on with: the batches in flight are lost."""

    def __init__(self, ctx: StepContext, first_step: int) -> None:
        self.ctx = ctx
        self.k = ctx.spec.rollout.max_staleness
        self.version = first_step - 1  # the newest version the generators were sent
        self.next_step = first_step  # the next batch to ask for
        self.queue: deque[Batch] = deque()  # batches asked for, in step order
        self.dropped = 0  # batches refused as older than k, this run

    def admit(self) -> list[Batch]:
        """Ask for every batch the bound admits with the generators' newest weights; the new ones."""
        new = []
        while self.next_step <= self.ctx.spec.steps and lag(self.next_step, self.version) <= self.k:
            new.append(start_batch(self.ctx, self.next_step, self.version))
            self.next_step += 1
        self.queue.extend(new)
        return new

    def step(self, step: int) -> StepOutcome:
        """Train step ``step`` on its batch (asked for earlier, or now) while the generators work on
        the next ones (k >= 1); then publish the new weights. An actor fault on the way is returned,
        not raised."""
        try:
            return self._step(step)
        except ActorFault as fault:  # before the update: the step is not trained
            return StepOutcome(step, None, fault)

    def _step(self, step: int) -> StepOutcome:
        t0 = time.perf_counter()
        new = self.admit()
        batch = self.queue.popleft()
        if batch.step != step:
            raise RuntimeError(f"RL loop out of order: step {step} got the batch of {batch.step}")
        outs = batch.pending.result()
        dropped = 0
        while lag(step, batch.version) > self.k:  # never train on it: regenerate with the newest weights
            dropped += 1
            batch = start_batch(self.ctx, step, self.version)
            new.append(batch)
            outs = batch.pending.result()
        # k = 0: the time the step waited for its rollouts; k >= 1: the generators' busy span
        gen_s = (
            time.perf_counter() - t0
            if self.k == 0
            else max(o.finished for o in outs) - min(o.started for o in outs)
        )
        done = train_and_sync(self.ctx, step, batch.problems, outs, t0, gen_s)
        if done.fault is not None:  # trained, not synced
            return StepOutcome(step, cast(AsyncStepMetrics, done.row), done.fault)
        self.version = step  # the sync above sent v_step; the batches asked for so far are done
        self.dropped += dropped
        slo = self.ctx.spec.precision.mismatch_slo
        wanted = slo.attribution_interval > 0 or slo.action == "respond"  # bf16-layers needs it
        traced = wanted and traceable(self.ctx.spec)
        probes = probes_of(done.batch, done.logp_old, slo.attribution_sequences) if traced else ()
        if self.k == 0:
            return StepOutcome(step, cast(AsyncStepMetrics, done.row), probes=probes)
        try:
            overlap = sum(busy_overlap(done.train_wall, b.pending.result()) for b in new if b is not batch)
        except ActorFault as fault:  # a generator lost on a later batch: this step is trained
            return StepOutcome(step, cast(AsyncStepMetrics, done.row), fault)

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
            isc = self.ctx.spec.algorithm.importance_sampling
            rows = done.batch.response_mask * fresh[:, None]  # [B, L] the lag-0 sequences' tokens
            lag0 = mismatch_metrics(done.logp_old, done.batch.logprobs, rows, isc.low, isc.high, isc.mode)
            row.update({m.lag0_key(k): v for k, v in lag0.items()})
        return StepOutcome(step, cast(AsyncStepMetrics, row), probes=probes)
