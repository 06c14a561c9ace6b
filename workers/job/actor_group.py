"""The job's actor group, :class:`JobActors`: the trainers and generators a driver starts, drives
and kills (where each runs and how they talk: :mod:`workers.job.ray_cluster`).

``JobActors`` is the only code in the RL loop that knows Ray: it implements
:class:`~workers.rl.protocol.StepActors` over actor handles (``.remote`` / ``ray.get``), so
:mod:`workers.rl.step` orchestrates plain tensors and typed results. ("Cluster" means the Ray
cluster the actors run on: a local Ray, or the RayCluster of a KubeRay RayJob.)
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import Any

import torch

from rljob.spec import JobSpec
from workers.engines.layer_diff import ExactMismatchError, Trace
from workers.engines.protocols import Rollouts, TrainStats
from workers.job.ray_cluster import actor_options, collective_backend
from workers.models.tokenizer import Tokenizer
from workers.rl.faults import ActorFault, CallTimeouts, Role, first_line, is_engine_failure
from workers.rl.protocol import Generated, WeightTransfer
from workers.weight_sync.channel import channel_ranks
from workers.weight_sync.transport import uses_weight_channel, weight_receivers


class JobActors:
    """The job's actors: trainers (ranks ``0..T-1`` of the job's process group) and generators
    (``T..T+G-1``), started and set up here (each builds its engine and joins the group), with
    the methods of :class:`~workers.rl.protocol.StepActors`. Each call sends one request to every
    actor it names at once and waits for all of them: what runs concurrently is what the method
    says."""

    def __init__(
        self,
        spec: JobSpec,
        vocab_size: int,
        tok: Tokenizer,
        max_prompt_tokens: int | None = None,
        timeouts: CallTimeouts | None = None,
    ) -> None:
        import ray

        from workers.job.ray_workers import GeneratorWorker, TrainerWorker

        res = spec.resources
        t, g = res.trainers, res.generators
        world = t + g
        # the calls' bounds (workers.rl.faults); actors started after a fault keep the job's history
        self.timeouts = timeouts or CallTimeouts(res.hang_timeout_s, res.startup_timeout_s)
        self._outstanding: list[tuple[Role, int, str, float, Any]] = []  # (role, index, kind, sent, ref)
        spec_json = spec.model_dump_json()
        trainer_cls: Any = ray.remote(**actor_options(spec, "training"))(TrainerWorker)
        gen_cls: Any = ray.remote(**actor_options(spec, "generation"))(GeneratorWorker)
        self._trainers: list[Any] = [trainer_cls.remote(spec_json, r, world, vocab_size) for r in range(t)]
        self._generators: list[Any] = [
            gen_cls.remote(
                spec_json, t + i, world, vocab_size, list(tok.eos_ids), tok.pad_id, max_prompt_tokens
            )
            for i in range(g)
        ]
        backend = collective_backend(spec)
        address = self._gather("free_address", [("trainer", 0, self._trainers[0].free_address.remote())])[0]
        audits = self._gather("setup", self._each("setup", address, backend))
        # the per-layer precision audits of trainer 0 and generator 0 (each with a printable "table")
        self.trainer_audit: dict[str, Any] = audits[0]
        self.generator_audit: dict[str, Any] = audits[t]
        if uses_weight_channel(spec):  # vLLM or Megatron: weights over an NCCL group of their own
            self._open_weight_channel(spec)
        # the weights the generators hold in FP8: what trainer 0 sends as FP8 data + scales
        self.fp8_names: list[str] = self._gather(
            "fp8_weight_names", [("generator", 0, self._generators[0].fp8_weight_names.remote())]
        )[0]

    def _open_weight_channel(self, spec: JobSpec) -> None:
        """Open the NCCL weight channel of a vLLM/Megatron job: trainer 0 and every generator join
        at once (each waits for the others), after their setup."""
        address = self._gather("free_address", [("trainer", 0, self._trainers[0].free_address.remote())])[0]
        world_size, firsts = channel_ranks(weight_receivers(spec), len(self._generators))
        calls: list[Call] = [
            ("trainer", 0, self._trainers[0].join_weight_channel.remote(address, world_size))
        ]
        for i, (g, first) in enumerate(zip(self._generators, firsts, strict=True)):
            calls.append(("generator", i, g.join_weight_channel.remote(address, first, world_size)))
        self._gather("join_weight_channel", calls)

    @property
    def num_trainers(self) -> int:
        return len(self._trainers)

    @property
    def num_generators(self) -> int:
        return len(self._generators)

    def generate(
        self, chunks: list[list[list[int]]], seeds: list[int], temperature: float | None = None
    ) -> list[Generated]:
        """Generator ``i`` on ``chunks[i]`` with ``seeds[i]``, all generators in parallel;
        one result per non-empty chunk, in chunk order."""
        return self.start_generate(chunks, seeds, temperature).result()

    def start_generate(
        self, chunks: list[list[list[int]]], seeds: list[int], temperature: float | None = None
    ) -> RayPending:
        """:meth:`generate` sent now (each generator actor queues it behind its earlier calls),
        collected by ``.result()``."""
        calls: list[Call] = [
            ("generator", i, g.generate.remote(c, s, temperature))
            for i, (g, c, s) in enumerate(zip(self._generators, chunks, seeds, strict=True))
            if c
        ]
        return RayPending(self, "generate", calls)

    def train(self, parts: list[Rollouts], rewards: list[torch.Tensor]) -> list[TrainStats]:
        """Trainer ``i`` updates on ``parts[i]``, the trainers in parallel. An actor's
        :class:`ExactMismatchError` comes back as itself (not Ray's wrapper), with its trainer."""
        calls: list[Call] = [
            ("trainer", i, t.train_step.remote(b, r))
            for i, (t, b, r) in enumerate(zip(self._trainers, parts, rewards, strict=True))
        ]
        try:
            out: list[TrainStats] = self._gather("train_step", calls)
            return out
        except ActorFault:
            raise
        except Exception as err:
            raise_exact_mismatch([ref for _, _, ref in calls], err)
            raise

    def sft_step(self, parts: list[Rollouts]) -> float:
        """Trainer ``i`` on ``parts[i]``, in parallel; every trainer returns the whole batch's loss."""
        calls: list[Call] = [
            ("trainer", i, t.sft_step.remote(b))
            for i, (t, b) in enumerate(zip(self._trainers, parts, strict=True))
        ]
        losses: list[float] = self._gather("sft_step", calls)
        return losses[0]

    def calibrate_kv(self, parts: list[Rollouts]) -> None:
        """Trainer ``i`` calibrates K/V-cache scales on ``parts[i]``, in parallel (they max-reduce)."""
        calls: list[Call] = [
            ("trainer", i, t.calibrate_kv.remote(b))
            for i, (t, b) in enumerate(zip(self._trainers, parts, strict=True))
        ]
        self._gather("calibrate_kv", calls)

    def trace_token(self, trainer: int, prompt: torch.Tensor, response: torch.Tensor) -> tuple[Trace, Trace]:
        """Generator 0's and trainer ``trainer``'s per-module outputs for one token, in parallel."""
        gen = self._generators[0].trace_token.remote(prompt, response)
        train = self._trainers[trainer].trace_token.remote(prompt, response)
        gen_trace, train_trace = self._gather(
            "trace_token", [("generator", 0, gen), ("trainer", trainer, train)]
        )
        return gen_trace, train_trace

    def send_and_receive_weights(self) -> WeightTransfer:
        """Every trainer exports (trainer 0 sends) while every generator receives, all at once."""
        send: list[Call] = [
            ("trainer", i, t.send_weights.remote(self.fp8_names)) for i, t in enumerate(self._trainers)
        ]
        recv: list[Call] = [
            ("generator", i, g.receive_weights.remote()) for i, g in enumerate(self._generators)
        ]
        results = self._gather("weight_sync", send + recv)
        sent, received = results[0], results[len(send) :]
        return WeightTransfer(int(sent["bytes"]), sent["report"], [r["report"] for r in received])

    def save(self, directory: Path, hang_bound: bool = False) -> None:
        """Every trainer in parallel (a sharded one gathers); trainer 0 writes ``trainer.pt``.
        ``hang_bound``: wait no longer than ``resources.hang_timeout_s`` (a snapshot after a fault,
        which must not wait an hour for a trainer stuck in a collective with the lost actor)."""
        calls: list[Call] = [
            ("trainer", i, t.save.remote(str(directory))) for i, t in enumerate(self._trainers)
        ]
        self._gather("save", calls, bound=self.timeouts.floor_s if hang_bound else None)

    def load(self, directory: Path) -> None:
        """Every trainer loads ``trainer.pt`` from ``directory``, in parallel."""
        self._gather(
            "load", [("trainer", i, t.load.remote(str(directory))) for i, t in enumerate(self._trainers)]
        )

    def arm(self, role: Role, index: int, kind: str) -> None:
        """Arm a fault drill (:class:`~workers.rl.faults.FaultDrill`): actor ``role`` ``index`` provokes
        ``kind`` inside its next ``generate`` (a generator) or ``train_step`` (a trainer)."""
        actor = (self._generators if role == "generator" else self._trainers)[index]
        self._gather("arm_fault", [(role, index, actor.arm_fault.remote(kind))])

    def shutdown(self) -> None:
        """Kill every actor (their engines and process groups go with them); a dead one is skipped."""
        import ray

        for a in self._all():
            with contextlib.suppress(Exception):  # already gone: nothing to kill
                ray.kill(a)

    def _all(self) -> list[Any]:
        return self._trainers + self._generators

    def _each(self, method: str, *args: Any) -> list[Call]:
        """``method(*args)`` sent to every actor, trainers first."""
        roles: list[tuple[Role, list[Any]]] = [("trainer", self._trainers), ("generator", self._generators)]
        return [
            (role, i, getattr(a, method).remote(*args)) for role, group in roles for i, a in enumerate(group)
        ]

    def kill(self, role: Role, index: int) -> None:
        """Kill one actor (a lost one, before the others are asked for anything: its partners in
        a collective then fail instead of waiting for it)."""
        import ray

        with contextlib.suppress(Exception):  # already gone
            ray.kill((self._generators if role == "generator" else self._trainers)[index])

    def _sent(self, kind: str, calls: list[Call], started: float) -> None:
        """Note calls as sent at ``started``, for :meth:`_hung` (answered ones are forgotten there)."""
        self._outstanding.extend((role, index, kind, started, ref) for role, index, ref in calls)

    def _hung(self, pending: list[Call], bound: float, kind: str) -> ActorFault:
        """The fault when ``pending`` calls passed their bound: of the actors they went to, the one
        busy longest, with the call it is busy with. An actor runs its calls in order, so that is
        its oldest unanswered call: a generator stuck in a generation, not the trainer that waits
        for it in the weight sync sent later."""
        import ray

        refs = [ref for *_, ref in self._outstanding]
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        self._outstanding = [c for c in self._outstanding if c[-1] not in done]
        actors = {(role, index) for role, index, _ in pending}
        busy = [c for c in self._outstanding if (c[0], c[1]) in actors]
        if not busy:
            role, index, _ = pending[0]
            return ActorFault(role, index, f"gave no answer within {bound:.0f} s (hung)", kind)
        role, index, call, since, _ = min(busy, key=lambda c: c[3])
        waited = time.monotonic() - since
        return ActorFault(role, index, f"gave no answer for {waited:.0f} s (hung; bound {bound:.0f} s)", call)

    def _gather(
        self, kind: str, calls: list[Call], started: float | None = None, bound: float | None = None
    ) -> list[Any]:
        """The results of ``calls`` (one per actor) in order, each fetched once as it arrives. A
        lost actor becomes an :class:`~workers.rl.faults.ActorFault`: one that died or whose engine
        failed (after a short grace in which its partners in a collective fail too, so that the
        cause is named, not a partner's error), or one that gave no answer within the bound of
        ``kind`` (:class:`~workers.rl.faults.CallTimeouts`, or ``bound`` seconds when given), counted
        from ``started`` (monotonic seconds). Any other error is raised as the actor raised it."""
        import ray

        if started is None:
            started = time.monotonic()
            self._sent(kind, calls, started)
        bound = self.timeouts.bound(kind) if bound is None else bound
        position = {ref: i for i, (_, _, ref) in enumerate(calls)}
        values: dict[int, Any] = {}
        errors: dict[int, Exception] = {}
        pending = [ref for _, _, ref in calls]
        while pending and not errors:
            left = bound - (time.monotonic() - started)
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0.0))
            if not ready:  # the bound passed with these calls unanswered
                raise self._hung([calls[position[ref]] for ref in pending], bound, kind)
            _fetch(ready[0], position[ready[0]], values, errors)
            if errors and pending:  # a dead peer fails its partners' collectives: let them report
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=FAULT_GRACE_S)
                for ref in ready:
                    _fetch(ref, position[ref], values, errors)
        if errors:
            fault = classify(kind, calls, errors)
            first = errors[min(errors)]
            if fault is not None:
                raise fault from first
            raise first
        self.timeouts.record(kind, time.monotonic() - started)
        answered = set(position)
        self._outstanding = [c for c in self._outstanding if c[-1] not in answered]
        return [values[i] for i in range(len(calls))]


