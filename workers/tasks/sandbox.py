"""The grader sandbox: a pool of long-lived processes that run user code (``python`` graders, the
programs of ``code`` graders) and math-verify, one request at a time each.

Each process (:mod:`workers.tasks.child`) has

- no network: bubblewrap's own network namespace, where every connection is refused;
- a view of the file system made of the system's programs and libraries and the Python
  installation, read-only, and an empty private ``/tmp`` (its working directory): no run
  directory, no tenant's files, nothing of the service;
- no inherited environment: ``PATH``, ``LANG`` and ``HOME=/tmp`` only, so no token;
- its own PID namespace (where bubblewrap may mount ``/proc``: not inside another sandbox), so it
  sees no other process;
- limits: address space (``memory_mb`` above what the interpreter maps at start), file size
  (16 MiB), processes (RLIMIT_NPROC: 64 more than its user runs when it starts; as root it first
  becomes ``nobody``, so the limit holds), no core files; the time of a request (a wall-clock
  timer in the process, which bounds its CPU time too; past it and a second more, as when code
  is stuck in C, the process is killed and replaced) counts as a timeout; the program a
  ``code`` grader runs also has RLIMIT_CPU.

A pool and not a process per sample: starting one costs tens of milliseconds (``fp8rl bench
graders`` measures it), a request a fraction of one.

``FP8RL_GRADER_SANDBOX``: ``auto`` (default) uses bubblewrap where it can run and otherwise plain
processes, saying so; ``bwrap`` refuses to start without it; ``process`` never uses it. Plain
processes keep the limits, the empty environment and the working directory, but share the host's
network and file system view (with ``nobody``'s rights when started as root). In a Kubernetes pod
where the runtime's seccomp profile forbids the namespaces bubblewrap needs, that is what runs:
the pod itself is the sandbox then (its job's files only, a NetworkPolicy, no service-account
token; docs/job-spec.md, Graders).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("child.py")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("passwd", "group", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}
NPROC_ALLOWANCE = 64
FSIZE_MB = 16
WALL_SLACK_S = 1.0  # past timeout_s: the process's own timer answers first, even on a busy machine
START_TIMEOUT_S = 60.0


class SandboxUnavailable(RuntimeError):
    """``FP8RL_GRADER_SANDBOX=bwrap`` and bubblewrap cannot run here."""


def _python_dirs() -> list[Path]:
    return sorted({Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), CHILD.parent.resolve()})


def bwrap_argv(bwrap: str, with_proc: bool) -> list[str]:
    """The bubblewrap command line of one sandboxed process (module docstring)."""
    out = [bwrap, "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-pid", "--unshare-cgroup-try"]
    if os.geteuid() != 0:
        out.append("--unshare-user")  # unprivileged bubblewrap needs a user namespace
    out += ["--die-with-parent", "--new-session"]
    for system in SYSTEM_DIRS:
        p = Path(system)
        if p.is_symlink():
            out += ["--symlink", str(p.readlink()), system]
        elif p.is_dir():
            out += ["--ro-bind", system, system]
    for name in ETC_FILES:
        if (Path("/etc") / name).exists():
            out += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    out += ["--dev", "/dev", "--tmpfs", "/tmp"]
    if with_proc:
        out += ["--proc", "/proc"]
    python = _python_dirs()
    # the directories above the bound ones: made here, where nobody (the child's user) may pass
    made: set[Path] = set()
    for bound in python:
        for parent in reversed(bound.parents[:-1]):  # /root, /root/.pyenv, ... (not "/")
            if parent not in made and not any(
                parent == Path(s) or Path(s) in parent.parents for s in SYSTEM_DIRS
            ):
                out += ["--perms", "0755", "--dir", str(parent)]
                made.add(parent)
    for bound in python:
        out += ["--ro-bind", str(bound), str(bound)]
    return [*out, "--chdir", "/tmp", "--"]


def _child_argv() -> list[str]:
    return [sys.executable, "-I", str(CHILD)]


@dataclass(frozen=True)
class Launcher:
    """How the pool's processes start: under bubblewrap (``prefix`` its command line) or plain."""

    prefix: tuple[str, ...]
    how: str  # for logs and `fp8rl run`: "bubblewrap (...)" or "processes without a sandbox (why)"

    @property
    def sandboxed(self) -> bool:
        return bool(self.prefix)

    @classmethod
    def choose(cls, mode: str | None = None, bwrap: str | None = None) -> Launcher:
        mode = mode or os.environ.get("FP8RL_GRADER_SANDBOX", "auto")
        if mode not in ("auto", "bwrap", "process"):
            raise ValueError(f"FP8RL_GRADER_SANDBOX={mode!r}: use auto, bwrap or process")
        if mode == "process":
            return cls((), "processes without a sandbox (FP8RL_GRADER_SANDBOX=process)")
        program = shutil.which(bwrap or os.environ.get("FP8RL_BWRAP", "bwrap"))
        why = "bubblewrap is not installed" if program is None else ""
        if program is not None:
            for with_proc in (True, False):
                argv = bwrap_argv(program, with_proc)
                problem = _probe(argv)
                if problem is None:
                    return cls(tuple(argv), f"bubblewrap ({program})")
            why = problem or ""
        if mode == "bwrap":
            raise SandboxUnavailable(f"FP8RL_GRADER_SANDBOX=bwrap, but {why}")
        return cls((), f"processes without a sandbox ({why})")


def _probe(prefix: list[str]) -> str | None:
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=30, env=ENV
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bubblewrap did not run: {err}"
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()[:300]
        return f"bubblewrap cannot make its namespaces here: {said}"
    return None


