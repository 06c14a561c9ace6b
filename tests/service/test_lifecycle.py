"""A tiny real job through the API on the embedded default: submit, progress, suspend, resume,
succeed; a driver that dies (Failed with a reason, then resumed); a restart of the service that
re-attaches a live driver, or marks a job whose driver is gone Failed (resumable)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from rljob.metrics import MetricsLog
from rljob.run_dir import RunDir
from rljob.spec import JobSpec
from rljob.status import JobStatus, Phase
from service.driver_process import DriverProcess
from service.local_executor import LocalExecutor
from service.local_runs import run_dir
from service.main import create_app
from service.settings import Settings
from service.store import SqlJobStore
from tests.helpers import tiny_spec, wait_for

TOKEN = "lifecycle-token-0123456789"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
# Long enough that the driver is still mid-run when the test suspends it after step 2: it sees the
# step some poll intervals late, and the driver finishes the step it is in before it stops
STEPS = 60
# fp8-e2e (the default recipe), held to its SLO with the precision response on
TINY = tiny_spec(steps=STEPS, checkpoint_interval=100, precision={"mismatch_slo": {"action": "respond"}})
RUN_TIMEOUT = 240  # seconds for a whole tiny job on a busy 2-core machine


@contextlib.contextmanager
def local_service(tmp_path: Path, driver_retries: int = 2) -> Iterator[TestClient]:
    """The service on SQLite with its local executor (drivers are real processes), as a client."""
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    executor = LocalExecutor(store, tmp_path, poll_s=0.2, driver_retries=driver_retries)
    app = create_app(Settings(data_dir=tmp_path), store, {TOKEN: "team-a"}, executor)
    executor.start()
    try:
        yield TestClient(app)
    finally:
        executor.shutdown()


def getter(api: TestClient, name: str) -> Callable[[], dict[str, Any]]:
    """``GET /v1/jobs/{name}``, for :func:`wait_for`."""
    return lambda: api.get(f"/v1/jobs/{name}", headers=HEADERS).json()


def _driver_pid(run: RunDir) -> int:
    return int(json.loads(run.driver_pid.read_text())["pid"])


def _reaped(pid: int) -> bool:
    """The process has exited and its parent has collected it: the executor in this test process,
    whose monitor collects (polls) a driver only to record its exit."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_submit_progress_suspend_resume_succeed(tmp_path: Path) -> None:
    with local_service(tmp_path) as api:
        assert api.post("/v1/jobs", json={"name": "life", "spec": TINY}, headers=HEADERS).status_code == 201
        get = getter(api, "life")
        running = wait_for(
            get, "progress to step 2", lambda j: j["status"]["progress"]["step"] >= 2, RUN_TIMEOUT
        )
        assert running["status"]["phase"] == "Running"
        assert running["status"]["progress"]["total_steps"] == STEPS
        assert running["status"]["progress"]["reward"] is not None
        assert api.post("/v1/jobs/life:suspend", headers=HEADERS).json()["status"]["phase"] == "Suspended"
        pid = _driver_pid(run_dir(tmp_path, "team-a", "life"))
        wait_for(lambda: _reaped(pid), f"the suspended driver (pid {pid}) to exit", timeout=RUN_TIMEOUT)
        assert "stopped after step" in api.get("/v1/jobs/life/logs", headers=HEADERS).text
        stopped_at = get()["status"]["progress"]["step"]
        history = api.get("/v1/jobs/life/metrics", headers=HEADERS).json()
        assert [r["step"] for r in history] == list(range(1, len(history) + 1)) and len(history) >= stopped_at
        assert len(history) < STEPS, "suspend should have stopped the job before its end"

        assert api.post("/v1/jobs/life:resume", headers=HEADERS).json()["status"]["phase"] in (
            "Pending",
            "Starting",
        )
        done = wait_for(get, "success", lambda j: j["status"]["phase"] == "Succeeded", RUN_TIMEOUT)
        assert done["status"]["progress"]["step"] == STEPS
        # the tiny fp8-e2e job's mismatch is exactly 1.0 on every step: within its recipe's SLO
        [slo] = [c for c in done["status"]["conditions"] if c["type"] == "MismatchSLO"]
        assert (slo["status"], slo["reason"]) == (True, "MismatchWithinSLO")
        assert slo["message"] == (
            "median token_mult_prob_error 1.0000 (bound 1.1); 0 of the last 10 steps above 1.1 "
            "(at most 1): within the SLO"
        )
        [acted] = [c for c in done["status"]["conditions"] if c["type"] == "PrecisionActions"]
        assert (acted["status"], acted["reason"]) == (False, "PrecisionAsSpecified")  # nothing to respond to
        history = api.get("/v1/jobs/life/metrics", headers=HEADERS).json()
        assert [r["step"] for r in history] == list(range(1, STEPS + 1))  # nothing lost, nothing twice
        since = api.get(f"/v1/jobs/life/metrics?since={STEPS - 2}", headers=HEADERS).json()
        assert [r["step"] for r in since] == [STEPS - 1, STEPS]
        logs = api.get("/v1/jobs/life/logs", headers=HEADERS).text
        assert "resumed from" in logs
        # the series are on the metrics port, not the API's (docs/deploy.md: security model)
        app: Any = api.app
        assert (
            'fp8rl_jobs{namespace="team-a",phase="Succeeded"} 1.0'
            in generate_latest(app.state.metrics).decode()
        )


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


