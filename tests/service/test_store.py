"""``SqlJobStore``: group commit (many writes, one commit, each answered only once committed),
a failed write alone vs a failed commit, the index the tenant limits are counted from, and jobs
acknowledged with 201 that survive a SIGKILL of the service."""

from __future__ import annotations

import functools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from rljob.jobs import Job, JobExists, JobNotFound, Limits, OverLimit
from rljob.spec import JobSpec
from rljob.status import IllegalTransition, JobStatus, Phase
from service.store import SqlJobStore
from tests.helpers import wait_for
from tests.service.servers import free_port


def _hold_writer(store: SqlJobStore) -> threading.Event:
    """Keep the writer busy inside a commit until the returned event is set."""
    entered, release = threading.Event(), threading.Event()

    def busy(db: sqlite3.Connection) -> None:
        entered.set()
        release.wait(30)

    threading.Thread(target=store._write, args=(busy,), daemon=True).start()
    assert entered.wait(10)
    return release


def _in_one_group(store: SqlJobStore, calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each call in a thread of its own while the writer is held, so that all their writes queue,
    in the order given, for the same group commit; then release it. Each call's result, or the
    exception it raised."""
    release = _hold_writer(store)
    results: dict[str, Any] = {}

    def attempt(key: str, call: Callable[[], Any]) -> None:
        try:
            results[key] = call()
        except Exception as err:
            results[key] = err

    threads = [threading.Thread(target=attempt, args=kv, daemon=True) for kv in calls.items()]
    for queued, t in enumerate(threads, 1):
        t.start()
        wait_for(store._writes.qsize, f"{queued} writes queued", queued.__eq__, timeout=10, every=0.01)
    release.set()
    for t in threads:
        t.join(10)
    return results


def test_writes_waiting_during_a_commit_share_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    commits: list[int] = []  # statements COMMIT ran, counted on the writer's connection
    store._db.set_trace_callback(lambda sql: commits.append(1) if sql == "COMMIT" else None)
    release = _hold_writer(store)
    answered: list[str] = []
    threads = [
        threading.Thread(target=lambda i=i: answered.append(store.create("t", f"j{i}", JobSpec()).name))
        for i in range(20)
    ]
    for t in threads:
        t.start()
    wait_for(store._writes.qsize, "20 writes queued", lambda n: n == 20, timeout=10, every=0.01)
    assert answered == []  # nobody is answered before their commit
    release.set()
    for t in threads:
        t.join(10)
    assert sorted(answered) == sorted(f"j{i}" for i in range(20))
    assert len(commits) == 2  # the held one, then one for all 20
    assert store.query("t", limit=100)[1] == 20


def test_a_refused_write_fails_alone_and_a_database_error_fails_its_group(tmp_path: Path) -> None:
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    store.create("t", "taken", JobSpec())
    calls: dict[str, Callable[[], Any]] = {
        "new": lambda: store.create("t", "new", JobSpec()).name,
        "dup": lambda: store.create("t", "taken", JobSpec()),
        "illegal": lambda: store.update("t", "taken", lambda s: s.moved(Phase.SUCCEEDED, "x")),
        "missing": lambda: store.delete("t", "nope"),
    }
    results = _in_one_group(store, calls)
    assert results["new"] == "new"
    assert isinstance(results["dup"], JobExists)
    assert isinstance(results["illegal"], IllegalTransition)  # Pending cannot jump to Succeeded
    assert isinstance(results["missing"], JobNotFound)
    assert store.get("t", "taken").status == JobStatus()  # the refused update changed nothing

    # a write that fails in the database rolls back the writes committed with it
    results = _in_one_group(  # fine first: its insert has run when broken's fails
        store,
        {
            "fine": lambda: store.create("t", "fine", JobSpec()),
            "broken": lambda: store._write(lambda db: db.execute("INSERT INTO nope VALUES (1)")),
        },
    )
    assert isinstance(results["broken"], sqlite3.OperationalError)
    assert isinstance(results["fine"], sqlite3.OperationalError)  # not acknowledged...
    with pytest.raises(JobNotFound):
        store.get("t", "fine")  # ...and not there
    store.close()


def test_tenant_usage_is_counted_from_the_index_alone(tmp_path: Path) -> None:
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    two_trainers = {"gpus_per_generator": 1, "trainers": 2, "gpus_per_trainer": 1}
    gpu = JobSpec.model_validate({"resources": two_trainers})
    for name, spec in (("a", gpu), ("b", gpu), ("c", JobSpec())):
        store.create("t", name, spec)
    store.create("u", "other", gpu)
    store.update("t", "b", lambda s: s.moved(Phase.CANCELLED, "UserCancelled"))
    # active: a (1 generator x 1 + 2 trainers x 1 = 3 GPUs) and c (0)
    assert store.usage("t") == (2, 3)
    plan = " ".join(
        str(r[-1])
        for r in store._db.execute(
            "EXPLAIN QUERY PLAN SELECT COUNT(*), COALESCE(SUM(gpus), 0) FROM jobs "
            "WHERE tenant = ? AND phase IN (?, ?, ?)",
            ["t", "Pending", "Starting", "Running"],
        )
    )
    assert "COVERING INDEX jobs_usage" in plan, plan  # no row, spec JSON and all, is read
    store.close()


def test_concurrent_creates_never_take_a_tenant_over_its_limits(tmp_path: Path) -> None:
    """Five creates queued while a commit is on disk land in one group; the limits are counted
    inside it, so the tenant ends at its cap (a check before queueing would have let all five in)."""
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    store.create("t", "old", JobSpec())  # 1 active job, no GPUs (the default runs on CPU)
    gpu = JobSpec.model_validate({"resources": {"trainers": 3, "gpus_per_trainer": 1}})
    for limits, spec, wanted_ok in ((Limits(jobs=4, gpus=99), JobSpec(), 3), (Limits(99, 7), gpu, 2)):
        before = store.usage("t")[0]
        names = [f"j{before}-{i}" for i in range(5)]
        calls: dict[str, Callable[[], Any]] = {
            name: functools.partial(store.create, "t", name, spec, limits) for name in names
        }
        results = _in_one_group(store, calls)
        assert all(isinstance(r, Job | OverLimit) for r in results.values()), results
        outcomes = ["created" if isinstance(r, Job) else str(r) for r in results.values()]
        assert outcomes.count("created") == wanted_ok, outcomes
        refused = [o for o in outcomes if o != "created"]
        assert len(refused) == 5 - wanted_ok
        if limits.jobs == 4:  # 1 old + 3 new = 4 active jobs
            assert store.usage("t")[0] == 4
            assert all("already has 4 active jobs (limit 4)" in o for o in refused), refused
        else:  # two new jobs of 3 GPUs: 6 of 7, and a third would make 9
            assert store.usage("t") == (6, 6)
            assert all("asks for 3 GPUs and tenant 't' uses 6 of 7" in o for o in refused), refused
    store.close()


_SERVER = """
import sys
from pathlib import Path
import uvicorn
from service.main import create_app
from service.settings import Settings
port, data = int(sys.argv[1]), Path(sys.argv[2])
app = create_app(Settings(data_dir=data, max_concurrent_jobs=10**6), tokens={"kill-token-0123456789": "t"})
uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")
"""


def test_every_job_answered_201_survives_a_sigkill_of_the_service(tmp_path: Path) -> None:
    """Twenty clients create jobs as fast as they can; the service is SIGKILLed while requests are
    in flight, with no time to flush or close anything. Every job that got its 201 is in the
    database a new store opens."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), str(tmp_path)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(url), "the service to answer", timeout=60, every=0.1)
        acknowledged: list[str] = []
        stop = threading.Event()

        def client(c: int) -> None:
            headers = {"Authorization": "Bearer kill-token-0123456789"}
            with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
                for i in range(100_000):
                    if stop.is_set():
                        return
                    try:
                        r = http.post("/v1/jobs", json={"name": f"c{c}-{i}"})
                    except httpx.HTTPError:
                        return  # the service is gone
                    if r.status_code == 201:
                        acknowledged.append(r.json()["name"])

        threads = [threading.Thread(target=client, args=(c,)) for c in range(20)]
        for t in threads:
            t.start()
        wait_for(
            lambda: len(acknowledged), "200 jobs acknowledged", lambda n: n >= 200, timeout=120, every=0.01
        )
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        stop.set()
        for t in threads:
            t.join(30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    jobs, total = SqlJobStore(tmp_path / "jobs.sqlite").query("t", limit=1_000_000)
    kept = {j.name for j in jobs}
    lost = sorted(set(acknowledged) - kept)
    assert not lost, f"{len(lost)} of {len(acknowledged)} acknowledged jobs lost: {lost[:5]}"
    assert total >= len(acknowledged)  # some may be committed without their answer getting out
    print(json.dumps({"acknowledged": len(acknowledged), "kept": total}))


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz").status_code == 200
    except httpx.HTTPError:
        return False
