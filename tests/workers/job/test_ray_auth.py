"""Ray's token authentication, on real Ray processes (no fakes): what every job's Ray cluster
relies on (docs/deploy.md, "Security model").

- A Ray head started as the operator's job pods start it (``RAY_AUTH_MODE=token`` and
  ``RAY_AUTH_TOKEN`` in its environment): its Jobs API (the dashboard port a RayJob exposes)
  refuses a submission without the token (401) or with another token (403), and accepts one with
  it; ``ray job submit`` (the submitter of ``ray_auth: secret``) submits with the token from its
  environment; the driver the job runs inherits the token and joins the cluster.
- ``fp8rl run`` (``workers.job.ray_cluster.ray_init``) starts its local Ray with token auth on, says
  so without Ray's warning, and runs tasks.

Each cluster runs under a temporary directory of its own and is stopped by signalling the one
process that started it (``ray start --block`` stops what it started on SIGTERM), never with
``ray stop``, which would stop every Ray on this machine.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil  # type: ignore[import-untyped]  # a dependency of ray
import pytest

pytestmark = pytest.mark.slow

RAY = Path(sys.executable).with_name("ray")
ENABLED_WARNING = "Token authentication is enabled for this Ray cluster"


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports nothing listens on now (bound together, so no two are equal)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without Ray's auth and address variables, plus ``extra``."""
    drop = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def stop_processes_under(root: str) -> None:
    """Kill what is left of a cluster: the processes whose command line names ``root`` (this
    test's own temporary directory, so no other Ray on the machine matches)."""
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(root in part for part in proc.info["cmdline"] or []):
                proc.kill()
        except psutil.Error:
            pass


class Head:
    """A Ray head with token auth: ``url`` is its dashboard (the Jobs API)."""

    def __init__(self, url: str, token: str, env: dict[str, str], proc: subprocess.Popen[bytes]) -> None:
        self.url, self.token, self.env, self.proc = url, token, env, proc

    def state(self) -> str:
        """For a failure's message: whether ``ray start`` still runs, and the tails of its log and
        the dashboard's (a dashboard that stopped answering says why there)."""
        root = Path(self.env["RAY_TMPDIR"])
        logs = [root / "ray-start.log", root / "session_latest" / "logs" / "dashboard.log"]
        tails = [f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.is_file()]
        return "\n".join([f"\n--- ray start: exit {self.proc.poll()} (None: running) ---", *tails])

    def auth(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}"}

    def submit(self, entrypoint: str, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(
            f"{self.url}/api/jobs/", json={"entrypoint": entrypoint}, headers=headers, timeout=30
        )

    def wait_job(self, submission_id: str, timeout: float = 180) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            info: dict[str, Any] = httpx.get(
                f"{self.url}/api/jobs/{submission_id}", headers=self.auth(), timeout=30
            ).json()
            if info["status"] in ("SUCCEEDED", "FAILED", "STOPPED") or time.monotonic() > deadline:
                return info
            time.sleep(1)


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    root = tempfile.mkdtemp(prefix="rayauth-", dir="/tmp")  # short: Ray's socket paths must fit
    token = secrets.token_hex(32)
    env = clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_TMPDIR=root)
    gcs, dashboard, agent, agent_grpc, runtime_env, metrics, node_mgr, obj_mgr, client = free_ports(9)
    cmd = [
        str(RAY), "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1", f"--port={gcs}", f"--temp-dir={root}", "--num-cpus=1",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
        f"--node-manager-port={node_mgr}", f"--object-manager-port={obj_mgr}",
        f"--ray-client-server-port={client}",
    ]  # fmt: skip
    log = Path(root) / "ray-start.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    h = Head(f"http://127.0.0.1:{dashboard}", token, env, proc)
    try:
        deadline = time.monotonic() + 180
        while True:  # the dashboard answers the version with the token once it is up
            try:
                if httpx.get(f"{h.url}/api/version", headers=h.auth(), timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not come up:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield h
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        stop_processes_under(root)
        shutil.rmtree(root, ignore_errors=True)


def test_the_jobs_api_refuses_a_submission_without_the_token(head: Head) -> None:
    assert head.submit("echo hi").status_code == 401  # no token
    assert head.submit("echo hi", head.auth("not-" + head.token)).status_code == 403  # another token
    assert httpx.get(f"{head.url}/api/jobs/", timeout=30).status_code == 401  # reading is refused too


def test_the_jobs_api_accepts_a_submission_with_the_token_and_the_driver_joins(head: Head) -> None:
    # the driver inherits the token from the head's environment and joins the cluster with it
    code = "import ray; ray.init(); print('answer', ray.get(ray.remote(lambda: 41 + 1).remote()))"
    driver = shlex.join([sys.executable, "-c", code])
    answer = head.submit(driver, head.auth())
    assert answer.status_code == 200, answer.text
    submission_id = answer.json()["submission_id"]
    info = head.wait_job(submission_id)
    logs = httpx.get(f"{head.url}/api/jobs/{submission_id}/logs", headers=head.auth(), timeout=30).json()
    assert info["status"] == "SUCCEEDED", (info, logs)
    assert "answer 42" in logs["logs"]


def test_ray_job_submit_takes_the_token_from_its_environment(head: Head) -> None:
    """The submitter pod of ``ray_auth: secret`` is ``ray job submit`` with the token in its env."""
    cmd = [str(RAY), "job", "submit", f"--address={head.url}", "--no-wait", "--", "echo", "submitted"]
    without = clean_env(RAY_TMPDIR=head.env["RAY_TMPDIR"], HOME=head.env["RAY_TMPDIR"])
    refused = subprocess.run(cmd, env=without, capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode != 0, refused.stdout
    assert "Missing authentication token" in refused.stderr, refused.stderr[-2000:] + head.state()
    done = subprocess.run(cmd, env=head.env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:] + head.state()


def test_fp8rl_run_starts_its_local_ray_with_token_auth_and_no_warning() -> None:
    root = tempfile.mkdtemp(prefix="rayrun-", dir="/tmp")
    script = (
        "import os, ray\n"
        "from rljob.spec import JobSpec\n"
        "from workers.job.ray_cluster import ray_init, ray_shutdown\n"
        "spec = JobSpec.model_validate({'resources': {'trainers': 1, 'generators': 1}})\n"
        "assert ray_init(spec)\n"
        "try:\n"
        "    print('mode', os.environ['RAY_AUTH_MODE'])\n"
        "    print('answer', ray.get(ray.remote(lambda: 41 + 1).remote()))\n"
        "finally:\n"
        "    ray_shutdown()\n"
    )
    # HOME: where Ray keeps the token it makes for a local cluster (~/.ray/auth_token)
    env = clean_env(RAY_TMPDIR=root, HOME=root)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240, check=False
        )
        token_made = (Path(root) / ".ray" / "auth_token").is_file()  # the cluster required a token
    finally:
        stop_processes_under(root)
        shutil.rmtree(root, ignore_errors=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mode token" in done.stdout and "answer 42" in done.stdout
    assert token_made
    assert ENABLED_WARNING not in done.stdout + done.stderr
    # the warning is Ray's own when the mode is left unset (so its absence above means something)
    setup = "ray._private.authentication.authentication_token_setup"
    unset = f"from {setup} import enable_token_auth_by_default as f; f()"
    warned = subprocess.run(
        [sys.executable, "-c", unset], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert ENABLED_WARNING in warned.stdout + warned.stderr
