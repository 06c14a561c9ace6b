"""Local drivers in the bubblewrap sandbox (``service.sandbox``): a driver sees its own run
directory, its tenant's directory and cache, the read-only roots it was granted, and nothing of the
service: no tokens file, no database, no other tenant's files, no process of the service (so not
its environment), no Hugging Face token stored in the service's home.

The hostile driver here is a Python program put where the driver's command goes (as in
tests/service/test_admission.py), run by the real executor in the real sandbox; it tries each
read and write and reports what happened. A real tiny job also runs in the sandbox end to end,
with a suspend (a signal through the sandbox) and a resume.

bubblewrap comes from ``make tools`` (.ci/tools: Debian's package); without it these fail and say
so, as the chart tests do without helm.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from rljob import parse_spec
from rljob.run_dir import RunDir
from service.local_executor import LocalExecutor
from service.local_runs import run_dir
from service.sandbox import Sandbox
from service.store import SqlJobStore
from tests.helm.tools import tool
from tests.helpers import tiny_spec, wait_for

pytestmark = pytest.mark.slow

_PROBE = r"""
import json, os, sys
from pathlib import Path
out, targets = Path(sys.argv[1]), json.loads(sys.argv[2])
seen = {}
for name, path in targets["read"].items():
    try:
        Path(path).read_bytes()
        seen[name] = "read"
    except OSError as err:
        seen[name] = type(err).__name__
for name, path in targets["write"].items():
    try:
        Path(path).write_text("x")
        seen[name] = "written"
    except OSError as err:
        seen[name] = type(err).__name__
