"""Weight sync: the trainer broadcasts its weights to the generators after every update.

:class:`CollectiveWeightSync` is the wire format below over any broadcast primitive (every member
calls ``sync_weights`` once per version). :class:`BroadcastWeightSync` runs it over the job's
torch.distributed group (gloo on CPU, NCCL on GPU) for native engines;
:class:`~workers.weight_sync.channel.WeightChannel` over an NCCL group of its own for vLLM and
Megatron. Which one a job uses is the actors' business (:mod:`workers.job.ray_workers`), never the step's.

Wire format of one sync, from the trainer (rank 0 of the sync group) to every generator:
1. a manifest (``broadcast_object_list``): version and, per parameter, its kind (``fp8``: data +
   float32 scales, or ``tensor``), dtype, shape, scale shape, block and format;
2. the bytes, packed in order into uint8 buckets of at most ``bucket_bytes`` (a tensor larger than
   a bucket travels alone), one ``broadcast`` per bucket. Each tensor's bytes (an FP8 weight's
   data, then its scales) start at a multiple of 16 bytes in its bucket, zeros between (at most
   15 bytes a tensor): aligned for any dtype and for cuBLAS's operands.
Buckets live on the compute device (NCCL: the GPU, where the weights are; gloo: the CPU), and
receivers unpack them there: no host round trip on a GPU. The unpacked tensors are views of the
received buckets, no copy (a receiver's load copies them into its own parameters).
FP8 weights travel as the trainer's own data and scales; the generator wraps them back into
:class:`~workers.fp8.fp8_tensor.Fp8Tensor` and loads them without re-quantizing.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from workers.fp8.formats import get_format
from workers.fp8.fp8_tensor import Fp8Tensor
from workers.weight_sync.data import Payload, SyncResult

DEFAULT_BUCKET_BYTES = 64 * 2**20
ALIGN = 16  # bytes: where each tensor starts in its bucket


@dataclass(frozen=True)
class _Entry:
    name: str
    kind: str  # fp8 | tensor
    dtype: str
    shape: tuple[int, ...]
    scale_shape: tuple[int, ...] = ()
    block: tuple[int, int] | None = None
    fmt: str = ""

    def parts(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The tensors it travels as, in order: the data, and an FP8 weight's float32 scales."""
        data = (self.shape, _dtype(self.dtype))
        return [data, (self.scale_shape, torch.float32)] if self.kind == "fp8" else [data]

    def nbytes(self) -> int:
        """Its bytes in a bucket, each part padded to :data:`ALIGN`."""
        return sum(_aligned(_part_bytes(shape, dtype)) for shape, dtype in self.parts())


def _part_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return _numel(shape) * torch.empty((), dtype=dtype).element_size()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r} in the manifest")
    return dtype


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def manifest_of(payload: Payload) -> list[_Entry]:
    """The manifest of a payload, in a fixed (insertion) order."""
    out = []
    for name, v in payload.items():
        if isinstance(v, Fp8Tensor):
            out.append(
                _Entry(
                    name, "fp8", str(v.data.dtype), tuple(v.shape), tuple(v.scale.shape), v.block, v.fmt.name
                )
            )
        elif isinstance(v, torch.Tensor):
            out.append(_Entry(name, "tensor", str(v.dtype), tuple(v.shape)))
        else:
            raise TypeError(f"weight sync: {name} is a {type(v).__name__}, expected a Tensor or Fp8Tensor")
    return out


def bucket_plan(manifest: list[_Entry], bucket_bytes: int) -> list[list[_Entry]]:
    """Entries grouped in order into buckets of at most ``bucket_bytes`` (a larger entry travels
    alone). Sender and receivers both derive the layout from the manifest with this one rule."""
    plan: list[list[_Entry]] = []
    size = 0
    for entry in manifest:
        n = entry.nbytes()
        if not plan or (size and size + n > bucket_bytes):
            plan.append([])
            size = 0
        plan[-1].append(entry)
        size += n
    return plan


def pack(payload: Payload, manifest: list[_Entry], bucket_bytes: int) -> list[torch.Tensor]:
    """The payload's bytes in uint8 buckets (see the module docstring)."""
    buckets = []
    padding: dict[torch.device, torch.Tensor] = {}  # zeros to cut the padding from, per device
    for group in bucket_plan(manifest, bucket_bytes):
        device = _device_of(payload[group[0].name])
        if device not in padding:
            padding[device] = torch.zeros(ALIGN - 1, dtype=torch.uint8, device=device)
        zeros = padding[device]
        parts = []
        for entry in group:
            v = payload[entry.name]
            for t in [v.data, v.scale.float()] if entry.kind == "fp8" else [v]:
                raw = _as_bytes(t)
                parts += [raw, zeros[: _aligned(raw.numel()) - raw.numel()]]
        buckets.append(torch.cat(parts))
    return buckets


def _device_of(v: Fp8Tensor | torch.Tensor) -> torch.device:
    return v.data.device if isinstance(v, Fp8Tensor) else v.device


def bucket_sizes(manifest: list[_Entry], bucket_bytes: int) -> list[int]:
    """Sizes :func:`pack` produces for ``manifest`` (what a receiver allocates)."""
    return [sum(e.nbytes() for e in group) for group in bucket_plan(manifest, bucket_bytes)]


