"""The GPU checklist's table of which engine tests ran (bench/gpu_check.py), from a hand-written
pytest ``-rA`` summary."""

from __future__ import annotations

from bench.gpu_check import engine_tests

SUMMARY = """\
=========================== short test summary info ============================
PASSED tests/workers/engines/vllm/test_vllm_gpu.py::test_fp8_weights_load
PASSED tests/workers/engines/vllm/test_vllm_gpu.py::test_fp8_logprobs
FAILED tests/workers/engines/megatron/test_megatron_gpu.py::test_te_blockwise - AssertionError
SKIPPED [2] tests/workers/engines/megatron/test_megatron_gpu.py:28: could not import 'transformer_engine'
PASSED tests/workers/fp8/test_matmul.py::test_blockwise_kernel
SKIPPED [1] tests/workers/fp8/test_linear.py:186: needs Hopper
"""


def test_engine_tests_counts_each_engine_apart() -> None:
    table = engine_tests(SUMMARY).splitlines()
    assert table[2] == "| vllm | 2 | 0 | 0 |"
    assert table[3] == "| megatron | 0 | 1 | 2 (could not import 'transformer_engine') |"
    assert table[4] == "| other | 1 | 0 | 1 (needs Hopper) |"
