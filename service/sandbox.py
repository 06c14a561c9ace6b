"""Local drivers in a sandbox: bubblewrap (``bwrap``) gives each one a view of the file system
made of what its job may read and write, and nothing of the service.

A driver runs a tenant's job: whatever the job makes it open (a dataset, a model, a generator's
parameters) it opens with the service's user. Without a sandbox that user can read the tokens
file, the job database and every tenant's runs. In the sandbox a driver sees

- read-only: the system's programs and libraries (``/usr`` and the ``/bin``, ``/lib`` links), the
  few files of ``/etc`` that name resolution, TLS and the dynamic loader read, ``/sys``, the
  Python installation and virtual environment, and the fp8rl packages a driver imports (each
  package's directory alone, not the checkout around it, where a data directory may be);
- read-only: the service's read-only roots (``FP8RL_MODEL_ROOTS``), the only shared files;
- read-write: its tenant's directory (its working directory, where relative paths resolve), its
  own run directory, and its tenant's cache (``HOME``, the Hugging Face and Triton caches);
- read-only: the bubblewrap program, where it is not under the system's directories, so that
  the driver's grader sandbox (:mod:`workers.tasks.sandbox`) can start inside this one;
- its own ``/tmp``, ``/dev`` (with ``/dev/shm`` for Ray's object store, and the NVIDIA devices
  where there are any) and ``/proc`` in a PID namespace of its own: it sees no process of the
  service or of another job, so not their environments or file descriptors either.

Not isolated: the network (drivers download models and their Ray processes talk over loopback);
the API port authenticates every request and the metrics port answers only counts. The driver
still runs as the service's user: a kernel exploit is out of scope of this sandbox.

``FP8RL_SANDBOX``: ``auto`` (the default) uses bubblewrap where it runs and says at start when it
does not; ``bwrap`` refuses to start without it; ``off`` runs drivers as the service's user with the
service's view (say so, and why, in docs/deploy.md).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

# what a driver imports (workers < rljob): each package's directory is bound alone
DRIVER_PACKAGES = ("rljob", "workers")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
ETC_FILES = (
    *("passwd", "group", "hosts", "resolv.conf", "nsswitch.conf", "host.conf", "gai.conf"),
    *("ssl", "ca-certificates", "pki", "localtime", "timezone", "ld.so.cache", "ld.so.conf"),
    *("ld.so.conf.d", "alternatives", "os-release", "mime.types", "machine-id", "protocols", "services"),
)


class SandboxUnavailable(RuntimeError):
    """``FP8RL_SANDBOX=bwrap`` and bubblewrap cannot run here."""


def _python_dirs() -> list[Path]:
    """The interpreter's installation, the virtual environment and the driver's packages."""
    dirs = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}
    for name in DRIVER_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.update(Path(p).resolve() for p in spec.submodule_search_locations)
    return sorted(dirs)


def probe(bwrap: str) -> str | None:
    """Why ``bwrap`` cannot sandbox a process here (not found, no user namespaces, ...); None if it can."""
    found = shutil.which(bwrap)
    if found is None:
        return f"bubblewrap ({bwrap!r}) is not installed or not on PATH"
    try:
        done = subprocess.run(
            [found, "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bubblewrap ({found}) did not run: {err}"
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()
        return f"bubblewrap ({found}) cannot make namespaces here: {said}"
    return None


@dataclass(frozen=True)
class Sandbox:
    """How drivers are wrapped: ``bwrap`` is the program (None: no sandbox, ``why`` says why)."""

    bwrap: str | None
    why: str = ""
    read_only: tuple[Path, ...] = field(default_factory=tuple)  # the service's read-only roots

    @classmethod
    def choose(cls, mode: str, bwrap: str, read_only: Iterable[Path]) -> Sandbox:
        """The sandbox ``mode`` (auto | bwrap | off) asks for on this machine."""
        roots = tuple(Path(p) for p in read_only)
        if mode == "off":
            return cls(None, "FP8RL_SANDBOX=off", roots)
        problem = probe(bwrap)
        if problem is None:
            return cls(shutil.which(bwrap), "", roots)
        if mode == "bwrap":
            raise SandboxUnavailable(f"FP8RL_SANDBOX=bwrap, but {problem}")
        return cls(None, problem, roots)

    def describe(self) -> str:
        """One line for the service's start."""
        if self.bwrap:
            return f"local drivers run in a bubblewrap sandbox ({self.bwrap})"
        return (
            f"local drivers run WITHOUT a sandbox ({self.why}): a job can read whatever the service's user "
            "can, including the tokens file and every tenant's runs; install bubblewrap (docs/deploy.md)"
        )

    def wrap(self, argv: Sequence[str], *, home: Path, run: Path, cache: Path) -> list[str]:
        """``argv`` in the sandbox: ``home`` (its working directory) and ``run`` and ``cache``
        writable, the rest of the module docstring read-only or absent."""
        if not self.bwrap:
            return list(argv)
        out = [self.bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        for d in SYSTEM_DIRS:
            p = Path(d)
            if p.is_symlink():
                out += ["--symlink", str(p.readlink()), d]
            elif p.is_dir():
                out += ["--ro-bind", d, d]
        for name in ETC_FILES:
            p = Path("/etc") / name
            if p.exists():
                out += ["--ro-bind", str(p), str(p)]
        out += ["--ro-bind-try", "/sys", "/sys"]
        # the fresh /dev, /proc and /tmp before the binds: a bind under /tmp must not be hidden
        out += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        for dev in sorted(Path("/dev").glob("nvidia*")):
            out += ["--dev-bind", str(dev), str(dev)]
        for shared in [*_python_dirs(), *self.read_only]:
            out += ["--ro-bind", str(shared), str(shared)]
        if not any(self.bwrap.startswith(d + "/") for d in SYSTEM_DIRS):
            # bubblewrap itself, for the grader sandbox a driver starts (workers.tasks.sandbox)
            out += ["--ro-bind", self.bwrap, self.bwrap]
        for own in (home, run, cache):
            out += ["--bind", str(own), str(own)]
        out += ["--chdir", str(home), "--"]
        return out + list(argv)