@pytest.mark.slow
def test_a_dead_driver_fails_the_job_with_a_reason_and_it_resumes(tmp_path: Path) -> None:
    """SIGKILL to the driver's process group (the driver and its local Ray) with no retries left:
    Failed, reason WorkerExited with the signal; resume continues from the last checkpoint to the end."""
    steps = 20  # still running when the test, some polls after step 3, kills it
    spec = tiny_spec(steps=steps, checkpoint_interval=2)
    with local_service(tmp_path, driver_retries=0) as api:
        assert api.post("/v1/jobs", json={"name": "dies", "spec": spec}, headers=HEADERS).status_code == 201
        get = getter(api, "dies")
        wait_for(get, "progress to step 3", lambda j: j["status"]["progress"]["step"] >= 3, RUN_TIMEOUT)
        os.killpg(_driver_pid(run_dir(tmp_path, "team-a", "dies")), signal.SIGKILL)
        failed = wait_for(get, "the failure", lambda j: j["status"]["phase"] == "Failed")
        assert failed["status"]["reason"] == "WorkerExited"
        assert "code -9" in failed["status"]["message"]
        assert api.post("/v1/jobs/dies:resume", headers=HEADERS).status_code == 200
        done = wait_for(
            get, "success after resume", lambda j: j["status"]["phase"] == "Succeeded", RUN_TIMEOUT
        )
        assert done["status"]["progress"]["step"] == steps
        history = api.get("/v1/jobs/dies/metrics", headers=HEADERS).json()
        assert [r["step"] for r in history] == list(range(1, steps + 1))  # recomputed steps replace lost ones


@pytest.mark.slow
def test_a_dead_driver_is_started_again_with_resume_within_its_retries(tmp_path: Path) -> None:
    """The same kill with driver_retries 2: the executor starts the driver again with --resume
    (Starting, reason DriverRestarted, the exit in the message) and the job succeeds by itself,
    every step once."""
    steps = 20
    spec = tiny_spec(steps=steps, checkpoint_interval=2)
    with local_service(tmp_path) as api:
        assert api.post("/v1/jobs", json={"name": "again", "spec": spec}, headers=HEADERS).status_code == 201
        get = getter(api, "again")
        wait_for(get, "progress to step 3", lambda j: j["status"]["progress"]["step"] >= 3, RUN_TIMEOUT)
        run = run_dir(tmp_path, "team-a", "again")
        first = _driver_pid(run)
        os.killpg(first, signal.SIGKILL)
        restarted = wait_for(
            get, "the restart", lambda j: j["status"]["reason"] == "DriverRestarted", RUN_TIMEOUT
        )
        assert "code -9" in restarted["status"]["message"] and "(1 of 2)" in restarted["status"]["message"]
        assert _driver_pid(run) != first
        done = wait_for(get, "success", lambda j: j["status"]["phase"] == "Succeeded", RUN_TIMEOUT)
        assert done["status"]["progress"]["step"] == steps
        history = api.get("/v1/jobs/again/metrics", headers=HEADERS).json()
        assert [r["step"] for r in history] == list(range(1, steps + 1))
        assert "resumed from" in api.get("/v1/jobs/again/logs", headers=HEADERS).text