def _take(
    bucket: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, int]:
    """The tensor at ``offset`` (a multiple of :data:`ALIGN`), a view of ``bucket``, and where the
    next one starts."""
    n = _part_bytes(shape, dtype)
    return bucket[offset : offset + n].view(dtype).reshape(shape), offset + _aligned(n)


def unpack(
    buckets: list[torch.Tensor], manifest: list[_Entry], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Payload:
    """Inverse of :func:`pack`, on the buckets' device (no host round trip).

    Entries never straddle buckets (:func:`bucket_plan`), so each is a view of its own bucket,
    aligned for the dtype it is viewed as and for FP8 GEMMs (each starts at a multiple of 16
    bytes): no copy. The payload keeps the buckets alive while it is held.
    """
    groups = bucket_plan(manifest, bucket_bytes)
    if len(groups) != len(buckets):
        raise RuntimeError(
            f"weight sync: {len(buckets)} buckets received, the manifest plans {len(groups)}; "
            "sender and receiver use different bucket sizes"
        )
    payload: Payload = {}
    for bucket, group in zip(buckets, groups, strict=True):
        offset = 0
        for e in group:
            parts = []
            for shape, dtype in e.parts():
                part, offset = _take(bucket, offset, shape, dtype)
                parts.append(part)
            if e.kind == "fp8":
                data, scale = parts
                payload[e.name] = Fp8Tensor(data=data, scale=scale, block=e.block, fmt=get_format(e.fmt))
            else:
                payload[e.name] = parts[0]
        if offset != bucket.numel():
            raise RuntimeError(
                f"weight sync: {bucket.numel() - offset} bytes left after unpacking a bucket; "
                "manifests differ"
            )
    return payload


class CollectiveWeightSync(ABC):
    """The wire format of the module docstring over any broadcast primitive.

    Subclasses provide :meth:`_broadcast_obj` (a small picklable object from ``src`` to every
    member: the manifest) and :meth:`_broadcast` (a uint8 bucket, in place, on :attr:`device`).
    Every member calls :meth:`sync_weights` for each version: the sender (rank ``src``) with the
    payload, the receivers with ``None``; receivers get the payload back in :class:`SyncResult`.
    """

    def __init__(self, rank: int, device: torch.device, bucket_bytes: int, src: int = 0) -> None:
        self.rank, self.device, self.bucket_bytes, self.src = rank, device, bucket_bytes, src
        self.version = 0

    @abstractmethod
    def _ready(self) -> bool:
        """True once the communicator is up."""

    @abstractmethod
    def _broadcast_obj(self, obj: Any) -> Any:
        """``obj`` of the sender, on every member."""

    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor) -> None:
        """The sender's ``tensor`` into every member's ``tensor`` (same shape, in place)."""

    def sync_weights(self, payload: Payload | None = None) -> SyncResult:
        if not self._ready():
            raise RuntimeError("weight sync: call init_communicator() first")
        start = time.perf_counter()
        sender = self.rank == self.src
        if sender and payload is None:
            raise ValueError("weight sync: the sender must pass a payload")
        header = (self.version + 1, manifest_of(payload)) if sender and payload is not None else None
        version, manifest = self._broadcast_obj(header)
        if sender and payload is not None:
            buckets = [b.to(self.device) for b in pack(payload, manifest, self.bucket_bytes)]
        else:
            buckets = [
                torch.empty(n, dtype=torch.uint8, device=self.device)
                for n in bucket_sizes(manifest, self.bucket_bytes)
            ]
        for b in buckets:
            self._broadcast(b)
        self.version = version
        received = None if sender else unpack(buckets, manifest, self.bucket_bytes)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # once per sync: so that `seconds` means done
        nbytes = sum(b.numel() for b in buckets)
        return SyncResult(version, nbytes, time.perf_counter() - start, len(buckets), received)


class BroadcastWeightSync(CollectiveWeightSync):
    """Broadcast from the trainer (rank ``src`` of ``group``) to the generators over torch.distributed
    (the job's own process group: gloo on CPU, NCCL on GPU)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        init_method: str,
        backend: str = "gloo",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 600.0,
        src: int = 0,
        ranks: list[int] | None = None,
    ) -> None:
        device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        super().__init__(rank, device, bucket_bytes, src)
        self.world_size, self.init_method, self.backend, self.timeout_s = (
            world_size,
            init_method,
            backend,
            timeout_s,
        )
        self.ranks = ranks
        self.group: Any = None

    def init_communicator(self) -> None:
        if not dist.is_initialized():
            try:
                dist.init_process_group(
                    self.backend,
                    init_method=self.init_method,
                    rank=self.rank,
                    world_size=self.world_size,
                    timeout=timedelta(seconds=self.timeout_s),
                )
            except Exception as err:
                raise RuntimeError(
                    f"weight sync: rank {self.rank}/{self.world_size} could not join {self.init_method} "
                    f"over {self.backend} ({err}); check that every trainer and generator started, "
                    "that the address is reachable from all of them, and the port is free"
                ) from err
        self.group = dist.new_group(self.ranks) if self.ranks is not None else dist.group.WORLD

    def _ready(self) -> bool:
        return self.group is not None

    def _broadcast_obj(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=self.src, group=self.group)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.group = None
