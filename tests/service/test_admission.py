"""A job submitted over REST cannot reach outside its tenant: files its driver would open, and sizes.

Each path field is tried with an absolute path outside, ``..``, a symlink that leads out, another
tenant's run files, and a valid relative path; the refused ones are 422 naming the field, and the
service opens no file while deciding (an audit hook watches every ``open``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rljob import parse_spec
from rljob.paths import POD_HOME, path_problems, tenant_home
from rljob.run_dir import RunDir
from service.local_executor import LocalExecutor
from service.main import create_app
from service.settings import Settings
from service.store import SqlJobStore
from tests.helpers import wait_for

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"
TOKENS = {ALICE: "team-a", BOB: "team-b"}
FIELDS = ("task.dataset", "task.validation_dataset", "task.grader.file", "model.name", "tokenizer.name")

_opened: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and args and isinstance(args[0], str | bytes | os.PathLike):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # hooks cannot be removed; this one only records paths


def spec_with(field: str, value: str) -> dict[str, Any]:
    """A job spec that names ``value`` in ``field`` (and is valid otherwise)."""
    if field == "task.dataset":
        return {"task": {"dataset": value}}
    if field == "task.validation_dataset":
        return {"task": {"dataset": "ok.jsonl", "validation_dataset": value}}
    if field == "task.grader.file":  # a python grader's source file
        return {"task": {"dataset": "ok.jsonl", "grader": {"type": "python", "file": value}}}
    if field == "model.name":
        return {"model": {"name": value, "pretrained": False}, "tokenizer": {"kind": "bytes"}}
    return {"tokenizer": {"kind": "huggingface", "name": value}}


@pytest.fixture
def setup(tmp_path: Path) -> tuple[TestClient, Path, Path]:
    data = tmp_path / "data"
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.jsonl"
    secret.write_text('{"question": "1+1", "answer": "2"}\n')
    home = data / "tenants" / "team-a"
    home.mkdir(parents=True)
    (home / "ok.jsonl").write_text('{"question": "2+2", "answer": "4"}\n')
    (home / "out-link.jsonl").symlink_to(secret)
    (data / "runs" / "team-b" / "job").mkdir(parents=True)
    (data / "runs" / "team-b" / "job" / "metrics.jsonl").write_text("{}\n")
    shared = tmp_path / "shared-models"
    shared.mkdir()
    settings = Settings(
        data_dir=data, max_concurrent_jobs=100, model_roots=str(shared), allow_unsandboxed_graders=True
    )
    return TestClient(create_app(settings, tokens=TOKENS)), data, secret


def post(api: TestClient, name: str, spec: dict[str, Any]) -> Any:
    return api.post(
        "/v1/jobs", json={"name": name, "spec": spec}, headers={"Authorization": f"Bearer {ALICE}"}
    )


@pytest.mark.parametrize("field", FIELDS)
def test_paths_outside_the_tenant_are_refused_without_opening_them(
    field: str, setup: tuple[TestClient, Path, Path]
) -> None:
    api, data, secret = setup
    refused = {
        "absolute": str(secret),
        "dotdot": "../../../outside/secret.jsonl",
        "symlink": "out-link.jsonl",  # inside the home, leading out
        "other-tenant": str(data / "runs" / "team-b" / "job" / "metrics.jsonl"),
        "other-tenant-relative": "../team-b/x.jsonl",
        "etc": "/etc/passwd",
    }
    _opened.clear()
    for i, (what, value) in enumerate(refused.items()):
        r = post(api, f"j{i}", spec_with(field, value))
        assert r.status_code == 422, (what, r.text)
        [error] = r.json()["errors"]
        assert error["field"] == f"spec.{field}", (what, error)
        assert "leads outside the tenant's files" in error["message"]
        # the tenant's directory is named without the service's host directories in it
        told = error["message"].replace(value, "")  # less the path the tenant sent
        assert "<data-dir>/tenants/team-a" in told and str(data) not in told
    assert not any(str(secret) in p or "passwd" in p or "team-b" in p for p in _opened), _opened
    # the same message whether the file exists or not: it tells the tenant nothing
    a = post(api, "x1", spec_with(field, "/nonexistent/file.jsonl")).json()["errors"][0]["message"]
    b = post(api, "x2", spec_with(field, str(secret))).json()["errors"][0]["message"]
    assert a.replace("/nonexistent/file.jsonl", "P") == b.replace(str(secret), "P")


@pytest.mark.parametrize("field", FIELDS)
def test_relative_paths_and_shared_roots_are_accepted(
    field: str, setup: tuple[TestClient, Path, Path]
) -> None:
    api, data, _ = setup
    shared = data.parent / "shared-models" / "llama"
    for i, value in enumerate(["ok.jsonl", "sub/dir/../ok.jsonl", str(shared)]):
        r = post(api, f"ok{i}", spec_with(field, value))
        assert r.status_code == 201, (value, r.text)
    if field in (
        "model.name",
        "tokenizer.name",
    ):  # a Hugging Face id is a relative path too: home first, then the hub
        assert post(api, "hub", spec_with(field, "Qwen/Qwen2.5-1.5B")).status_code == 201


def test_size_caps_per_tenant(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        max_concurrent_jobs=100,
        max_new_tokens=4096,
        tenant_limits={"team-b": {"max_problems": 500, "max_actors": 3}},
    )
    api = TestClient(create_app(settings, tokens=TOKENS))
    r = post(api, "long", {"rollout": {"max_new_tokens": 8192}})
    assert r.status_code == 422
    [error] = r.json()["errors"]
    assert (
        error["field"] == "spec.rollout.max_new_tokens"
        and "limit of 4096 (max_new_tokens)" in error["message"]
    )
    assert post(api, "ok", {"rollout": {"max_new_tokens": 4096}}).status_code == 201
    bob = {"Authorization": f"Bearer {BOB}"}
    r = api.post("/v1/jobs", json={"name": "big", "spec": {"task": {"size": 501}}}, headers=bob)
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "spec.task.size"
    spec = {"task": {"size": 100}, "resources": {"trainers": 2, "generators": 2}}
    r = api.post("/v1/jobs", json={"name": "wide", "spec": spec}, headers=bob)
    [error] = r.json()["errors"]
    assert r.status_code == 422 and error["field"] == "spec.resources.trainers"
    assert "is 4, over tenant 'team-b''s limit of 3 (max_actors)" in error["message"]
    assert (
        api.post("/v1/jobs", json={"name": "fits", "spec": {"task": {"size": 500}}}, headers=bob).status_code
        == 201
    )
    # validation problems count: 400 training + 101 held out > 500
    spec2 = {"task": {"size": 400}, "validation": {"interval": 5, "size": 101}}
    assert api.post("/v1/jobs", json={"name": "val", "spec": spec2}, headers=bob).status_code == 422


def test_kubernetes_paths_are_checked_as_text_under_data() -> None:
    ok = parse_spec({"model": {"name": "Qwen/Qwen2.5-1.5B"}, "tokenizer": {"kind": "huggingface"}})
    assert path_problems(ok, POD_HOME, ["/models"], resolve=False) == []
    shared = parse_spec({"model": {"name": "/models/llama-8b"}, "tokenizer": {"kind": "huggingface"}})
    assert path_problems(shared, POD_HOME, ["/models"], resolve=False) == []
    bad = parse_spec({"task": {"dataset": "/data/../etc/passwd"}})
    [problem] = path_problems(bad, POD_HOME, ["/models"], resolve=False)
    assert problem.field == "task.dataset" and "/data" in problem.message


def test_the_driver_runs_in_the_tenant_home_and_a_late_symlink_fails_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[dict[str, Any]] = []

    class FakePopen:
        pid = 2**22 + 17  # no such process: confining it changes nothing here

        def __init__(self, cmd: list[str], **kwargs: Any) -> None:
            started.append(kwargs)

    monkeypatch.setattr("service.driver_process.subprocess.Popen", FakePopen)
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    executor = LocalExecutor(store, tmp_path)
    job = store.create("team-a", "j", parse_spec({"task": {"dataset": "mine.jsonl"}}))
    executor.submit(job)
    assert started[0]["cwd"] == tenant_home(tmp_path, "team-a") and started[0]["start_new_session"]
    # a symlink made after the POST, leading out: refused when the driver would start
    (tenant_home(tmp_path, "team-a") / "late.jsonl").symlink_to("/etc/passwd")
    late = store.create("team-a", "late", parse_spec({"task": {"dataset": "late.jsonl"}}))
    executor.submit(late)
    assert len(started) == 1
    status = store.get("team-a", "late").status
    assert status.phase.value == "Failed" and status.reason == "PathOutsideTenant"


# Stand-ins for the driver (a real one starts Ray and trains for minutes): the first allocates
# 1 GiB as a runaway job would and exits as the driver does on MemoryError; the second finishes.
# The hog waits (30 s at most) until the service, right after starting it, has set its limit.
_HOG = """
import resource, sys, time
deadline = time.monotonic() + 30
while resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY and time.monotonic() < deadline:
    time.sleep(0.01)
