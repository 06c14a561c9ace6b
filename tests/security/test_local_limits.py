"""What a local job may take of the service's machine, on by default (``service.local_executor``):
a wall-clock limit, a limit on the memory its processes use together, and a machine-wide cap on
drivers running at once (more jobs wait Pending). One job's surprise never stops the watch over the
others. The drivers here are small Python programs standing in for the real one (as in
tests/service/test_admission.py): what is tested is the executor's enforcement.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from rljob import parse_spec
from rljob.run_dir import RunDir
from service.driver_process import DriverLimits, sessions_memory
from service.local_executor import LocalExecutor
from service.local_runs import over_memory_message, run_dir
from service.settings import Settings, auto_cpus, auto_resident_mb
from service.store import SqlJobStore
from tests.helpers import wait_for

_SLEEP = "import time; time.sleep(60)"
# holds 400 MiB it has written to (resident, not just reserved), then sleeps
_HOLD = "import time; block = bytearray(400 << 20); block[::4096] = b'x' * len(block[::4096]); time.sleep(60)"
_FINISH = """
import json, sys, time
time.sleep(1.5)
open(sys.argv[1], "w").write(json.dumps({"step": 1, "reward/mean": 0.5}) + "\\n")
"""


def _executor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, programs: dict[str, str], **kw: Any
) -> tuple[LocalExecutor, SqlJobStore]:
    def command(run: RunDir, job: Any, resume: bool) -> list[str]:
        return [sys.executable, "-c", programs[job.name], str(run.metrics)]

    monkeypatch.setattr("service.local_executor.driver_command", command)
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    executor = LocalExecutor(store, tmp_path, poll_s=0.1, **kw)
    executor.start()
    return executor, store


def _phase(store: SqlJobStore, name: str) -> str:
    return store.get("team-a", name).status.phase.value


def test_a_job_past_its_wall_clock_limit_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limits = DriverLimits(wall_clock_s=1.0)
    executor, store = _executor(tmp_path, monkeypatch, {"slow": _SLEEP}, limits=lambda t: limits)
    try:
        executor.submit(store.create("team-a", "slow", parse_spec({"steps": 1})))
        wait_for(lambda: _phase(store, "slow"), "the job to be stopped", lambda p: p == "Failed", timeout=20)
    finally:
        executor.shutdown()
    status = store.get("team-a", "slow").status
    # expected: Failed at the 1 s limit, resumable, saying which limit
    assert status.reason == "DeadlineExceeded" and "max_job_seconds" in status.message, status


def test_a_job_over_its_memory_limit_is_stopped_and_another_runs_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def limits(tenant: str) -> DriverLimits:
        return DriverLimits(resident_bytes=200 << 20)  # 200 MiB: the holder takes 400

    programs = {"hog": _HOLD, "fine": _FINISH}
    executor, store = _executor(tmp_path, monkeypatch, programs, limits=limits)
    try:
        executor.submit(store.create("team-a", "hog", parse_spec({"steps": 1})))
        executor.submit(store.create("team-a", "fine", parse_spec({"steps": 1})))
        wait_for(
            lambda: (_phase(store, "hog"), _phase(store, "fine")),
            "both jobs to end",
            lambda p: not {"Pending", "Starting", "Running"} & set(p),
            timeout=30,
        )
    finally:
        executor.shutdown()
    hog = store.get("team-a", "hog").status
    assert hog.phase.value == "Failed" and hog.reason == "OutOfMemory", hog
    assert "max_resident_mb" in hog.message
    used = int(hog.message.split("used ")[1].split(" MiB")[0])
    # over the limit, and no more than it held (400 MiB and the interpreter): the watch may catch
    # it while it still touches its pages (a clean clone at 2464e56 read "used 200 MiB, over its
    # limit of 200 MiB", rounded down from just over 200)
    assert 200 < used < 1000, hog.message
    assert _phase(store, "fine") == "Succeeded"
    # what a driver writes is its tenant's alone (umask 077)
    written = run_dir(tmp_path, "team-a", "fine").metrics
    assert written.stat().st_mode & 0o077 == 0, oct(written.stat().st_mode)


def test_sessions_memory_counts_what_a_process_holds(tmp_path: Path) -> None:
    """A second reading of the memory a session uses: a child that holds 300 MiB it has written
    shows at least that, and at most that plus an interpreter's worth."""
    import subprocess

    hold = (
        "import sys, time; b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); "
        "print('ok', flush=True); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", hold], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ok"
        used = sessions_memory([child.pid])[child.pid]
    finally:
        child.kill()
        child.wait()
    assert 300 << 20 <= used < 400 << 20, used / 2**20


@pytest.mark.slow  # over 3 s on 2 idle cores (tests/conftest.py: tiers)
def test_drivers_beyond_the_machine_wide_cap_wait_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    programs = {"one": _FINISH, "two": _FINISH, "three": _FINISH}
    executor, store = _executor(tmp_path, monkeypatch, programs, max_drivers=1)
    seen: list[tuple[str, ...]] = []
    try:
        for name in programs:
            executor.submit(store.create("team-a", name, parse_spec({"steps": 1})))

        def phases() -> tuple[str, ...]:
            now = tuple(_phase(store, n) for n in programs)
            seen.append(now)
            return now

        wait_for(phases, "every job to finish", lambda p: set(p) == {"Succeeded"}, timeout=60, every=0.05)
    finally:
        executor.shutdown()
    # expected: never two at once (Starting or Running), and each started in turn
    for now in seen:
        assert sum(p in ("Starting", "Running") for p in now) <= 1, seen
    assert ("Starting", "Pending", "Pending") in seen or ("Running", "Pending", "Pending") in seen


def test_one_jobs_surprise_does_not_stop_the_watch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    programs = {"broken": _SLEEP, "fine": _FINISH}
    executor, store = _executor(tmp_path, monkeypatch, programs)
    real = executor._observe

    def observe(key: tuple[str, str], r: Any, used: int | None = None) -> None:
        if key[1] == "broken":
            raise RuntimeError("a surprise")
        real(key, r, used)

    monkeypatch.setattr(executor, "_observe", observe)
    try:
        executor.submit(store.create("team-a", "broken", parse_spec({"steps": 1})))
        executor.submit(store.create("team-a", "fine", parse_spec({"steps": 1})))
        wait_for(
            lambda: _phase(store, "fine"), "the other job to finish", lambda p: p == "Succeeded", timeout=30
        )
    finally:
        executor.cancel(store.get("team-a", "broken"))
        executor.shutdown()


def test_the_limits_are_on_by_default() -> None:
    limits = Settings().driver_limits("team-a")
    assert limits.wall_clock_s == 7 * 86400
    assert limits.resident_bytes == auto_resident_mb() * 2**20 > 0
    assert limits.memory_bytes is None  # the hard address-space limit stays opt-in (CUDA)
    assert Settings().max_local_drivers == 4
    # half of what the machine has, read a second way
    total_kib = int(
        next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1]
    )
    assert abs(auto_resident_mb() - total_kib // 2 // 1024) <= 1
    assert auto_cpus() in (0, len(__import__("os").sched_getaffinity(0)) - 1)


def test_a_use_just_over_the_limit_reads_over_it() -> None:
    """Hand-worked: a byte over 200 MiB is 201 MiB rounded up; 300 MiB exactly is 300."""
    limit = 200 << 20
    assert over_memory_message(limit + 1, limit).startswith(
        "the job's processes used 201 MiB, over its limit of 200 MiB (max_resident_mb)"
    )
    assert "used 300 MiB, over its limit of 200 MiB" in over_memory_message(300 << 20, limit)
