"""A tenant's python grader as an attacker: each attack is refused or cut off, the grading goes on,
and nothing outside the sandbox is touched.

1. In the grader sandbox's pool (workers.tasks.sandbox), each attack alone, with what stops it: reading
   another run's files (not in the sandbox's view), a socket to a server listening on this machine's
   loopback (no network), the environment's tokens (none inherited), forking without bound (the
   process limit), allocating 8 GB (the address-space limit), looping or sleeping forever (a timer
   in the process), silencing that timer (the pool's wall clock: the process is replaced), writing
   outside its temporary directory (read-only or absent). After them all the same pool grades a plain sample.
2. Through a real ``fp8rl serve``: ``POST /v1/graders/run`` with a grader that would leave a
   marker in the service's data directory and /tmp if it ran in the control plane leaves none, and
   a real job whose grader tries every attack on every response (and loops forever on every tenth)
   succeeds, its timeouts counted, no attack having succeeded.

bubblewrap comes from ``make tools`` (.ci/tools); without it these fail and say so.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rljob.spec import TaskSpec
from tests.helm.tools import tool
from tests.helpers import tiny_spec, wait_for
from tests.service.servers import serve
from workers.tasks.grading import Graders
from workers.tasks.sandbox import Launcher

ATTACKS = r"""
import json, os, socket, time

def attack(what, target):
    if what == "read_other_run":
        return open(target["other_run"]).read() != ""
    if what == "socket":
        with socket.create_connection(("127.0.0.1", target["port"]), timeout=2) as s:
            return s.recv(16) == b"hello"
    if what == "environment":
        return any("SECRET" in k or "TOKEN" in k for k in os.environ)
    if what == "fork":
        born = 0
        try:
            for _ in range(1000):
                if os.fork() == 0:
                    time.sleep(3)
                    os._exit(0)
                born += 1
        except OSError:
            pass
        return born >= 1000
    if what == "memory":
        block = bytearray(8 << 30)
        return len(block) > 0
    if what == "loop":
        while True:
            pass
    if what == "sleep":
        time.sleep(3600)
    if what == "ignores_the_timer":  # the process's own timer silenced: only the pool can stop it
        import signal
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        while True:
            pass
    if what == "write_outside":
        with open(target["outside"], "w") as f:
            f.write("written")
        return True
    if what == "plain":
        return True
    raise ValueError(what)

def grade(sample, item):
    return 1.0 if attack(sample["output_text"], item) else 0.0
"""


class Listener:
    """A TCP server on 127.0.0.1 that greets whoever connects (and counts them)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.sendall(b"hello")
            conn.close()


@pytest.fixture
def targets(tmp_path: Path) -> Iterator[dict[str, Any]]:
    other = tmp_path / "data" / "runs" / "team-b" / "job"
    other.mkdir(parents=True)
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    listener = Listener()
    yield {
        "other_run": str(other / "metrics.jsonl"),
        "port": listener.port,
        "outside": str(tmp_path / "marker"),
        "listener": listener,
    }
    listener.sock.close()


# the attack, and how it is stopped: "error" (the grader raised: scored 0) or "timeout" (killed);
# "refused": it ran and found nothing (scored 0)
EXPECTED = {
    "read_other_run": "error",  # FileNotFoundError: the run directory is not in the view
    "socket": "error",  # no network: unreachable or refused
    "environment": "refused",  # no variable at all besides PATH, LANG and HOME
    "fork": "refused",  # the process limit stops it well before 1000
    "memory": "error",  # MemoryError under the address-space limit
    "loop": "timeout",  # its time: a timer in the process stops it
    "sleep": "timeout",  # the same timer
    "ignores_the_timer": "timeout",  # the pool's wall clock: the process is killed and replaced
    "write_outside": "error",  # the directory is not there (or read-only)
}


