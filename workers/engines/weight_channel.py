"""The weight channel of a job that runs vLLM or Megatron-Core: an NCCL group of its own.

With the native engines, trainers and generators share one torch.distributed process group and
weights travel over it (:class:`~workers.weight_sync.BroadcastWeightSync`). That cannot work once
vLLM or Megatron is in the job:
- vLLM's workers live in processes vLLM starts; they cannot join an outside default group;
- Megatron-Core builds its tensor, pipeline and data-parallel groups from the default group, so
  that group must hold the trainers and nothing else.

So the weights go over a second, stateless group: vLLM's ``StatelessProcessGroup`` (a TCP store
for the rendezvous and small objects) plus ``PyNcclCommunicator`` (NCCL broadcasts on the GPU),
the pairing vLLM's own RLHF example uses. Rank 0 is trainer 0; each generator takes as many
consecutive ranks as it has receiving processes (one for the native generator, one per
tensor-parallel worker for vLLM). The wire format is the one of :mod:`workers.weight_sync`
(manifest, then uint8 buckets on the GPU), so the trainer's FP8 bytes arrive unchanged.

vLLM is imported when the channel opens, not before: ``import workers`` needs no vLLM. The
worker image has it (every engine needs it here, Megatron's trainer too).
"""

from __future__ import annotations

from typing import Any

import torch

from workers.weight_sync import DEFAULT_BUCKET_BYTES, CollectiveWeightSync


def split_address(address: str) -> tuple[str, int]:
    """``("10.0.0.1", 29500)`` from ``tcp://10.0.0.1:29500`` (or ``10.0.0.1:29500``)."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"weight channel address {address!r}: expected tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def channel_ranks(receivers_per_generator: int, generators: int) -> tuple[int, list[int]]:
    """``(world size, first rank of each generator)``: trainer 0 is rank 0, then each generator's
    receivers in order."""
    if receivers_per_generator < 1 or generators < 1:
        raise ValueError("a weight channel needs at least one generator with one receiver")
    firsts = [1 + i * receivers_per_generator for i in range(generators)]
    return 1 + generators * receivers_per_generator, firsts


class StatelessNcclWeightSync(CollectiveWeightSync):
    """One member of the weight channel (trainer 0 sends as rank 0; everyone else receives)."""

    def __init__(
        self,
        address: str,
        rank: int,
        world_size: int,
        device: torch.device | str = "cuda",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: int = 600,
    ) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(
                f"the NCCL weight channel needs a CUDA device, got {device}: vLLM and Megatron jobs run "
                "on GPUs (resources.gpus_per_generator and gpus_per_trainer >= 1)"
            )
        super().__init__(rank, device, bucket_bytes)
        self.address, self.world_size, self.timeout_s = address, world_size, timeout_s
        self.group: Any = None
        self.comm: Any = None

    def init_communicator(self) -> None:
        try:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
        except ImportError as err:
            raise RuntimeError(
                f"the weight channel of a vLLM/Megatron job needs vllm ({err}); run the job in the fp8rl "
                "GPU worker image (docker/worker.Dockerfile)"
            ) from err
        host, port = split_address(self.address)
        try:
            self.group = StatelessProcessGroup.create(
                host=host, port=port, rank=self.rank, world_size=self.world_size, store_timeout=self.timeout_s
            )
            self.comm = PyNcclCommunicator(self.group, device=self.device)
        except Exception as err:
            raise RuntimeError(
                f"weight channel: rank {self.rank}/{self.world_size} could not join {self.address} ({err}); "
                "check that trainer 0 and every generator started, that the address is reachable from "
                "all of them, and that the port is free"
            ) from err

    def _ready(self) -> bool:
        return self.comm is not None

    def _broadcast_obj(self, obj: Any) -> Any:
        return self.group.broadcast_obj(obj, src=self.src)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.comm.broadcast(tensor, src=self.src, stream=torch.cuda.current_stream(self.device))

    def shutdown(self) -> None:
        self.comm = None
        self.group = None
