"""How a job's weights travel from trainer 0 to the generators: chosen here, once per job, from its
engines (:func:`uses_weight_channel`), and set up here for each actor.

- **Native generator and trainer**: the job's torch.distributed process group holds trainers
  ``0..T-1`` and generators ``T..T+G-1``; the weights are broadcast over a group of trainer 0 and
  every generator (:class:`~workers.weight_sync.broadcast.BroadcastWeightSync`). With ``T > 1`` the
  trainers also form a data-parallel group for the gradient all-reduce.
- **vLLM or Megatron-Core in the job**: the process group holds the trainers only (Megatron builds
  its parallel groups from it; vLLM's workers cannot join an outside group), and the weights take
  the stateless weight channel (:mod:`workers.weight_sync.channel`), which trainer 0 and every
  generator open after their setup: trainer 0 as its sender (:func:`open_sender`), each generator
  inside its engine (one rank per vLLM tensor-parallel worker: :func:`weight_receivers`).

The actors (:mod:`workers.job.ray_workers`) and their group (:mod:`workers.job.actor_group`) call these
functions; none of them decides the transport itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rljob.spec import JobSpec
from workers.weight_sync.broadcast import BroadcastWeightSync, CollectiveWeightSync
from workers.weight_sync.data import Payload, SyncResult


def uses_weight_channel(spec: JobSpec) -> bool:
    """True when weights travel over the weight channel: whenever vLLM or Megatron-Core is in the
    job. The native pair shares the job's process group."""
    res = spec.resources
    return res.generator_engine != "native" or res.trainer_engine != "native"


def weight_receivers(spec: JobSpec) -> int:
    """Ranks one generator takes in the weight channel: one per vLLM tensor-parallel worker."""
    res = spec.resources
    return res.generator_tensor_parallel_size if res.generator_engine == "vllm" else 1


@dataclass
class Joined:
    """One actor's place in the job's groups after :func:`join`: the broadcast it sends or receives
    weights over (None with the weight channel), and its data-parallel group (trainers with more
    than one trainer in the job; else None)."""

    sync: CollectiveWeightSync | None
    dp_group: Any


def join(spec: JobSpec, rank: int, world_size: int, init_method: str, backend: str) -> Joined:
    """Join the job's process group as ``rank`` of ``world_size`` (trainers first), the way the
    job's transport needs (module docstring)."""
    import torch.distributed as dist

    trainers = spec.resources.trainers
    world = list(range(world_size))
    if uses_weight_channel(spec):  # the trainers' own group (Megatron's world); weights take the channel
        if rank >= trainers:
            return Joined(None, None)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=trainers)
        return Joined(None, dist.group.WORLD if trainers > 1 else None)
    sync_ranks = None if trainers == 1 else [0, *world[trainers:]]
    sync = BroadcastWeightSync(rank, world_size, init_method, backend, ranks=sync_ranks)
    sync.init_communicator()
    dp_group = None
    if trainers > 1:  # every rank must take part in creating every group
        group = dist.new_group(world[:trainers])
        dp_group = group if rank < trainers else None
    return Joined(sync, dp_group)


def open_sender(address: str, world_size: int, device: torch.device | str) -> CollectiveWeightSync:
    """Trainer 0's end of the weight channel (rank 0 of ``world_size``), once every actor is set up."""
    from workers.weight_sync.channel import WeightChannel

    channel = WeightChannel(address, 0, world_size, device)
    channel.init_communicator()
    return channel


class Receiver(Protocol):
    """What a generator engine offers the transport: a load of a received payload (the broadcast)
    and a receive into its own model (the weight channel, which the engine joined itself)."""

    def load_weights(self, payload: Payload) -> None: ...

    def receive_weights(self) -> SyncResult: ...


def receive(engine: Receiver, sync: CollectiveWeightSync | None) -> SyncResult:
    """Receive one version into ``engine``: over ``sync`` (the native pair's broadcast, then
    loaded), or, without one, over the weight channel the engine holds."""
    if sync is None:
        return engine.receive_weights()
    result = sync.sync_weights(None)
    if result.payload is None:
        raise RuntimeError("weight sync: the broadcast delivered no payload to a receiving rank")
    engine.load_weights(result.payload)
    return result
