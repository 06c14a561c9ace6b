"""No test's own deadline is silently cut short by pytest-timeout's default (pyproject.toml,
``timeout = 300``): a module that waits longer than that for something (``timeout=600``,
``RUN_TIMEOUT = 900``) declares a ``pytest.mark.timeout`` above its longest wait."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAIT = re.compile(r"\b(?:timeout|[A-Z_]*TIMEOUT)\s*[=:]\s*(?:int\s*=\s*)?(\d+(?:\.\d+)?)")
MARK = re.compile(r"pytest\.mark\.timeout\((\d+)\)")


def test_every_wait_longer_than_the_default_has_a_longer_timeout_mark() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    default = float(config["tool"]["pytest"]["ini_options"]["timeout"])
    short = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path == Path(__file__).resolve():
            continue  # its docstring's examples
        text = path.read_text()
        waits = [float(w) for w in WAIT.findall(text)]
        longest = max(waits, default=0.0)
        if longest <= default:
            continue
        marks = [float(m) for m in MARK.findall(text)]
        if not marks or min(marks) <= longest:
            short.append(f"{path.relative_to(ROOT)}: waits up to {longest:g} s, timeout marks {marks}")
    assert not short, short
