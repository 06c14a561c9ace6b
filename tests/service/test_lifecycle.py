"""A tiny real job through the API on the embedded default: submit, progress, suspend, resume,
succeed; a driver that dies (Failed with a reason, then resumed); a restart of the service that
re-attaches a live driver, or marks a job whose driver is gone Failed (resumable)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from rljob.metrics import MetricsLog
from rljob.spec import JobSpec
from rljob.status import JobStatus, Phase
from service.app import create_app
from service.executor import LocalExecutor, run_dir
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


def _driver_pid(run: Path) -> int:
    return int(json.loads((run / "driver.pid").read_text())["pid"])


def test_a_dead_driver_fails_the_job_with_a_reason_and_it_resumes(tmp_path: Path) -> None:
    """SIGKILL to the driver's process group (the driver and its local Ray): Failed, reason
    WorkerExited with the signal; resume continues from the last checkpoint to the end."""
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    executor = LocalExecutor(store, tmp_path, poll_s=0.2)
    app = create_app(Settings(data_dir=tmp_path), store, {TOKEN: "team-a"}, executor)
    executor.start()
    spec = {**TINY, "steps": 12, "checkpoint_interval": 2}
    try:
        api = TestClient(app)
        assert api.post("/v1/jobs", json={"name": "dies", "spec": spec}, headers=HEADERS).status_code == 201

        def get() -> dict[str, Any]:
            return api.get("/v1/jobs/dies", headers=HEADERS).json()

        wait(get, lambda j: j["status"]["progress"]["step"] >= 3, "progress")
        os.killpg(_driver_pid(run_dir(tmp_path, "team-a", "dies")), signal.SIGKILL)
        failed = wait(get, lambda j: j["status"]["phase"] == "Failed", "the failure")
        assert failed["status"]["reason"] == "WorkerExited"
        assert "code -9" in failed["status"]["message"]
        assert api.post("/v1/jobs/dies:resume", headers=HEADERS).status_code == 200
        done = wait(get, lambda j: j["status"]["phase"] == "Succeeded", "success after resume")
        assert done["status"]["progress"]["step"] == 12
        history = api.get("/v1/jobs/dies/metrics", headers=HEADERS).json()
        assert [r["step"] for r in history] == list(range(1, 13))  # recomputed steps replace lost ones
    finally:
        executor.shutdown()


def test_a_restarted_service_reattaches_a_live_driver(tmp_path: Path) -> None:
    """The service goes away while its driver runs; the next one watches the same driver to the end
    instead of failing the job or starting a second driver."""
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    first = LocalExecutor(store, tmp_path, poll_s=0.2)
    first.start()
    job = store.create("team-a", "long", JobSpec.model_validate({**TINY, "steps": 15}))
    first.submit(job)

    def get() -> dict[str, Any]:
        return {"status": store.get("team-a", "long").status.model_dump(mode="json")}

    wait(get, lambda j: j["status"]["phase"] == "Running", "Running")
    run = run_dir(tmp_path, "team-a", "long")
    pid = _driver_pid(run)
    first.shutdown()  # the old service stops watching; its driver keeps running
    [popen] = [r.proc.popen for r in first._procs.values()]
    second = LocalExecutor(store, tmp_path, poll_s=0.2)
    second.start()
    try:
        assert store.get("team-a", "long").status.phase is Phase.RUNNING  # not failed
        done = wait(get, lambda j: j["status"]["phase"] == "Succeeded", "success", timeout=240)
        assert done["status"]["progress"]["step"] == 15 and done["status"]["reason"] == "Completed"
        assert _driver_pid(run) == pid  # no second driver
        steps = [r["step"] for r in MetricsLog(run / "metrics.jsonl").rows()]
        assert steps == list(range(1, 16))
    finally:
        second.shutdown()
        if popen is not None:
            popen.wait(timeout=60)  # reap it: this test process is its parent


def test_restart_with_a_finished_or_vanished_driver(tmp_path: Path) -> None:
    """A pid record whose process is gone (or whose pid was reused: the start time differs)."""
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    for name in ("finished", "vanished"):
        store.create("team-a", name, JobSpec.model_validate({**TINY, "steps": 2}))
        store.update("team-a", name, lambda s: s.moved(Phase.STARTING, "ProcessStarted"))
        run = run_dir(tmp_path, "team-a", name)
        run.mkdir(parents=True)
        (run / "driver.pid").write_text(json.dumps({"pid": os.getpid(), "started": "0"}))
        rows = 2 if name == "finished" else 1
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1}) + "\n" for i in range(rows)))
    executor = LocalExecutor(store, tmp_path)
    executor.start()
    executor.shutdown()
    assert store.get("team-a", "finished").status.phase is Phase.SUCCEEDED
    vanished = store.get("team-a", "vanished").status
    assert vanished.phase is Phase.FAILED and vanished.reason == "ServiceRestarted"