Call = tuple[Role, int, Any]  # (role, index, the object ref of its call)
FAULT_GRACE_S = 5.0  # after one call of a collective fails, how long its partners may take to fail


def _fetch(ref: Any, i: int, values: dict[int, Any], errors: dict[int, Exception]) -> None:
    import ray

    try:
        values[i] = ray.get(ref)
    except Exception as err:  # sorted out by classify
        errors[i] = err


def classify(kind: str, calls: list[Call], errors: dict[int, Exception]) -> ActorFault | None:
    """The fault behind the ``errors`` of ``calls`` (by position), or None when none is a fault.
    A dead actor names it before an engine failure does, and a trainer before a generator (its
    loss costs more to recover)."""
    from ray.exceptions import RayActorError

    def rank(i: int) -> tuple[int, int]:
        return (0 if isinstance(errors[i], RayActorError) else 1, 0 if calls[i][0] == "trainer" else 1)

    for i in sorted(errors, key=rank):
        err, (role, index, _) = errors[i], calls[i]
        if isinstance(err, RayActorError):
            pid = re.search(r"pid: (\d+)", str(err))
            where = f"process {pid.group(1)}" if pid else "its process"
            return ActorFault(role, index, f"died ({where} exited: killed, out of memory or crashed)", kind)
        if is_engine_failure(err):
            cause = getattr(err, "cause", None) or err
            return ActorFault(role, index, f"failed ({type(cause).__name__}: {first_line(cause)})", kind)
    return None


