"""The GPU checklist's table of which engine tests ran (bench/gpu_check.py), from a hand-written
pytest ``-rA`` summary."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def test_engine_test_folders_are_left_out_when_their_engine_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU image without vLLM runs the other GPU tests and says which folder it left out
    (vLLM's tests import vLLM and fail without it, by design)."""
    from bench import gpu_check

    for rel in ("engines/vllm/test_vllm_gpu.py", "engines/megatron/test_meg_gpu.py", "fp8/test_linear.py"):
        (tmp_path / "tests/workers" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests/workers" / rel).write_text("import pytest\npytestmark = pytest.mark.gpu\n")
    (tmp_path / "tests/workers/fp8/test_cpu_only.py").write_text("def test_x(): pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(gpu_check, "_importable", lambda module: module != "vllm")
    files, missing = gpu_check.gpu_test_files()
    assert files == ["tests/workers/engines/megatron/test_meg_gpu.py", "tests/workers/fp8/test_linear.py"]
    assert missing == ["tests/workers/engines/vllm/"]


def test_the_report_names_the_commit_it_ran(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from bench import gpu_check

    monkeypatch.setenv("FP8RL_GIT_COMMIT", "5d13cd3b747dc2e8dfccff327b420928adcec625")
    assert gpu_check.commit() == "5d13cd3b747dc2e8dfccff327b420928adcec625"
    monkeypatch.delenv("FP8RL_GIT_COMMIT")
    monkeypatch.chdir(tmp_path)  # no git checkout here: said, not guessed
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert gpu_check.commit().startswith("unknown")


def test_the_prepared_session_asks_only_for_sections_the_checklist_has(tmp_path: Path) -> None:
    import re
    import subprocess

    from bench.gpu_check import SECTIONS

    script = Path("bench/gpu_session.sh").read_text()
    asked = {s for group in re.findall(r"--sections (\S+)", script) for s in group.split(",")}
    assert asked and asked <= set(SECTIONS), asked - set(SECTIONS)
    usage = subprocess.run(["bash", "bench/gpu_session.sh"], capture_output=True, text=True)
    assert usage.returncode != 0 and "usage: bench/gpu_session.sh DIR" in usage.stderr
