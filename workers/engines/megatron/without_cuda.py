"""Everything Megatron-Core 0.16.1 needs to train on a machine without CUDA, in one place.

Megatron-Core is written for CUDA GPUs. With its local layer spec (``get_gpt_layer_local_spec``:
torch modules, no Transformer Engine) and gloo process groups most of it is plain torch and runs
on the CPU as written; what does not is listed here, one small function each, with the
Megatron-Core file and line it stands in for (paths under ``megatron/core/``, version 0.16.1).
All of it applies only where ``torch.cuda.is_available()`` is False (:func:`cpu_only`); on a GPU
the adapter runs Megatron-Core as written, with Transformer Engine.

Megatron's own switches, preferred to patches:

- :data:`CONFIG_FLAGS`: ``use_cpu_initialization`` makes parameters and RoPE frequencies on the CPU
  (``tensor_parallel/layers.py:261`` and the other ``device=torch.cuda.current_device()`` branches
  of the parallel layers; ``models/common/embeddings/rotary_pos_embedding.py:77``). The fused CUDA
  kernels (``gradient_accumulation_fusion``: ``tensor_parallel/layers.py:46``;
  ``masked_softmax_fusion``: ``fusions/fused_softmax.py:31``; ``bias_activation_fusion``,
  ``bias_dropout_fusion``, ``apply_rope_fusion``, ``cross_entropy_loss_fusion``) are pinned off:
  their torch fallbacks are what runs. ``batch_p2p_sync=False``: pipeline stages' batched
  send/receive without the ``torch.cuda.synchronize()`` after it
  (``pipeline_parallel/p2p_communication.py:398``), a guard for old CUDA streams.
- :func:`rng_tracker_without_cuda`: Megatron's no-op RNG tracker instead of
  ``tensor_parallel.model_parallel_cuda_manual_seed`` (``tensor_parallel/random.py:378``, which
  seeds CUDA generators through ``torch.cuda.get_rng_state``, ``random.py:235``).
- :func:`causal_mask`: an explicit causal attention mask; without one the local attention builds
  its default on ``"cuda"`` (``fusions/fused_softmax.py:327`` -> ``transformer/utils.py:35``).
- :data:`DDP_FLAGS`: gradient all-reduce at the end of the backward pass, not overlapped with it on
  a CUDA stream (``distributed/distributed_data_parallel.py:230``,
  ``distributed/param_and_grad_buffer.py:417``), and SUM after scaling, not ReduceOp.AVG, which
  gloo lacks.
- The process groups are gloo (the trainers' default group is; Megatron's subgroups inherit its
  backend). ``multi_tensor_applier`` needs nothing: without TE or Apex Megatron falls back to its
  own ``local_multi_tensor_*`` (``optimizer/clip_grads.py:35``, ``optimizer/optimizer.py:30``) and
  to ``torch.optim.AdamW`` (``optimizer/__init__.py:24``).

Patches, applied inside :func:`cuda_calls_on_cpu` only and undone on exit (the trainer enters it
around each call into Megatron-Core: building, the schedule, the optimizer step):

- :func:`_current_device_is_the_cpu`: ``torch.cuda.current_device()`` answers the CPU device.
- :class:`_CudaTensorsOnCpu` (a ``TorchFunctionMode``): a tensor factory called with a CUDA
  ``device`` makes its tensor on the CPU, ``Tensor.cuda()`` leaves a CPU tensor where it is, and
  ``Tensor.type()`` answers a CPU tensor's CUDA type name (Megatron's optimizer sorts parameters
  by those names).

The device rewrites only answer calls that would otherwise fail (torch without CUDA raises on
each), so nothing that already runs on the CPU changes. The type names do change an answer, inside
Megatron's calls only; Megatron-Core asks ``Tensor.type()`` only to check that a tensor is a CUDA
one of some dtype (``optimizer/optimizer.py:671,690``, ``optimizer/clip_grads.py:167``,
``optimizer/distrib_optimizer.py``). The trainer's results are checked against the Hugging Face
model and the native trainer (tests/workers/engines/megatron/test_megatron_cpu.py).

Not run on CPU (not used by the trainer there): Transformer Engine (its layer spec, FP8, its RNG
tracker), every fused CUDA kernel above, CUDA graphs, the distributed optimizer, overlapped
gradient reduction and parameter gathering (CUDA streams), and Megatron's FSDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# TransformerConfig switches: Megatron-Core's own CPU-capable settings (see the module docstring).
CONFIG_FLAGS: dict[str, Any] = dict(
    use_cpu_initialization=True,
    gradient_accumulation_fusion=False,
    masked_softmax_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    cross_entropy_loss_fusion=False,
    batch_p2p_sync=False,
)
# DistributedDataParallelConfig switches: no CUDA communication stream, no ReduceOp.AVG (gloo).
DDP_FLAGS: dict[str, Any] = dict(overlap_grad_reduce=False, average_in_collective=False)


def cpu_only() -> bool:
    """Whether these workarounds apply: this process sees no CUDA device."""
    return not torch.cuda.is_available()


def rng_tracker_without_cuda() -> None:
    """Stands in for ``tensor_parallel.model_parallel_cuda_manual_seed`` (``tensor_parallel/
    random.py:378``), which seeds CUDA generators. Megatron's inference tracker
    (``initialize_rng_tracker(inference_rng_tracker=True)``, ``random.py:286``) forks nothing:
    the layers' ``get_cuda_rng_tracker().fork()`` (dropout regions, ``transformer/
    dot_product_attention.py:217``) become no-ops. That is exact here: every dropout is 0, and
    every weight is loaded, never drawn, so no random number is ever asked for."""
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where a query must not see a key (a later position): Megatron's
    mask convention (``transformer/utils.py:49``, ``attention_mask_func``, fills True). Passed to the model
    so the local attention does not build its default mask on ``"cuda"``
    (``fusions/fused_softmax.py:327``, ``transformer/utils.py:35``)."""
    pos = torch.arange(length, device=device)
    return (pos[None, :] > pos[:, None])[None, None]  # [1, 1, T, T]


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _current_device_is_the_cpu(stack: contextlib.ExitStack) -> None:
    """``torch.cuda.current_device()`` answers ``torch.device("cpu")``, so what Megatron allocates
    on "the current device" is made on the CPU. Stands in for, on the trainer's path:
    ``utils.py:631`` (``GlobalMemoryBuffer``, the attention scores' buffer),
    ``distributed/param_and_grad_buffer.py:806`` (DDP's gradient buffer),
    ``models/common/embeddings/rotary_pos_embedding.py:162`` (RoPE frequencies moved "to the GPU"
    at the first forward), ``tensor_parallel/mappings.py:91,141,148,181`` and
    ``tensor_parallel/utils.py:70,91`` (tensor-parallel gather buffers)."""
    original = torch.cuda.current_device
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    stack.callback(setattr, torch.cuda, "current_device", original)