@pytest.mark.slow
def test_a_restarted_service_reattaches_a_live_driver(tmp_path: Path) -> None:
    """The service goes away while its driver runs; the next one watches the same driver to the end
    instead of failing the job or starting a second driver."""
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    first = LocalExecutor(store, tmp_path, poll_s=0.2)
    first.start()
    # long enough to be still running when the second executor starts, some polls after step 1
    steps = 30
    job = store.create(
        "team-a", "long", JobSpec.model_validate(tiny_spec(steps=steps, checkpoint_interval=100))
    )
    first.submit(job)

    def phase() -> Phase:
        return store.get("team-a", "long").status.phase

    wait_for(phase, "Running", lambda p: p is Phase.RUNNING, RUN_TIMEOUT)
    run = run_dir(tmp_path, "team-a", "long")
    pid = _driver_pid(run)
    first.shutdown()  # the old service stops watching; its driver keeps running
    second = LocalExecutor(store, tmp_path, poll_s=0.2)
    second.start()
    try:
        assert phase() is Phase.RUNNING  # not failed
        wait_for(phase, "success", lambda p: p is Phase.SUCCEEDED, RUN_TIMEOUT)
        status = store.get("team-a", "long").status
        assert status.progress.step == steps and status.reason == "Completed"
        assert _driver_pid(run) == pid  # no second driver
        assert [r["step"] for r in MetricsLog(run.metrics).rows()] == list(range(1, steps + 1))
    finally:
        second.shutdown()
        # this test process is the driver's parent: stop what is left of it (all of it, had the
        # test failed early; only while its pid record's start time matches, so never a process
        # group that took over a reaped pid) and reap it
        left = DriverProcess.attach(run.driver_pid)
        if left is not None:
            left.kill()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def test_restart_with_a_finished_or_vanished_driver(tmp_path: Path) -> None:
    """A pid record whose process is gone (or whose pid was reused: the start time differs)."""
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    for name in ("finished", "vanished"):
        store.create("team-a", name, JobSpec.model_validate(tiny_spec()))
        store.update("team-a", name, lambda s: s.moved(Phase.STARTING, "ProcessStarted"))
        run = run_dir(tmp_path, "team-a", name)
        run.root.mkdir(parents=True)
        run.driver_pid.write_text(json.dumps({"pid": os.getpid(), "started": "0"}))
        rows = 2 if name == "finished" else 1
        run.metrics.write_text("".join(json.dumps({"step": i + 1}) + "\n" for i in range(rows)))
    executor = LocalExecutor(store, tmp_path)
    executor.start()
    executor.shutdown()
    assert store.get("team-a", "finished").status.phase is Phase.SUCCEEDED
    vanished = store.get("team-a", "vanished").status
    assert vanished.phase is Phase.FAILED and vanished.reason == "ServiceRestarted"


# A stand-in driver that holds the run directory the way the real one does: it refuses to start
# while another driver holds it, takes a while to save its step after SIGINT, and exits 130.
_SLOW_TO_STOP = """
import json, os, signal, sys, time
out = sys.argv[1]
lock = os.path.join(out, "held-by")
try:
    fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
except FileExistsError:
    print("error: another driver holds this run directory", flush=True)
    sys.exit(1)
os.write(fd, str(os.getpid()).encode())
def stop(signum, frame):
    time.sleep(1.5)  # saving the step
    os.remove(lock)
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
resumed = len(sys.argv) > 2
with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": 2 if resumed else 1, "reward/mean": 0.5}) + "\\n")
if resumed:
    os.remove(lock)
    sys.exit(0)
time.sleep(120)
"""


def test_a_resume_waits_for_the_suspended_driver_to_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Suspend, then resume at once while the suspended driver is still saving its step: the new
    driver starts only after the old one exited (never two on one run directory), the old one's
    exit code 130 does not fail the resumed job, and the job finishes."""

    def command(run: RunDir, job: Any, resume: bool) -> list[str]:
        return [sys.executable, "-c", _SLOW_TO_STOP, str(run.root), *(["resume"] if resume else [])]

    monkeypatch.setattr("service.local_executor.driver_command", command)
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    executor = LocalExecutor(store, tmp_path, poll_s=0.05)
    executor.start()
    try:
        job = store.create("team-a", "quick", JobSpec.model_validate({**tiny_spec(), "steps": 2}))
        executor.submit(job)
        wait_for(lambda: store.get("team-a", "quick").status.phase, "Running", lambda p: p is Phase.RUNNING)
        executor.suspend(store.update("team-a", "quick", lambda s: s.moved(Phase.SUSPENDED, "UserSuspended")))
        resumed = store.update(
            "team-a", "quick", lambda s: s.moved(Phase.PENDING, "UserResumed", "", "resume")
        )
        executor.resume(resumed)
        final = wait_for(
            lambda: store.get("team-a", "quick").status,
            "the resumed job to end",
            lambda s: s.phase in (Phase.SUCCEEDED, Phase.FAILED),
            timeout=60,
        )
    finally:
        executor.shutdown()
    log = run_dir(tmp_path, "team-a", "quick").driver_log.read_text()
    assert "another driver holds" not in log, log
    assert final.phase is Phase.SUCCEEDED, final
    rows = MetricsLog(run_dir(tmp_path, "team-a", "quick").metrics).rows()
    assert [r["step"] for r in rows] == [1, 2]
