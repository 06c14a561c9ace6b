"""``fp8rl bench graders`` runs end to end on a few samples: the pool's scores equal the function's
own (the bench checks it), and the table states each variant and the start-up cost. The timing
itself is the benchmark's business, not a test's."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fp8rl.cli import app


@pytest.mark.slow  # a local Ray: ~15 s
def test_the_graders_bench_runs_and_reports_each_variant() -> None:
    done = CliRunner().invoke(app, ["bench", "graders", "--samples", "8", "--work-ms", "1", "--workers", "2"])
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert lines[1] == "8 samples x 1 ms of CPU each"
    assert lines[3].startswith("in process (baseline)") and lines[3].endswith("1.00x")
    assert lines[4].startswith("sandbox pool")
    assert lines[5].startswith("Ray actors (a job's pool)")
    assert lines[6].startswith("starting the pool: ")
    assert lines[7].startswith("starting 2 Ray actors and their processes: ")
