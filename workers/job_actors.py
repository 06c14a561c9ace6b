"""The job's Ray actors: where each runs (``actor_options``), how they talk (``collective_backend``),
and :class:`JobActors`, the trainers and generators a driver starts, drives and kills.

``JobActors`` is the only code in the RL loop that knows Ray: it implements
:class:`~workers.step_actors.StepActors` over actor handles (``.remote`` / ``ray.get``), so
:mod:`workers.rl_step` orchestrates plain tensors and typed results. ("Cluster" means the Ray
cluster the actors run on: a local Ray, or the RayCluster of a KubeRay RayJob.)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from rljob.resource import RAY_GROUP_RESOURCES, RAY_GROUPS_ENV
from rljob.spec import JobSpec
from workers.engines.factory import uses_weight_channel, weight_receivers
from workers.engines.native.layer_diff import ExactMismatchError, Trace
from workers.engines.protocols import Rollouts, TrainStats
from workers.engines.weight_channel import channel_ranks
from workers.step_actors import Generated, WeightTransfer
from workers.tokenizer import Tokenizer


def actor_options(spec: JobSpec, role: str) -> dict[str, Any]:
    """Ray options of a generator or trainer actor. In a RayJob built by the operator
    (``FP8RL_RAY_GROUPS=1``) each also asks for its worker group's custom resource."""
    res = spec.resources
    gpus: float = res.gpus_per_generator if role == "generation" else res.gpus_per_trainer
    if res.share_gpu:  # every actor on the one GPU
        gpus = 1.0 / (res.trainers + res.generators)
    opts: dict[str, Any] = {"num_cpus": res.cpus_per_actor, "num_gpus": gpus}
    if os.environ.get(RAY_GROUPS_ENV) == "1":
        opts["resources"] = {RAY_GROUP_RESOURCES[role]: 1}
    return opts


def collective_backend(spec: JobSpec) -> str:
    """NCCL when every actor has GPUs of its own; gloo on CPUs and on a shared GPU (NCCL refuses
    two ranks on one device). Collectives always run on the tensors' own device."""
    res = spec.resources
    own_gpus = res.gpus_per_trainer > 0 and res.gpus_per_generator > 0 and not res.share_gpu
    return "nccl" if own_gpus else "gloo"


