"""The local executor's conditions from a driver's metrics lines (``service.local_executor``),
with a stand-in driver that writes the lines a real one would and exits."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from rljob.run_dir import RunDir
from rljob.spec import parse_spec
from service.local_executor import LocalExecutor
from service.store import SqlJobStore
from tests.helpers import wait_for

# a stand-in driver: writes the lines given in argv[2] (JSON) to metrics.jsonl, stamped now
_LINES = """
import json, sys, time
with open(sys.argv[1], "a") as f:
    for row in json.loads(sys.argv[2]):
        f.write(json.dumps({**row, "time": time.time()}) + "\\n")
"""


def run_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any], rows: list[Any]) -> Any:
    """The job's status once the stand-in driver that writes ``rows`` has succeeded."""

    def command(run: RunDir, job: Any, resume: bool) -> list[str]:
        return [sys.executable, "-c", _LINES, str(run.metrics), json.dumps(rows)]

    monkeypatch.setattr("service.local_executor.driver_command", command)
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    job = store.create("team-a", "lines", parse_spec(spec))
    executor = LocalExecutor(store, tmp_path, poll_s=0.05)
    executor.start()
    executor.submit(job)
    try:
        status = wait_for(
            lambda: store.get("team-a", "lines").status,
            "the job to end",
            lambda s: s.phase.value not in {"Pending", "Starting", "Running"},
            timeout=60,
        )
    finally:
        executor.shutdown()
    assert status.phase.value == "Succeeded", status
    return status


def test_a_line_without_the_slo_s_keys_still_says_the_precision_actions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's line without the SLO's keys (no mismatch metric in the window since the last
    action: nothing judged) still carries ``precision/actions``: the condition follows it."""
    spec = {"steps": 1, "precision": {"recipe": "fp8-gen", "mismatch_slo": {"action": "respond"}}}
    status = run_lines(tmp_path, monkeypatch, spec, [{"step": 1, "precision/actions": 2.0}])
    by_type = {c.type: c for c in status.conditions}
    assert "MismatchSLO" not in by_type  # nothing judged
    acted = by_type["PrecisionActions"]
    assert acted.status and acted.reason == "PrecisionRaised", acted
