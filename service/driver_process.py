"""A local driver process: its handle, its pid record, and what the OS lets it take.

Drivers run in their own session, so they outlive a restart of the service. Each run directory
holds ``driver.pid`` (the pid and the process's start time, which tells a live driver from a
reused pid), so a restarted service can watch a driver it did not start.

A driver gets a minimal environment (:func:`driver_environment`), not the service's: the service
holds secrets in its environment (where its tokens file is, the Kubernetes and cloud credentials
of its host), and a driver runs a tenant's job.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

UNKNOWN_EXIT = -1000  # a re-attached driver is not our child: its exit code cannot be read

# What a driver (and the local Ray processes it starts) is given of the service's environment,
# where set. Everything else stays with the service: its own FP8RL_* settings (the tokens file,
# the tenants' limits, the kubeconfig), AWS_*/GOOGLE_*/AZURE_* credentials, KUBECONFIG,
# proxies (which may carry a password), and whatever an operator set for the service alone.
DRIVER_ENV_NAMES = frozenset(
    {
        # the process: programs, user, home (caches: ~/.cache/fp8rl models, Hugging Face, Triton),
        # locale, temporary files, time zone
        *("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TMP", "TEMP"),
        # the interpreter and the libraries it loads (CUDA images set LD_LIBRARY_PATH)
        *("VIRTUAL_ENV", "LD_LIBRARY_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE"),
        "XDG_CACHE_HOME",
        # the driver's own switches (workers/: model_store, fp8/dispatch, fp8/quant, ray_cluster,
        # engines/native/decode_attention, engines/native/static_decode, fp8/linear_gemm,
        # engines/models, fp8/cpu_compiled, job/ray_cluster, fp8/fused, engines/native/rms_norm,
        # engines/native/sampling, weight_sync/contract), held to this list by a test
        *("FP8RL_HOME", "FP8RL_CUBLAS_BLOCKWISE", "FP8RL_DECODE_ATTENTION", "FP8RL_SMALL_M_GEMM"),
        *("FP8RL_TRITON", "FP8RL_RAY_GROUPS", "FP8RL_CPU_BF16_GEMM", "FP8RL_KV_WRITE", "FP8RL_CPU_COMPILE"),
        *("FP8RL_WGRAD_GEMM", "FP8RL_CPU_MALLOC", "FP8RL_DRIVER_ATTEMPT", "FP8RL_DRIVER_PREVIOUS_EXIT"),
        *("FP8RL_SILU_MUL", "FP8RL_RMS_NORM", "FP8RL_SAMPLING", "FP8RL_CHECKSUM", "FP8RL_DUAL_QUANT"),
        # the grader sandbox (workers/tasks/sandbox); the last is the pool's own, set for its children
        *("FP8RL_GRADER_SANDBOX", "FP8RL_BWRAP", "FP8RL_GRADER_WORKERS", "FP8RL_GRADER_WORKDIR"),
        # Hugging Face: where models are and whether to go online (never HF_TOKEN: see below)
        *("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT"),
    }
)
# Families of settings of the runtimes a driver uses: locale categories, Python, Ray, CUDA, NCCL,
# PyTorch, Triton, vLLM, Transformer Engine, OpenMP/BLAS threads, transformers, tokenizers
DRIVER_ENV_PREFIXES = (
    *("LC_", "PYTHON", "RAY_", "CUDA_", "NVIDIA_", "NCCL_", "TORCH", "TRITON_", "VLLM_", "NVTE_"),
    *("OMP_", "KMP_", "MKL_", "OPENBLAS_", "TRANSFORMERS_", "TOKENIZERS_"),
)
# Never inherited from the service, though a family above names them: RAY_ADDRESS would make a
# local driver join the Ray cluster the service's environment names (every tenant's job on one
# cluster, and not the one the executor confines) instead of starting its own
NOT_INHERITED = frozenset({"RAY_ADDRESS"})
# Never passed by the lists above, whatever the prefix (HF_TOKEN, RAY_AUTH_TOKEN, ..._API_KEY):
# a site that means its drivers to have one names it in driver_env
SECRET_NAME = re.compile(
    r"(^|_)(TOKEN|SECRETS?|PASS|PASSWORD|PASSWD|PASSWORDFILE|PASSPHRASE|PWD|CREDENTIALS?|KEY|APIKEY|"
    r"AUTH|DSN|COOKIE|SESSION)(_|$)"
)


# where a driver's caches and Hugging Face files go: set per tenant (tenant_environment), never the
# service's own (its stored Hugging Face token, a cache other tenants share)
CACHE_ENV_NAMES = ("HF_HUB_CACHE", "HF_TOKEN_PATH", "HF_ASSETS_CACHE", "HF_XET_CACHE", "TRITON_CACHE_DIR")


def tenant_environment(env: Mapping[str, str], cache: Path, hf_token: str | None) -> dict[str, str]:
    """``env`` with a tenant's own caches: ``HOME``, ``XDG_CACHE_HOME`` and ``HF_HOME`` under
    ``cache`` (a Hugging Face token stored in the service's home is not there), and ``HF_TOKEN``
    only when the tenant's settings give one."""
    out = {k: v for k, v in env.items() if k not in CACHE_ENV_NAMES and k != "HF_TOKEN"}
    out.update(HOME=str(cache), XDG_CACHE_HOME=str(cache / ".cache"), HF_HOME=str(cache / "huggingface"))
    if "HF_TOKEN" in env and hf_token is None:
        out["HF_TOKEN"] = env["HF_TOKEN"]  # passed on purpose by the service's driver_env
    if hf_token is not None:
        out["HF_TOKEN"] = hf_token
    return out


def driver_environment(environ: Mapping[str, str], extra: Iterable[str] = ()) -> dict[str, str]:
    """The environment of a driver: the variables of ``environ`` that ``DRIVER_ENV_NAMES`` or
    ``DRIVER_ENV_PREFIXES`` name and whose names do not look like secrets (``SECRET_NAME``), and
    those ``extra`` names (the ``driver_env`` setting) as they are."""
    wanted = set(extra)

    def passed(name: str) -> bool:
        if name in wanted:
            return True
        known = name in DRIVER_ENV_NAMES or name.startswith(DRIVER_ENV_PREFIXES)
        return known and name not in NOT_INHERITED and SECRET_NAME.search(name) is None

    return {k: v for k, v in environ.items() if passed(k)}


def _stat_fields(stat: str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after ``pid (comm)`` (field 3 onwards): comm may hold
    spaces and parentheses, so the split starts after its last ``)``."""
    return stat[stat.rindex(")") + 2 :].split()


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None
    if there is no such process or it has exited (a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = _stat_fields(stat)
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


class DriverProcess:
    """A driver process: started here (``Popen``) or re-attached after a restart (pid only)."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None, started: str = "") -> None:
        self.pid, self.popen = pid, popen
        self.started = started or (_start_time(pid) or "")

    @classmethod
    def start(
        cls,
        argv: list[str],
        log: Path,
        cwd: Path,
        env: Mapping[str, str],
        confine: Callable[[], None] | None = None,
    ) -> DriverProcess:
        """Start ``argv`` in ``cwd`` with exactly ``env`` (:func:`driver_environment`) in a session
        of its own, its output appended to ``log``; ``confine`` (:func:`confinement`) runs in the
        child before exec."""
        with log.open("ab") as f:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,  # no terminal to reach from a sandbox
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=cwd,
                env=env,
                umask=0o077,  # what it writes (checkpoints, logs) is its tenant's alone: 0600/0700
                preexec_fn=confine,
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

    def driver_pid(self) -> int:
        """The driver's own pid: the process started, or, in a sandbox (bubblewrap, which does not
        pass signals on), the first process below it that is not the sandbox."""
        pid = self.pid
        for _ in range(4):  # bwrap, its child in the new PID namespace, then the driver
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() != "bwrap":
                    return pid
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                return pid
            if not children:
                return pid
            pid = int(children[0])
        return pid

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.driver_pid(), sig)

    def kill(self) -> None:
        """SIGKILL the driver's whole process group: its session holds the local Ray processes."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()


def sessions_memory(sessions: Iterable[int]) -> dict[int, int]:
    """``{session id: bytes}``: the memory the processes of each session use together, as their
    proportional set size (shared pages divided among the processes that map them, so Ray's object
    store counts once), read from ``/proc``. A process that exits while it is read is left out."""
    wanted = set(sessions)
    out = dict.fromkeys(wanted, 0)
    if not wanted:
        return out
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            sid = int(_stat_fields(stat)[3])  # field 6: the session id
            if sid not in wanted:
                continue
            for line in (entry / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    out[sid] += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError, IndexError):
            continue
    return out


@dataclass(frozen=True)
class DriverLimits:
    """What one driver (and the local Ray processes it starts, which inherit all three) may take."""

    memory_bytes: int | None = None  # address space of each process (RLIMIT_AS); None: no limit
    cpus: int | None = None  # CPUs it may run on (affinity); None: all
    nice: int = 10  # added to the service's niceness, so the API answers while drivers compute
    wall_clock_s: float | None = None  # the job's drivers are stopped after this long; None: never
    resident_bytes: int | None = None  # memory its session's processes use together (PSS); None: any


def confinement(tenant: str, limits: DriverLimits) -> Callable[[], None]:
    """What a driver's process applies to itself between fork and exec (``Popen(preexec_fn=...)``),
    so that everything it starts inherits it from its first instruction: the sandbox, the driver,
    its Ray processes. Everything is computed here, in the service; the child only makes three
    system calls (no lock, no import, nothing a thread of the service could hold)."""
    memory = limits.memory_bytes
    # niceness relative to the service's own (raising it needs no privilege)
    nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + limits.nice)
    picked: set[int] = set()
    if limits.cpus:
        allowed = sorted(os.sched_getaffinity(0))
        start = zlib.crc32(tenant.encode()) % len(allowed)  # tenants spread over the CPUs
        picked = {allowed[(start + i) % len(allowed)] for i in range(min(limits.cpus, len(allowed)))}

    def apply() -> None:
        if memory:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        if picked:
            os.sched_setaffinity(0, picked)

    return apply