class JobActors:
    """The job's actors: trainers (ranks ``0..T-1`` of the job's process group) and generators
    (``T..T+G-1``), started and set up here (each builds its engine and joins the group), with
    the methods of :class:`~workers.step_actors.StepActors`. Each call sends one request to every
    actor it names at once and waits for all of them: what runs concurrently is what the method
    says."""

    def __init__(
        self, spec: JobSpec, vocab_size: int, tok: Tokenizer, max_prompt_tokens: int | None = None
    ) -> None:
        import ray

        from workers.actors import GeneratorWorker, TrainerWorker

        res = spec.resources
        t, g = res.trainers, res.generators
        world = t + g
        spec_json = spec.model_dump_json()
        trainer_cls: Any = ray.remote(**actor_options(spec, "training"))(TrainerWorker)
        gen_cls: Any = ray.remote(**actor_options(spec, "generation"))(GeneratorWorker)
        self._trainers: list[Any] = [trainer_cls.remote(spec_json, r, world, vocab_size) for r in range(t)]
        self._generators: list[Any] = [
            gen_cls.remote(spec_json, t + i, world, vocab_size, tok.eos_id, tok.pad_id, max_prompt_tokens)
            for i in range(g)
        ]
        backend = collective_backend(spec)
        address = ray.get(self._trainers[0].free_address.remote())
        audits = ray.get([a.setup.remote(address, backend) for a in self._all()])
        # the per-layer precision audits of trainer 0 and generator 0 (each with a printable "table")
        self.trainer_audit: dict[str, Any] = audits[0]
        self.generator_audit: dict[str, Any] = audits[t]
        if uses_weight_channel(spec):  # vLLM or Megatron: weights over an NCCL group of their own
            self._open_weight_channel(spec)
        # the weights the generators hold in FP8: what trainer 0 sends as FP8 data + scales
        self.fp8_names: list[str] = ray.get(self._generators[0].fp8_weight_names.remote())

    def _open_weight_channel(self, spec: JobSpec) -> None:
        """Open the NCCL weight channel of a vLLM/Megatron job: trainer 0 and every generator join
        at once (each waits for the others), after their setup."""
        import ray

        address = ray.get(self._trainers[0].free_address.remote())
        world_size, firsts = channel_ranks(weight_receivers(spec), len(self._generators))
        ray.get(
            [self._trainers[0].join_weight_channel.remote(address, world_size)]
            + [
                g.join_weight_channel.remote(address, first, world_size)
                for g, first in zip(self._generators, firsts, strict=True)
            ]
        )

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
        refs = [
            g.generate.remote(c, s, temperature)
            for g, c, s in zip(self._generators, chunks, seeds, strict=True)
            if c
        ]
        return RayPending(refs)

    def train(self, parts: list[Rollouts], rewards: list[torch.Tensor]) -> list[TrainStats]:
        """Trainer ``i`` updates on ``parts[i]``, the trainers in parallel. An actor's
        :class:`ExactMismatchError` comes back as itself (not Ray's wrapper), with its trainer."""
        refs = [t.train_step.remote(b, r) for t, b, r in zip(self._trainers, parts, rewards, strict=True)]
        return gather_train_results(refs)

    def sft_step(self, parts: list[Rollouts]) -> float:
        """Trainer ``i`` on ``parts[i]``, in parallel; every trainer returns the whole batch's loss."""
        import ray

        losses: list[float] = ray.get(
            [t.sft_step.remote(b) for t, b in zip(self._trainers, parts, strict=True)]
        )
        return losses[0]

    def trace_token(self, trainer: int, prompt: torch.Tensor, response: torch.Tensor) -> tuple[Trace, Trace]:
        """Generator 0's and trainer ``trainer``'s per-module outputs for one token, in parallel."""
        import ray

        gen = self._generators[0].trace_token.remote(prompt, response)
        train = self._trainers[trainer].trace_token.remote(prompt, response)
        gen_trace, train_trace = ray.get([gen, train])
        return gen_trace, train_trace

    def send_and_receive_weights(self) -> WeightTransfer:
        """Every trainer exports (trainer 0 sends) while every generator receives, all at once."""
        import ray

        send = [t.send_weights.remote(self.fp8_names) for t in self._trainers]
        recv = [g.receive_weights.remote() for g in self._generators]
        results = ray.get([*send, *recv])
        sent, received = results[0], results[len(send) :]
        return WeightTransfer(int(sent["bytes"]), sent["report"], [r["report"] for r in received])

    def save(self, directory: Path) -> None:
        """Every trainer in parallel (a sharded one gathers); trainer 0 writes ``trainer.pt``."""
        import ray

        ray.get([t.save.remote(str(directory)) for t in self._trainers])

    def load(self, directory: Path) -> None:
        """Every trainer loads ``trainer.pt`` from ``directory``, in parallel."""
        import ray

        ray.get([t.load.remote(str(directory)) for t in self._trainers])

    def shutdown(self) -> None:
        """Kill every actor (their engines and process groups go with them)."""
        import ray

        for a in self._all():
            ray.kill(a)

    def _all(self) -> list[Any]:
        return self._trainers + self._generators


class RayPending:
    """A generation in flight: the generators' object refs, collected by one blocking ``ray.get``."""

    def __init__(self, refs: list[Any]) -> None:
        self._refs = refs
        self._out: list[Generated] | None = None

    def result(self) -> list[Generated]:
        import ray

        if self._out is None:
            self._out = ray.get(self._refs)
        return self._out


def gather_train_results(refs: list[Any]) -> list[TrainStats]:
    """The trainers' results (``refs[i]``: trainer ``i``'s). When one raised
    :class:`ExactMismatchError` on a row of its own, that error is raised (Ray wraps it; the
    original is the wrapper's cause) with ``trainer_index`` set; any other failure as Ray raised it."""
    import ray

    try:
        out: list[TrainStats] = ray.get(refs)
        return out
    except Exception as err:
        for i, e in enumerate(_exact_errors(refs)):
            if e is not None and e.row >= 0:
                raise ExactMismatchError(e.row, e.position, e.trainer, e.generator).on_trainer(i) from err
        raise


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


def ray_init(spec: JobSpec, address: str | None = None) -> bool:
    """Start a local Ray (or join ``address``, else ``RAY_ADDRESS``); True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        res = spec.resources
        need = (res.trainers + res.generators) * res.cpus_per_actor
        ray.init(
            num_cpus=max(int(need + 0.999), os.cpu_count() or 1),
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    return True


def ray_shutdown() -> None:
    """Stop the Ray that :func:`ray_init` started."""
    import ray

    ray.shutdown()