class RayPending:
    """A generation in flight: the generators' calls, collected (and bounded from when they were
    sent) by :meth:`JobActors._gather`."""

    def __init__(self, actors: JobActors, kind: str, calls: list[Call]) -> None:
        self._actors, self._kind, self._calls = actors, kind, calls
        self._started = time.monotonic()
        actors._sent(kind, calls, self._started)
        self._out: list[Generated] | None = None

    def result(self) -> list[Generated]:
        if self._out is None:
            self._out = self._actors._gather(self._kind, self._calls, self._started)
        return self._out


def raise_exact_mismatch(refs: list[Any], err: Exception) -> None:
    """When trainer ``i`` (``refs[i]``) raised :class:`ExactMismatchError` on a row of its own,
    raise it (Ray wraps it; the original is the wrapper's cause) with ``trainer_index`` set;
    otherwise return, and the caller raises ``err``."""
    for i, e in enumerate(_exact_errors(refs)):
        if e is not None and e.row >= 0:
            raise ExactMismatchError(e.row, e.position, e.trainer, e.generator).on_trainer(i) from err


def _exact_errors(refs: list[Any]) -> list[ExactMismatchError | None]:
    """Each trainer's :class:`ExactMismatchError` (from Ray's wrapper), or None."""
    import ray

    out: list[ExactMismatchError | None] = []
    for ref in refs:
        try:
            ray.get(ref)
            out.append(None)
        except Exception as err:  # Ray wraps the actor's exception; the original is its cause
            cause = err if isinstance(err, ExactMismatchError) else getattr(err, "cause", None)
            out.append(cause if isinstance(cause, ExactMismatchError) else None)
    return out
