"""A tiny real job through the API on the embedded default: submit, progress, suspend, resume,
succeed; and a restart that finds a job Running with no driver marks it Failed (resumable)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from rljob.spec import JobSpec
from rljob.status import JobStatus, Phase
from service.app import create_app
from service.executor import LocalExecutor
from service.settings import Settings
from service.store import SqlJobStore

TOKEN = "lifecycle-token-0123456789"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
TINY = {
    "model": {
        "tiny": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_layers": 1,
            "num_heads": 2,
            "num_kv_heads": 1,
        }
    },
    "task": {"params": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, "size": 20},
    "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 2},
    "steps": 40,
    "checkpoint_interval": 100,
}


def wait(
    get: Callable[[], dict[str, Any]], ok: Callable[[dict[str, Any]], bool], what: str, timeout: float = 240
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = get()
        if ok(job):
            return job
        assert time.monotonic() < deadline, f"timed out waiting for {what}; job is {job['status']}"
        time.sleep(0.3)


def test_submit_progress_suspend_resume_succeed(tmp_path: Path) -> None:
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    executor = LocalExecutor(store, tmp_path, poll_s=0.2)
    app = create_app(Settings(data_dir=tmp_path), store, {TOKEN: "team-a"}, executor)
    executor.start()
    try:
        api = TestClient(app)
        assert api.post("/v1/jobs", json={"name": "life", "spec": TINY}, headers=HEADERS).status_code == 201

        def get() -> dict[str, Any]:
            return api.get("/v1/jobs/life", headers=HEADERS).json()

        running = wait(get, lambda j: j["status"]["progress"]["step"] >= 2, "progress")
        assert running["status"]["phase"] == "Running" and running["status"]["progress"]["total_steps"] == 40
        assert running["status"]["progress"]["reward"] is not None
        assert api.post("/v1/jobs/life:suspend", headers=HEADERS).json()["status"]["phase"] == "Suspended"
        wait(get, lambda j: not executor._procs, "the driver to stop")
        stopped_at = get()["status"]["progress"]["step"]
        history = api.get("/v1/jobs/life/metrics", headers=HEADERS).json()
        assert [r["step"] for r in history] == list(range(1, len(history) + 1)) and len(history) >= stopped_at
        assert len(history) < 40, "suspend should have stopped the job before its end"

        assert api.post("/v1/jobs/life:resume", headers=HEADERS).json()["status"]["phase"] in (
            "Pending",
            "Starting",
        )
        done = wait(get, lambda j: j["status"]["phase"] == "Succeeded", "success")
        assert done["status"]["progress"]["step"] == 40
        history = api.get("/v1/jobs/life/metrics", headers=HEADERS).json()
        assert [r["step"] for r in history] == list(range(1, 41))  # nothing lost, nothing twice
        assert [r["step"] for r in api.get("/v1/jobs/life/metrics?since=38", headers=HEADERS).json()] == [
            39,
            40,
        ]
        logs = api.get("/v1/jobs/life/logs", headers=HEADERS).text
        assert "resumed from" in logs
        assert 'fp8rl_jobs{namespace="team-a",phase="Succeeded"} 1.0' in api.get("/metrics").text
    finally:
        executor.shutdown()


def test_restart_marks_orphaned_running_jobs_failed_and_resumable(tmp_path: Path) -> None:
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    store.create("team-a", "orphan", JobSpec.model_validate(TINY))
    store.update(
        "team-a",
        "orphan",
        lambda s: s.moved(Phase.STARTING, "ProcessStarted").moved(Phase.RUNNING, "Training"),
    )
    executor = LocalExecutor(store, tmp_path)
    executor.start()  # a new service process: the old driver is gone
    executor.shutdown()
    status: JobStatus = store.get("team-a", "orphan").status
    assert status.phase is Phase.FAILED and status.reason == "ServiceRestarted"
    assert status.moved(Phase.PENDING, "UserResumed").phase is Phase.PENDING
