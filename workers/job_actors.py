"""The job's Ray actors: where each runs (``actor_options``), how they talk (``collective_backend``),
and the ``Cluster`` of trainers and generators a driver starts, sets up and kills."""

from __future__ import annotations

import logging
import os
from typing import Any

from rljob.resource import RAY_GROUP_RESOURCES, RAY_GROUPS_ENV
from rljob.spec import JobSpec
from workers.engines.factory import uses_weight_channel
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


class Cluster:
    """The job's actors: trainers (ranks 0..T-1) and generators."""

    def __init__(
        self, spec: JobSpec, vocab_size: int, tok: Tokenizer, max_prompt_tokens: int | None = None
    ) -> None:
        import ray

        from workers.actors import GeneratorWorker, TrainerWorker, open_weight_channel

        res = spec.resources
        t, g = res.trainers, res.generators
        world = t + g
        spec_json = spec.model_dump_json()
        trainer_cls: Any = ray.remote(**actor_options(spec, "training"))(TrainerWorker)
        gen_cls: Any = ray.remote(**actor_options(spec, "generation"))(GeneratorWorker)
        self.trainers: list[Any] = [trainer_cls.remote(spec_json, r, world, vocab_size) for r in range(t)]
        self.generators: list[Any] = [
            gen_cls.remote(spec_json, t + i, world, vocab_size, tok.eos_id, tok.pad_id, max_prompt_tokens)
            for i in range(g)
        ]
        backend = collective_backend(spec)
        address = ray.get(self.trainers[0].free_address.remote())
        audits = ray.get([a.setup.remote(address, backend) for a in self.all()])
        self.trainer_audit, self.generator_audit = audits[0], audits[t]
        if uses_weight_channel(spec):  # vLLM or Megatron: weights over an NCCL group of their own
            open_weight_channel(spec, self.trainers[0], self.generators)
        self.fp8_names: list[str] = ray.get(self.generators[0].fp8_weight_names.remote())

    def all(self) -> list[Any]:
        return self.trainers + self.generators

    def shutdown(self) -> None:
        import ray

        for a in self.all():
            ray.kill(a)


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