class _Worker:
    """One process of the pool, with its pipes."""

    def __init__(self, launcher: Launcher, limits: dict[str, Any]) -> None:
        self.workdir: str | None = None
        env = dict(ENV)
        cwd = None
        if not launcher.sandboxed:  # a private working directory the child makes its own
            self.workdir = tempfile.mkdtemp(prefix="fp8rl-grader-")
            os.chmod(self.workdir, 0o755)
            env["FP8RL_GRADER_WORKDIR"] = os.path.join(self.workdir, "work")
            cwd = self.workdir
        self.proc = subprocess.Popen(
            [*launcher.prefix, *_child_argv()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buffer = b""
        answer = self.call({"op": "limits", **limits}, START_TIMEOUT_S)
        if "error" in answer or "timeout" in answer:
            self.kill()
            raise RuntimeError(f"the grader sandbox did not start: {answer}")

    def send(self, request: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def read_line(self) -> bytes | None:
        """A whole answer line when one has arrived; b"" at end of file; None when not yet."""
        while b"\n" not in self.buffer:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return None
            if not chunk:
                return b""
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    def call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """One request, waited for (starting the process: its limits, a python grader's load)."""
        self.send(request)
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.fd, selectors.EVENT_READ)
            while True:
                line = self.read_line()
                if line == b"":
                    return {"error": f"the grader's process ended ({self.proc.poll()})"}
                if line is not None:
                    answer: dict[str, Any] = json.loads(line)
                    return answer
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"timeout": True}
                sel.select(left)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


class GraderPool:
    """``size`` sandboxed processes; :meth:`run` shares a batch of requests out among them.

    ``memory_mb``: what each may allocate beyond its interpreter (the largest of the job's
    sandboxed graders'). A process that dies or overruns its request's wall clock is replaced,
    and the python graders loaded so far are loaded into the new one.
    """

    def __init__(self, size: int, memory_mb: int = 512, launcher: Launcher | None = None) -> None:
        if size < 1:
            raise ValueError(f"a grader pool needs at least 1 process, not {size}")
        self.launcher = launcher or Launcher.choose()
        self.limits = {"memory_mb": memory_mb, "nproc": NPROC_ALLOWANCE, "fsize_mb": FSIZE_MB}
        self._loads: list[tuple[dict[str, Any], float]] = []
        self.restarts = 0
        self._workers = [_Worker(self.launcher, self.limits) for _ in range(size)]

    @property
    def size(self) -> int:
        return len(self._workers)

    def how(self) -> str:
        """How its processes started (a method, so that a Ray actor holding a pool answers it)."""
        return self.launcher.how

    def where(self) -> str:
        """Where graders' code runs, for the job's log."""
        return f"a pool of {self.size} processes: {self.launcher.how}"

    def load(self, key: str, source: str, timeout_s: float) -> str | None:
        """Compile a python grader's ``source`` in every process; its error text, or None."""
        request = {"op": "load", "key": key, "source": source, "cpu_s": timeout_s}
        for worker in self._workers:
            answer = worker.call(request, timeout_s + WALL_SLACK_S)
            if "timeout" in answer:
                return f"loading the grader took longer than {timeout_s} s"
            if "error" in answer:
                return str(answer["error"])
        self._loads.append((request, timeout_s))
        return None

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self.restarts += 1
        worker = _Worker(self.launcher, self.limits)
        for request, timeout_s in self._loads:
            worker.call(request, timeout_s + WALL_SLACK_S)
        self._workers[i] = worker

    def run(self, requests: list[tuple[dict[str, Any], float]]) -> list[dict[str, Any]]:
        """Each (request, timeout_s)'s answer, in order: ``{"score"}``, ``{"error"}`` or ``{"timeout"}``."""
        results: list[dict[str, Any] | None] = [None] * len(requests)
        pending = deque(enumerate(requests))
        busy: dict[int, tuple[int, float]] = {}  # worker -> (request index, wall deadline)
        with selectors.DefaultSelector() as sel:
            for i, worker in enumerate(self._workers):
                sel.register(worker.fd, selectors.EVENT_READ, i)
            while pending or busy:
                for i in range(len(self._workers)):
                    if i not in busy and pending:
                        index, (request, timeout_s) = pending.popleft()
                        self._workers[i].send(request)
                        busy[i] = (index, time.monotonic() + timeout_s + WALL_SLACK_S)
                wait = min(d for _, d in busy.values()) - time.monotonic()
                for key, _ in sel.select(max(wait, 0.0)):
                    i = key.data
                    if i not in busy:
                        continue
                    line = self._workers[i].read_line()
                    if line is None:
                        continue
                    index, _ = busy.pop(i)
                    if line == b"":
                        code = self._workers[i].proc.wait()
                        results[index] = {"error": f"the grader's process died (exit status {code})"}
                    else:
                        results[index] = json.loads(line)
                        continue
                    sel.unregister(self._workers[i].fd)
                    self._replace(i)
                    sel.register(self._workers[i].fd, selectors.EVENT_READ, i)
                now = time.monotonic()
                for i, (index, deadline) in list(busy.items()):
                    if now >= deadline:
                        busy.pop(i)
                        results[index] = {"timeout": True}
                        sel.unregister(self._workers[i].fd)
                        self._replace(i)
                        sel.register(self._workers[i].fd, selectors.EVENT_READ, i)
        return [r if r is not None else {"error": "no answer"} for r in results]

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers = []

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