try:
    hog = bytearray(1 << 30)
except MemoryError:
    print("error: out of memory", flush=True)
    sys.exit(3)
"""
_FINISH = """
import json, sys, time
time.sleep(1.0)
open(sys.argv[1], "w").write(json.dumps({"step": 1, "reward/mean": 0.5}) + "\\n")
"""


def test_a_job_over_its_memory_limit_fails_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rljob.status import EXIT_OUT_OF_MEMORY

    def command(run: RunDir, job: Any, resume: bool) -> list[str]:
        code = _HOG if job.tenant == "team-a" else _FINISH
        return [sys.executable, "-c", code, str(run.metrics)]

    monkeypatch.setattr("service.local_executor.driver_command", command)
    settings = Settings(data_dir=tmp_path, max_memory_mb=0, tenant_limits={"team-a": {"max_memory_mb": 256}})
    assert settings.driver_limits("team-a").memory_bytes == 256 * 2**20
    assert settings.driver_limits("team-b").memory_bytes is None
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    executor = LocalExecutor(store, tmp_path, poll_s=0.1, limits=settings.driver_limits)
    executor.start()
    try:
        executor.submit(store.create("team-a", "hog", parse_spec({"steps": 1})))
        executor.submit(store.create("team-b", "fine", parse_spec({"steps": 1})))
        jobs = [("team-a", "hog"), ("team-b", "fine")]
        wait_for(
            lambda: {n: store.get(t, n).status.phase.value for t, n in jobs},
            "both jobs to end",
            lambda phases: not {"Pending", "Starting", "Running"} & set(phases.values()),
        )
    finally:
        executor.shutdown()
    hog, fine = store.get("team-a", "hog").status, store.get("team-b", "fine").status
    assert hog.phase.value == "Failed" and hog.reason == "OutOfMemory", hog
    assert "256 MiB (max_memory_mb)" in hog.message
    assert fine.phase.value == "Succeeded", fine
    assert EXIT_OUT_OF_MEMORY == 3


def test_the_driver_exits_with_the_out_of_memory_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rljob.status import EXIT_OUT_OF_MEMORY
    from workers.job import driver

    def runaway(*args: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(driver, "run", runaway)
    spec = tmp_path / "job.yaml"
    spec.write_text("steps: 1\n")
    assert driver.main([str(spec), "--output", str(tmp_path / "out")]) == EXIT_OUT_OF_MEMORY


# waits (30 s at most) until the service has confined it, then reports what it was given
_REPORT = """
import json, os, sys, time
deadline = time.monotonic() + 30
def confined():  # niceness no longer the parent's (the service, in this test process), one CPU
    parents = os.getpriority(os.PRIO_PROCESS, os.getppid())
    return os.getpriority(os.PRIO_PROCESS, 0) != parents and len(os.sched_getaffinity(0)) == 1
while not confined() and time.monotonic() < deadline:
    time.sleep(0.01)
report = {"cpus": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0)}
open(sys.argv[1], "w").write(json.dumps(report))
"""


def test_drivers_get_their_cpus_and_a_lower_priority(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    def command(run: RunDir, job: Any, resume: bool) -> list[str]:
        return [sys.executable, "-c", _REPORT, str(run.root / "report.json")]

    monkeypatch.setattr("service.local_executor.driver_command", command)
    settings = Settings(data_dir=tmp_path, max_cpus=1, driver_nice=7)
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    executor = LocalExecutor(store, tmp_path, limits=settings.driver_limits)
    executor.submit(store.create("team-a", "j", parse_spec({"steps": 1})))
    report = tmp_path / "runs" / "team-a" / "j" / "report.json"
    text = wait_for(
        lambda: report.read_text() if report.exists() else "", "the stand-in's report", timeout=60
    )
    seen = json.loads(text)
    assert len(seen["cpus"]) == 1 and seen["cpus"][0] in os.sched_getaffinity(0)
    assert seen["nice"] == 7 + os.getpriority(os.PRIO_PROCESS, 0)  # relative to this process's own
