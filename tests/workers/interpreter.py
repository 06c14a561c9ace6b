"""Run a module of checks under Triton's interpreter. The interpreter must be switched on before
Triton is first imported, so the checks run in a fresh Python process (``python -m module``),
each printing ``ok <name>`` as it passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_under_interpreter(module: str, *args: str, timeout: float, env: dict[str, str] | None = None) -> str:
    """``module``'s standard output; fails the test with its output where it exits non-zero.
    ``timeout``: seconds to wait (the calling test module's timeout mark must be above it:
    tests/test_timeouts.py reads the literal there); ``env``: more environment variables."""
    full = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    out = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    return out.stdout
