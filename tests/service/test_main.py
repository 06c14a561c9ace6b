"""The composition root (``service.main.create_app``): with ``run_jobs`` (what ``fp8rl serve`` asks)
the app builds the executor the settings name, starts it before it serves (a job left Pending by a
previous process is started) and shuts it down after, and opens the metrics port as long; without,
jobs are only recorded."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from rljob.run_dir import RunDir
from rljob.spec import parse_spec
from rljob.status import Phase
from service.local_executor import LocalExecutor
from service.main import create_app
from service.settings import Settings
from service.store import SqlJobStore
from tests.helpers import wait_for

TOKEN = "main-token-0123456789"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
# a stand-in driver: one metrics line for step 1, then exit 0
_FINISH = """
import json, sys
open(sys.argv[1], "w").write(json.dumps({"step": 1, "reward/mean": 0.5}) + "\\n")
"""


def test_serving_runs_the_jobs_with_the_settings_executor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def command(run: RunDir, job: Any, resume: bool) -> list[str]:
        return [sys.executable, "-c", _FINISH, str(run.metrics)]

    monkeypatch.setattr("service.local_executor.driver_command", command)
    calls: list[str] = []
    for method in ("start", "shutdown"):
        original = getattr(LocalExecutor, method)

        def recorded(self: LocalExecutor, method: str = method, original: Any = original) -> None:
            calls.append(method)
            original(self)

        monkeypatch.setattr(LocalExecutor, method, recorded)
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    store.create("team-a", "left", parse_spec({"steps": 1}))  # recorded before this process started
    settings = Settings(data_dir=tmp_path, metrics_port=0)  # 0: any free port
    app = create_app(settings, store, {TOKEN: "team-a"}, run_jobs=True)
    executor = app.state.executor
    assert isinstance(executor, LocalExecutor) and executor.data_dir == tmp_path
    assert store.get("team-a", "left").status.phase is Phase.PENDING  # nothing runs before it serves
    with TestClient(app) as api:
        assert calls == ["start"]
        metrics = f"http://127.0.0.1:{app.state.metrics_port}/metrics"  # open as long as the app
        assert re.search(
            r'^fp8rl_jobs\{namespace="team-a",phase="\w+"\} 1\.0$', httpx.get(metrics).text, re.M
        )
        created = api.post("/v1/jobs", json={"name": "new", "spec": {"steps": 1}}, headers=HEADERS)
        assert created.status_code == 201

        def phases() -> dict[str, str]:
            return {
                n: api.get(f"/v1/jobs/{n}", headers=HEADERS).json()["status"]["phase"]
                for n in ("left", "new")
            }

        seen = wait_for(
            phases, "both jobs to end", lambda p: set(p.values()) <= {"Succeeded", "Failed"}, timeout=60
        )
        assert seen == {"left": "Succeeded", "new": "Succeeded"}
    assert calls == ["start", "shutdown"]  # once each, with the app
    with pytest.raises(httpx.ConnectError):
        httpx.get(metrics)


def test_without_run_jobs_the_app_only_records(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path), tokens={TOKEN: "team-a"})
    assert app.state.executor is None
    with TestClient(app) as api:
        assert (
            api.post("/v1/jobs", json={"name": "j", "spec": {"steps": 1}}, headers=HEADERS).status_code == 201
        )
        assert api.get("/v1/jobs/j", headers=HEADERS).json()["status"]["phase"] == "Pending"
    assert (tmp_path / "jobs.sqlite").exists()  # the store the settings name


def test_a_relative_data_dir_gives_drivers_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--data-dir fp8rl-data`` (the default) names the directory under the service's working
    directory; drivers run in the tenant's directory, so the paths they get must be absolute or
    they name files that are not there."""
    from service.local_runs import driver_command, run_dir

    monkeypatch.chdir(tmp_path)
    settings = Settings(data_dir=Path("fp8rl-data"))
    assert settings.data_dir == tmp_path / "fp8rl-data"
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    job = store.create("team-a", "rel", parse_spec({"steps": 1}))
    app = create_app(settings, store, {TOKEN: "team-a"}, run_jobs=True)
    argv = driver_command(run_dir(app.state.executor.data_dir, "team-a", "rel"), job, resume=False)
    spec_file, output = argv[3], argv[argv.index("--output") + 1]
    assert spec_file == str(tmp_path / "fp8rl-data" / "runs" / "team-a" / "rel" / "job.json")
    assert output == str(tmp_path / "fp8rl-data" / "runs" / "team-a" / "rel")
