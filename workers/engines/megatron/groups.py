"""Where a Megatron trainer rank runs: its device and its place in Megatron's parallel groups.

On a GPU the trainers' process group is NCCL; on the CPU gloo (the trainer actor initialises it
with the job's collective backend; a lone trainer without one makes a 1-rank group itself).
Megatron-Core builds its tensor, pipeline and data-parallel groups over it, on its backend.
Megatron-Core is imported inside the functions, so this module imports anywhere.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rljob.spec import JobSpec
from workers.engines.megatron import without_cuda


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class Groups:
    """This rank's place in Megatron's parallel groups (tensor x pipeline x data)."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    mp_group: Any  # tensor x pipeline: the ranks that compute on the same rows
    pp_ranks: list[int]  # global ranks of this rank's pipeline stages, by stage

    @property
    def mp_size(self) -> int:
        return self.tp * self.pp


def trainer_device(device: str) -> torch.device:
    """The device of a trainer rank: a CUDA GPU (made current), or the CPU in a process that sees
    no CUDA device (Megatron-Core allocates on "the current CUDA device" wherever it can see one,
    so a CPU trainer beside a visible GPU would split its tensors over both)."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
        return dev
    if dev.type == "cpu" and without_cuda.cpu_only():
        return dev
    raise ValueError(
        f"the megatron trainer runs on CUDA GPUs or on the CPU of a process without CUDA, got device "
        f"{device!r} (CUDA {'visible' if torch.cuda.is_available() else 'not available'}); set "
        "resources.gpus_per_trainer to 1 (GPU) or 0 (CPU, where Ray hides the GPUs from the trainer)"
    )


def init_groups(spec: JobSpec, rank: int, device: torch.device) -> Groups:
    """The trainers' process group (a 1-rank one for a lone trainer: NCCL on a GPU, gloo on the
    CPU) and Megatron's groups over it."""
    from megatron.core import parallel_state as ps

    res = spec.resources
    tp, pp = res.trainer_tensor_parallel_size, res.trainer_pipeline_parallel_size
    if not dist.is_initialized():
        if rank != 0:
            raise RuntimeError(
                f"MegatronTrainer rank {rank}: torch.distributed is not initialized; the trainer actor "
                "must join the trainers' process group first (workers.job.ray_workers)"
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    if ps.model_parallel_is_initialized() and (
        ps.get_tensor_model_parallel_world_size() != tp or ps.get_pipeline_model_parallel_world_size() != pp
    ):
        ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        world = dist.get_world_size()
        if world % (tp * pp):
            raise ValueError(
                f"{world} trainers do not split into tensor x pipeline parallel groups of {tp} x {pp}; "
                "set resources.trainers to a multiple of their product"
            )
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    pp_group = ps.get_pipeline_model_parallel_group()
    return Groups(
        tp=tp,
        pp=pp,
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=pp_group,
        dp_group=ps.get_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        pp_ranks=dist.get_process_group_ranks(pp_group),
    )