@pytest.mark.slow  # sandboxed processes, timeouts, a real service and job (tests/conftest.py: tiers)
def test_each_attack_is_stopped_and_the_pool_goes_on(
    targets: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FP8RL_TEST_SECRET_TOKEN", "do-not-leak")  # in the environment the pool starts from
    spec = TaskSpec.model_validate(
        {"dataset": "rows.jsonl", "grader": {"type": "python", "source": ATTACKS, "timeout_s": 2}}
    )
    graders = Graders(
        spec.grader_list(),
        lambda a, r: 0.0,
        pool_size=2,
        launcher=Launcher.choose("bwrap", str(tool("bwrap"))),
        max_error_fraction=1.0,
    )

    @dataclass(frozen=True)
    class Row:
        entry: dict[str, Any]
        answer: str = ""

    entry = {k: v for k, v in targets.items() if k != "listener"}
    try:
        for attack, how in EXPECTED.items():
            grades, reports = graders.grade([attack], [Row(entry)])
            report = reports["python"]
            seen = "timeout" if report.timeouts else "error" if report.errors else "refused"
            assert (grades[0].reward, seen) == (0.0, how), (attack, report)
        grades, reports = graders.grade(["plain"], [Row(entry)])
        assert grades[0].reward == 1.0 and not reports["python"].errors  # the pool goes on
        assert graders.pool().restarts == 1  # the one that silenced its timer alone was replaced
    finally:
        graders.close()
    assert not Path(targets["outside"]).exists()
    assert targets["listener"].accepted == 0


MARKER_GRADER = """
import os
def grade(sample, item):
    for path in item["markers"]:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write("ran here")
        except OSError:
            pass
    return 0.5
"""

# every attack on every response, and a loop on every tenth call; TARGETS is put in as JSON text
JOB_GRADER = (
    ATTACKS.split("def grade(")[0]
    + """
CALLS = [0]

def grade(sample, item):
    CALLS[0] += 1
    if CALLS[0] % 10 == 0:
        attack("loop", {})
    target = json.loads(TARGETS)
    for what in ("read_other_run", "socket", "environment", "fork", "memory", "write_outside"):
        try:
            if attack(what, target):
                return 1.0
        except Exception:
            pass
    return 0.25
"""
)


@pytest.mark.slow  # sandboxed processes, timeouts, a real service and job (tests/conftest.py: tiers)
def test_a_real_service_never_runs_grader_code_and_a_hostile_job_succeeds(
    tmp_path: Path, targets: dict[str, Any]
) -> None:
    token = "alice-token-0123456789"
    headers = {"Authorization": f"Bearer {token}"}
    data = tmp_path / "serve"
    data.mkdir()
    markers = [str(data / "data" / "ran-in-control-plane"), f"/tmp/fp8rl-marker-{os.getpid()}"]
    # one pool process, whatever the machine's cores: the grader's call counter is per process
    env = {"FP8RL_TEST_SECRET_TOKEN": "do-not-leak", "FP8RL_GRADER_WORKERS": "1"}
    with serve(data, {token: "team-a"}, env=env) as url:
        r = httpx.post(
            f"{url}/v1/graders/run",
            json={
                "grader": {"type": "python", "source": MARKER_GRADER},
                "item": {"markers": markers},
                "sample": {"output_text": "x"},
            },
            headers=headers,
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["reward"] == 0.5  # it ran: in the sandbox, where the markers went nowhere
        assert [m for m in markers if Path(m).exists()] == []

        entry = {k: v for k, v in targets.items() if k != "listener"}
        source = JOB_GRADER.replace("TARGETS)", f"{json.dumps(json.dumps(entry))})")
        spec = tiny_spec(steps=3, rollout={"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 2})
        spec["task"] = {
            **spec["task"],
            "grader": {"type": "python", "source": source, "timeout_s": 1},
        }
        r = httpx.post(f"{url}/v1/jobs", json={"name": "hostile", "spec": spec}, headers=headers, timeout=30)
        assert r.status_code == 201, r.text
        done = wait_for(
            lambda: httpx.get(f"{url}/v1/jobs/hostile", headers=headers).json()["status"],
            "the hostile job to end",
            lambda s: s["phase"] in ("Succeeded", "Failed"),
            timeout=300,
        )
        log = httpx.get(f"{url}/v1/jobs/hostile/logs", headers=headers, timeout=30).text
        assert done["phase"] == "Succeeded", (done, log[-3000:])
        rows = httpx.get(f"{url}/v1/jobs/hostile/metrics", headers=headers, timeout=30).json()
    steps = [row for row in rows if row.get("step", 0) >= 1]
    assert len(steps) == 3
    # 16 responses a step, every tenth grading call loops: calls 10, 20, 30 and 40 of 48 time out,
    # and every other response scored 0.25 (no attack succeeded: one that did would score 1)
    assert sum(row["grader/python/timeouts"] for row in steps) == 4
    assert all(row["reward/python/mean"] <= 0.25 for row in steps)
    assert "graders' code runs in a pool of 1 Ray actors" in log and "bubblewrap" in log
    assert not Path(targets["outside"]).exists() and targets["listener"].accepted == 0
    assert [m for m in markers if Path(m).exists()] == []