pids = [p for p in os.listdir("/proc") if p.isdigit()]
seen["pids"] = len(pids)
seen["service_pid_visible"] = str(targets["service_pid"]) in pids
seen["env"] = {k: os.environ.get(k) for k in ("HOME", "HF_HOME", "HF_TOKEN", "FP8RL_SECRET_PROBE")}
out.write_text(json.dumps(seen))
"""


def _probe(
    data: Path, shared: Path, targets: dict[str, Any], monkeypatch: pytest.MonkeyPatch, bwrap: str
) -> dict[str, Any]:
    """Run ``_PROBE`` as team-a's driver, sandboxed with ``shared`` as a read-only root, on
    ``targets``; what it reported."""

    def command(run: RunDir, job: Any, resume: bool) -> list[str]:
        return [sys.executable, "-c", _PROBE, str(run.root / "seen.json"), json.dumps(targets)]

    monkeypatch.setattr("service.local_executor.driver_command", command)
    store = SqlJobStore(data / "jobs.sqlite")
    sandbox = Sandbox.choose("bwrap", bwrap, [shared])
    executor = LocalExecutor(store, data, poll_s=0.1, read_only=[shared], sandbox=sandbox, driver_retries=0)
    executor.start()
    try:
        executor.submit(store.create("team-a", "probe", parse_spec({"steps": 1})))
        seen_file = run_dir(data, "team-a", "probe").root / "seen.json"
        wait_for(seen_file.exists, "the probe to report", timeout=60)
    finally:
        executor.shutdown()
    seen: dict[str, Any] = json.loads(seen_file.read_text())
    return seen


@pytest.fixture
def bwrap() -> str:
    return str(tool("bwrap"))


def test_a_hostile_driver_sees_nothing_of_the_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bwrap: str
) -> None:
    data = tmp_path / "data"
    shared = tmp_path / "shared-models"
    shared.mkdir()
    (shared / "weights.bin").write_text("shared")
    tokens = tmp_path / "tokens.json"
    tokens.write_text('{"secret-token": "team-a"}')
    service_home = tmp_path / "service-home"
    (service_home / "huggingface").mkdir(parents=True)
    (service_home / "huggingface" / "token").write_text("hf_service_token")
    monkeypatch.setenv("HF_HOME", str(service_home / "huggingface"))  # the service's own cache
    monkeypatch.setenv("FP8RL_SECRET_PROBE", "service-only")
    other = data / "runs" / "team-b" / "theirs"
    other.mkdir(parents=True)
    (other / "metrics.jsonl").write_text("{}")
    (data / "tenants" / "team-a").mkdir(parents=True)
    (data / "tenants" / "team-a" / "mine.jsonl").write_text("{}")
    SqlJobStore(data / "jobs.sqlite").close()  # the service's database, one of the targets
    targets = {
        "read": {
            "tokens": str(tokens),
            "database": str(data / "jobs.sqlite"),
            "other_tenant_run": str(other / "metrics.jsonl"),
            "service_hf_token": str(service_home / "huggingface" / "token"),
            "service_environ": f"/proc/{os.getpid()}/environ",
            "own_home": str(data / "tenants" / "team-a" / "mine.jsonl"),
            "shared_root": str(shared / "weights.bin"),
        },
        "write": {
            "other_tenant": str(other / "planted"),
            "shared_root_write": str(shared / "planted"),
            "own_home_write": str(data / "tenants" / "team-a" / "out.txt"),
        },
        "service_pid": os.getpid(),
    }

    seen = _probe(data, shared, targets, monkeypatch, bwrap)
    # expected: every file of the service or another tenant absent from its view
    for name in ("tokens", "database", "other_tenant_run", "service_hf_token", "service_environ"):
        assert seen[name] in ("FileNotFoundError", "PermissionError"), (name, seen)
    assert seen["other_tenant"] in ("FileNotFoundError", "PermissionError", "OSError"), seen
    assert seen["shared_root_write"].endswith("Error"), seen  # read-only: not written
    # and its own files and the granted root readable, its home writable
    assert seen["own_home"] == "read" and seen["shared_root"] == "read", seen
    assert seen["own_home_write"] == "written", seen
    assert seen["pids"] < 10 and not seen["service_pid_visible"], seen
    assert seen["env"]["HF_TOKEN"] is None
    env = seen["env"]
    assert env["HOME"] == str(data / "cache" / "team-a") and env["HF_HOME"].startswith(env["HOME"])
    assert env["FP8RL_SECRET_PROBE"] is None
    assert (data / "tenants" / "team-a" / "out.txt").read_text() == "x"
    assert not (other / "planted").exists() and not (shared / "planted").exists()


def test_a_sandboxed_read_of_files_under_tmp_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bwrap: str
) -> None:
    """Granted files under /tmp (where a sandbox mounts a fresh /tmp) stay readable."""
    data, shared = tmp_path / "data", tmp_path / "shared"
    shared.mkdir()
    (shared / "w.bin").write_text("w")
    (data / "tenants" / "team-a").mkdir(parents=True)
    (data / "tenants" / "team-a" / "mine.jsonl").write_text("{}")
    targets = {
        "read": {
            "own_home": str(data / "tenants" / "team-a" / "mine.jsonl"),
            "shared": str(shared / "w.bin"),
        },
        "write": {},
        "service_pid": os.getpid(),
    }

    seen = _probe(data, shared, targets, monkeypatch, bwrap)
    assert seen["own_home"] == "read" and seen["shared"] == "read", seen


def test_a_real_job_runs_suspends_and_resumes_in_the_sandbox(tmp_path: Path, bwrap: str) -> None:
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    executor = LocalExecutor(
        store, tmp_path, poll_s=0.2, sandbox=Sandbox.choose("bwrap", bwrap, []), driver_retries=0
    )
    executor.start()
    get = lambda: store.get("team-a", "job").status  # noqa: E731
    try:
        executor.submit(
            store.create("team-a", "job", parse_spec(tiny_spec(steps=40, checkpoint_interval=100)))
        )
        wait_for(get, "step 2", lambda s: s.progress.step >= 2, timeout=240)
        job = store.update(
            "team-a", "job", lambda s: s.moved(s.phase.SUSPENDED, "UserSuspended", "", "suspend")
        )
        executor.suspend(job)  # SIGINT to the driver inside the sandbox, not to bubblewrap
        log = run_dir(tmp_path, "team-a", "job").driver_log
        wait_for(
            lambda: "stopped after step" in log.read_text(), "the driver to stop after its step", timeout=120
        )
        job = store.update("team-a", "job", lambda s: s.moved(s.phase.PENDING, "UserResumed", "", "resume"))
        executor.resume(job)
        done = wait_for(get, "success", lambda s: s.phase.value in ("Succeeded", "Failed"), timeout=240)
    finally:
        executor.shutdown()
    assert done.phase.value == "Succeeded", (done, log.read_text()[-2000:])
    assert "resumed from" in log.read_text()


def test_without_bubblewrap_auto_runs_unsandboxed_and_says_so() -> None:
    sandbox = Sandbox.choose("auto", "no-such-bwrap-program", [])
    assert sandbox.bwrap is None
    assert "WITHOUT a sandbox" in sandbox.describe() and "not installed" in sandbox.describe()
    from service.sandbox import SandboxUnavailable

    with pytest.raises(SandboxUnavailable, match="FP8RL_SANDBOX=bwrap"):
        Sandbox.choose("bwrap", "no-such-bwrap-program", [])
