"""``fp8rl bench sampling`` (bench/sampling.py): its columns worked by hand, a run of the real
kernels under Triton's interpreter, and the refusal where Triton cannot run (the GPU session runs
it on CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench import sampling
from fp8rl.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_ratio_and_rate_by_hand() -> None:
    row = sampling.Row(rows=2, vocab=1000, torch_us=30.0, triton_us=12.0, same=2)
    assert row.ratio == pytest.approx(2.5)
    # 2 x 1000 logits: 2 BF16 reads (4 bytes) + noise written and read (8 bytes) = 24000 bytes in 12 us
    assert row.gbs == pytest.approx(2.0)
    assert sampling.Row(2, 1000, 30.0, None, 0, "refused").ratio is None
    table = sampling.format_table([row, sampling.Row(1, 1000, 9.0, None, 0, "refused: X")])
    assert "2.50x" in table and "2/2" in table and "refused: X" in table


# one small size, one timing: the CLI's arguments for both runs below
SMALL = ["bench", "sampling", "--device", "cpu", "--rows", "3", "--vocabs", "3000", "--replays", "1"]


def run_cli(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "fp8rl.cli", *SMALL]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # the interpreter runs every program: ~10 s on 2 idle cores
def test_the_kernels_run_under_the_interpreter_and_draw_torchs_tokens() -> None:
    out = run_cli({**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    row = next(line.split() for line in out.stdout.splitlines() if line.split()[:2] == ["3", "3000"])
    assert row[6] == "3/3", row  # the same tokens from the same seed


def test_without_triton_the_row_says_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # in this process (torch is loaded already): a fresh interpreter for the CLI took 10-11 s on CI
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = runner.invoke(app, SMALL)
    assert out.exit_code == 0, out.output[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.split()[:2] == ["3", "3000"])
    assert "refused:" in row and row.split()[3] == "-", row


def test_sizes_are_bounded() -> None:
    out = runner.invoke(app, ["bench", "sampling", "--rows", "4096", "--vocabs", "200000"])
    assert out.exit_code != 0 and "at most 268435456 logits per call" in out.output
