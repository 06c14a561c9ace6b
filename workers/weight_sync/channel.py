"""The weight channel of a job that runs vLLM or Megatron-Core: a process group of its own.

With the native engines, trainers and generators share one torch.distributed process group and
weights travel over it (:class:`~workers.weight_sync.BroadcastWeightSync`). That cannot work once
vLLM or Megatron is in the job:
- vLLM's workers live in processes vLLM starts, which already hold a default process group of
  vLLM's own (their tensor-parallel world); they cannot join an outside one;
- Megatron-Core builds its tensor, pipeline and data-parallel groups from the default group, so
  that group must hold the trainers and nothing else.

So the weights go over a second, *stateless* group that touches no default group, whichever
process opens it (a Ray actor, a vLLM worker). :class:`WeightChannel` picks the transport from
the device its buckets live on:
- CUDA: vLLM's ``StatelessProcessGroup`` (a TCP store for the rendezvous and small objects) plus
  ``PyNcclCommunicator`` (NCCL broadcasts on the GPU), the pairing vLLM's own RLHF example uses;
- CPU: a ``torch.distributed.TCPStore`` for the rendezvous and a ``ProcessGroupGloo`` built on it
  directly (what ``init_process_group`` builds, minus the global state); small objects travel as
  pickled bytes in a uint8 tensor after their length.

Rank 0 is trainer 0, which also hosts the TCP store at the channel's address; each generator
takes as many consecutive ranks as it has receiving processes (one for the native generator, one
per tensor-parallel worker for vLLM). The wire format is the one of :mod:`workers.weight_sync.broadcast`
(manifest, then uint8 buckets), so the trainer's FP8 bytes arrive unchanged. Every member of one
channel must use the same transport: trainer 0 and the generators' receivers all on GPUs, or all
on CPUs (a receiver on a GPU can take the CPU transport: ``device="cpu"``).

vLLM is imported when a CUDA channel opens, not before: ``import workers`` needs no vLLM.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch._C._distributed_c10d import TCPStore
from torch.distributed.distributed_c10d import PrefixStore, ProcessGroupGloo

from workers.weight_sync.broadcast import DEFAULT_BUCKET_BYTES, CollectiveWeightSync
from workers.weight_sync.data import Payload, SyncResult

STORE_PREFIX = "fp8rl-weight-channel"  # keys of the channel in its TCP store


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


class _Transport(Protocol):
    def broadcast_obj(self, obj: Any, src: int) -> Any: ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...


class _GlooTransport:
    """CPU: gloo over a TCP store of the channel's own (rank 0 hosts it)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        # wait_for_workers=False: the gloo rendezvous below waits for every rank (with `timeout`)
        self.store = TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
        # a ProcessGroupGloo: its collectives are missing from torch's type stubs
        self.group: Any = ProcessGroupGloo(PrefixStore(STORE_PREFIX, self.store), rank, world_size, timeout)
        self.rank = rank

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        """``obj`` of rank ``src`` on every rank: its length (int64), then its pickled bytes."""
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)  # [n]
            length = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self.broadcast(length, src)
        if self.rank != src:
            data = torch.empty(int(length.item()), dtype=torch.uint8)
        self.broadcast(data, src)
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.group.broadcast(tensor, src).wait()


class _NcclTransport:
    """CUDA: vLLM's stateless group (TCP store, small objects) and its NCCL communicator."""

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, timeout_s: float, device: torch.device
    ) -> None:
        try:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
        except ImportError as err:
            raise RuntimeError(
                f"the weight channel on GPUs needs vllm's NCCL wrapper ({err}); run the job in the fp8rl "
                "GPU worker image (docker/worker.Dockerfile)"
            ) from err
        self.group = StatelessProcessGroup.create(
            host=host, port=port, rank=rank, world_size=world_size, store_timeout=int(timeout_s)
        )
        self.comm = PyNcclCommunicator(self.group, device=device)
        self.device = device

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        return self.group.broadcast_obj(obj, src=src)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.comm.broadcast(tensor, src=src, stream=torch.cuda.current_stream(self.device))


class WeightChannel(CollectiveWeightSync):
    """One member of the weight channel (trainer 0 sends as rank 0; everyone else receives).

    ``device``: where the buckets live, which picks the transport (CUDA: NCCL; CPU: gloo). A
    receiver gets the payload on that device.
    """

    def __init__(
        self,
        address: str,
        rank: int,
        world_size: int,
        device: torch.device | str = "cpu",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 600.0,
    ) -> None:
        device = torch.device(device)
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"the weight channel runs on CUDA (NCCL) or CPU (gloo) devices, got {device}")
        if not 0 <= rank < world_size:
            raise ValueError(f"weight channel: rank {rank} is outside world size {world_size}")
        split_address(address)  # refuse a malformed address here, not in the rendezvous
        super().__init__(rank, device, bucket_bytes)
        self.address, self.world_size, self.timeout_s = address, world_size, timeout_s
        self.transport: _Transport | None = None

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def _where(self) -> str:
        return f"weight channel ({self.backend}): rank {self.rank} of {self.world_size} at {self.address}"

    def init_communicator(self) -> None:
        """Join the channel; returns once every rank has joined (each waits up to ``timeout_s``)."""
        host, port = split_address(self.address)
        try:
            if self.device.type == "cuda":
                self.transport = _NcclTransport(
                    host, port, self.rank, self.world_size, self.timeout_s, self.device
                )
            else:
                self.transport = _GlooTransport(host, port, self.rank, self.world_size, self.timeout_s)
        except Exception as err:
            role = "hosts the rendezvous (is the port free?)" if self.rank == 0 else "could not join"
            raise RuntimeError(
                f"{self._where()} {role}: {err}. Check that trainer 0 (rank 0, which hosts "
                f"{self.address}) and every generator started and joined within {self.timeout_s:.0f} s, "
                "that the address is reachable from all of them, and that every member runs on the same "
                "kind of device (all GPUs: NCCL, or all CPUs: gloo)"
            ) from err

    def sync_weights(self, payload: Payload | None = None) -> SyncResult:
        if self.transport is None:
            raise RuntimeError(f"{self._where()}: call init_communicator() first")
        return super().sync_weights(payload)

    def _ready(self) -> bool:
        return self.transport is not None

    def _broadcast_obj(self, obj: Any) -> Any:
        assert self.transport is not None
        try:
            return self.transport.broadcast_obj(obj, self.src)
        except (RuntimeError, OSError) as err:
            raise self._failed(err) from err

    def _broadcast(self, tensor: torch.Tensor) -> None:
        assert self.transport is not None
        try:
            self.transport.broadcast(tensor, self.src)
        except (RuntimeError, OSError) as err:
            raise self._failed(err) from err

    def _failed(self, err: Exception) -> RuntimeError:
        return RuntimeError(
            f"{self._where()}: the sync of version {self.version + 1} failed: {err}. Another member exited "
            "or timed out; its log says why (every member calls sync_weights once per version, trainer 0 "
            "with the payload)"
        )

    def shutdown(self) -> None:
        self.transport = None
