"""A local driver process: its handle, its pid record, and what the OS lets it take.

Drivers run in their own session, so they outlive a restart of the service. Each run directory
holds ``driver.pid`` (the pid and the process's start time, which tells a live driver from a
reused pid), so a restarted service can watch a driver it did not start.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

UNKNOWN_EXIT = -1000  # a re-attached driver is not our child: its exit code cannot be read


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None
    if there is no such process or it has exited (a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


class DriverProcess:
    """A driver process: started here (``Popen``) or re-attached after a restart (pid only)."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None, started: str = "") -> None:
        self.pid, self.popen = pid, popen
        self.started = started or (_start_time(pid) or "")

    @classmethod
    def start(cls, argv: list[str], log: Path, cwd: Path) -> DriverProcess:
        """Start ``argv`` in ``cwd`` in a session of its own, its output appended to ``log``."""
        with log.open("ab") as f:
            popen = subprocess.Popen(
                argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
            )
        return cls(popen.pid, popen)

    @classmethod
    def attach(cls, record: Path) -> DriverProcess | None:
        """The driver of a pid record written by ``save``; None without a readable one."""
        try:
            data = json.loads(record.read_text())
            return cls(int(data["pid"]), started=str(data["started"]))
        except (OSError, ValueError, KeyError):
            return None

    def save(self, record: Path) -> None:
        """Write the pid record (``driver.pid``) that ``attach`` reads."""
        record.write_text(json.dumps({"pid": self.pid, "started": self.started}))

    def poll(self) -> int | None:
        """None while it runs; the exit code when known; ``UNKNOWN_EXIT`` for a re-attached one."""
        if self.popen is not None:
            return self.popen.poll()
        return None if _start_time(self.pid) == self.started else UNKNOWN_EXIT

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the driver's whole process group: its session holds the local Ray processes."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()


@dataclass(frozen=True)
class DriverLimits:
    """What one driver (and the local Ray processes it starts, which inherit all three) may take."""

    memory_bytes: int | None = None  # address space of each process (RLIMIT_AS); None: no limit
    cpus: int | None = None  # CPUs it may run on (affinity); None: all
    nice: int = 10  # added to the service's niceness, so the API answers while drivers compute


def confine(pid: int, tenant: str, limits: DriverLimits) -> None:
    """Apply ``limits`` to a just-started driver, before it starts Ray (its imports take seconds)."""
    with contextlib.suppress(ProcessLookupError):
        if limits.memory_bytes:
            resource.prlimit(pid, resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        # niceness relative to the service's own (raising it needs no privilege)
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + limits.nice))
        if limits.cpus:
            allowed = sorted(os.sched_getaffinity(0))
            start = zlib.crc32(tenant.encode()) % len(allowed)  # tenants spread over the CPUs
            picked = {allowed[(start + i) % len(allowed)] for i in range(min(limits.cpus, len(allowed)))}
            os.sched_setaffinity(pid, picked)
