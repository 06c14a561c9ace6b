"""numerics.json: what a run's numbers depend on beyond its spec (workers/job/numerics.py)."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch
import transformers

from workers.fp8.cpu_bf16 import detect_cpu_bf16_gemm
from workers.job.numerics import KERNEL_SWITCHES, installed_version, numerics_record


def test_the_record_names_the_cpu_gemm_and_every_switch_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FP8RL_CPU_BF16_GEMM", "float32")
    monkeypatch.setenv("FP8RL_TRITON", "0")
    detect_cpu_bf16_gemm.cache_clear()
    try:
        record = numerics_record()
    finally:
        detect_cpu_bf16_gemm.cache_clear()
    assert record["torch"] == torch.__version__
    assert record["versions"]["transformers"] == transformers.__version__  # the module's own word
    assert record["versions"]["megatron-core"] is None or "." in record["versions"]["megatron-core"]
    assert record["cpu_bf16_gemm"] == "float32"  # forced, so the record can tell two runs apart
    assert record["switches"] == {
        "FP8RL_CUBLAS_BLOCKWISE": None,
        "FP8RL_DECODE_ATTENTION": None,
        "FP8RL_SMALL_M_GEMM": None,
        "FP8RL_TRITON": "0",
        "FP8RL_KV_WRITE": None,
        "FP8RL_WGRAD_GEMM": None,
        "FP8RL_SILU_MUL": None,
        "FP8RL_RMS_NORM": None,
        "FP8RL_SAMPLING": None,
        "FP8RL_CPU_BF16_GEMM": "float32",
        "FP8RL_CPU_COMPILE": None,
    }


def test_a_missing_distribution_is_null_and_the_first_installed_name_counts() -> None:
    assert installed_version(("no-such-distribution-fp8rl",)) is None
    assert installed_version(("no-such-distribution-fp8rl", "torch")) == metadata.version("torch")
