"""MetricsLog.read_new: a poller reads each complete line once, and restarts after a truncation."""

from __future__ import annotations

import json
from pathlib import Path

from rljob.metrics import MetricsLog


def test_read_new_returns_complete_lines_once(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    assert log.read_new(0) == ([], 0)
    a, b = json.dumps({"step": 1}) + "\n", json.dumps({"step": 2}) + "\n"  # 12 bytes each
    log.path.write_text(a + b + '{"step": 3')  # the third line is still being written
    rows, offset = log.read_new(0)
    assert rows == [{"step": 1}, {"step": 2}] and offset == 24
    with log.path.open("a") as f:
        f.write("}\n")
    assert log.read_new(offset) == ([{"step": 3}], 36)
    assert log.read_new(36) == ([], 36)
    log.truncate(1)  # a resume keeps step 1 only: 12 bytes, shorter than the reader's offset
    assert log.read_new(36) == ([{"step": 1}], 12)