def _on_cpu(device: Any) -> Any:
    """A factory's ``device`` argument with CUDA replaced by the CPU. Stands in for the literal
    ``device="cuda"`` of ``pipeline_parallel/schedules.py:596`` (the schedule's token count),
    ``optimizer/optimizer.py:485,907`` (the unit loss scale), ``optimizer/clip_grads.py:103,115,174``
    and ``utils.py:1207`` (gradient-norm buffers)."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


def _cuda_type_name(tensor: torch.Tensor) -> str:
    """``tensor.type()`` as it would read for the same tensor on a GPU: ``optimizer/
    optimizer.py:671,690`` sort parameters into BF16 and float32 groups by ``'torch.cuda.*Tensor'``
    (raising TypeError on any other name), ``optimizer/clip_grads.py:167`` asserts float32 gradients
    by it."""
    name: str = torch.Tensor.type(tensor)  # e.g. 'torch.BFloat16Tensor'
    return name.replace("torch.", "torch.cuda.", 1) if tensor.device.type == "cpu" else name


def _stays_on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.cuda()`` answered with the tensor itself: ``models/common/language_module/
    language_module.py:244`` moves the tied word embeddings "to the GPU" before the first and
    last pipeline stages all-reduce them."""
    return tensor


class _CudaTensorsOnCpu(TorchFunctionMode):
    """Tensors Megatron makes on CUDA are made on the CPU (:func:`_on_cpu`), CPU tensors it moves
    to CUDA stay (:func:`_stays_on_cpu`), and a tensor's type name reads as on CUDA
    (:func:`_cuda_type_name`). Everything else passes through unchanged."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _on_cpu(kwargs["device"])}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(args[0])
        if func is torch.Tensor.cuda and len(args) == 1 and not kwargs:
            return _stays_on_cpu(args[0])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_calls_on_cpu() -> Iterator[None]:
    """Megatron-Core's CUDA calls answered on the CPU while inside (see the module docstring);
    everything restored on exit. Only for processes without CUDA."""
    if not cpu_only():
        raise RuntimeError(
            "cuda_calls_on_cpu is for machines without CUDA: with a GPU, Megatron-Core runs as written"
        )
    with contextlib.ExitStack() as stack:
        _current_device_is_the_cpu(stack)
        stack.enter_context(_CudaTensorsOnCpu())
        yield


def megatron_calls(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """What the trainer wraps each call into Megatron-Core in: :func:`cuda_calls_on_cpu` for a
    CPU trainer, nothing on a GPU."""
    return cuda_calls_on_cpu() if device.type == "cpu" else contextlib.nullcontext()
