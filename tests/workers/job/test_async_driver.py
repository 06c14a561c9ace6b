"""The asynchronous loop through the real driver on local Ray: two trainers and one generator
(``rollout.max_staleness: 1``), the driver SIGKILLed mid-run with its local Ray, then resumed: every
step is in the log exactly once, and the trainers' optimizer took exactly one step per RL step, so
no batch in flight at the kill was trained twice."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rljob import parse_spec
from rljob.metrics import MetricsLog
from tests import helpers
from tests.helpers import ONE_DIGIT_SUMS
from workers.models import checkpoint

# above its longest wait (pyproject's timeout of 300 s would cut that short: tests/test_timeouts.py)
pytestmark = pytest.mark.timeout(460)

ROOT = Path(__file__).resolve().parents[3]
STEPS = 8


def driver(spec: Path, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    """The driver as the service starts it: its own session, which holds its local Ray."""
    argv = [sys.executable, "-m", "workers.job.driver", str(spec), "--output", str(out), *extra]
    log = (out.parent / f"driver{len(extra)}.log").open("wb")
    return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow  # two driver starts with Ray and 3 actors: ~1-2 minutes on 2 cores
def test_a_sigkilled_async_run_resumes_with_every_step_once(tmp_path: Path) -> None:
    spec = parse_spec(
        helpers.tiny_spec(
            task={"params": ONE_DIGIT_SUMS, "size": 50},
            rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3, "max_staleness": 1},
            resources={"trainers": 2, "generators": 1, "cpus_per_actor": 0.5},
            algorithm={"minibatches": 1},  # one optimizer step per RL step
            steps=STEPS,
            checkpoint_interval=2,
        )
    )
    path, out = tmp_path / "job.json", tmp_path / "out"
    path.write_text(json.dumps(spec.model_dump(mode="json")))
    out.mkdir()
    log = MetricsLog(out / "metrics.jsonl")
    first = driver(path, out)
    try:
        helpers.wait_for(lambda: len(log.rows()), "step 3", lambda n: n >= 3 or first.poll() is not None, 300)
        assert first.poll() is None, (out.parent / "driver0.log").read_text()[-3000:]
        os.killpg(first.pid, signal.SIGKILL)  # the driver and its local Ray, mid-step
        first.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    killed_at = [r["step"] for r in log.rows()]
    latest = checkpoint.latest(out)
    assert latest is not None and killed_at[:3] == [1, 2, 3]

    second = driver(path, out, "--resume")
    assert second.wait(timeout=400) == 0, (out.parent / "driver1.log").read_text()[-3000:]
    rows = log.rows()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    resumed = rows[latest[0]]  # the first step after the checkpoint the resume loaded
    assert resumed["step"] == latest[0] + 1 and resumed["staleness/max"] == 0.0  # regenerated: lag 0
    assert all(r["staleness/max"] <= 1 and r["staleness/dropped_batches"] == 0 for r in rows)
    assert any(r["staleness/max"] == 1 for r in rows)  # some batches were generated a version back
    assert sum(r["timing/overlap_s"] for r in rows) > 0  # generation ran while the trainers trained
    # one optimizer step per RL step in the final weights' history: none twice, none lost
    final = checkpoint.latest(out)
    assert final is not None and final[0] == STEPS
    state = torch.load(final[1] / "trainer.pt", map_location="cpu", weights_only=True)
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {STEPS}
