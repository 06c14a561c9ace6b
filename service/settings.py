"""Control-plane settings: command-line options and ``FP8RL_*`` environment variables, one class."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rljob import paths
from rljob.jobs import Limits
from service.driver_process import DriverLimits


class TenantLimits(BaseModel):
    """Limits of one tenant; unset fields take the service-wide ``max_*`` settings."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent_jobs: int | None = Field(None, ge=0, description="Jobs Pending/Starting/Running.")
    max_gpus: int | None = Field(None, ge=0, description="GPUs requested by its active jobs.")
    max_problems: int | None = Field(None, ge=1, description="task.size + validation.size of one job.")
    max_new_tokens: int | None = Field(None, ge=1, description="rollout.max_new_tokens of one job.")
    max_actors: int | None = Field(None, ge=2, description="resources.trainers + generators of one job.")
    max_parameters: int | None = Field(None, ge=1, description="Parameters of one job's tiny model.")
    max_tokens_per_step: int | None = Field(
        None, ge=1, description="prompts_per_step x group_size x max_new_tokens of one job."
    )
    max_threads: int | None = Field(None, ge=1, description="Actors x threads_per_actor of one job.")
    max_task_params_bytes: int | None = Field(None, ge=2, description="task.params as JSON, bytes.")
    max_memory_mb: int | None = Field(
        None, ge=0, description="Address space of each of a local job's processes, MiB (0: none)."
    )
    max_cpus: int | None = Field(None, ge=0, description="CPUs a local job's processes may run on (0: all).")
    max_resident_mb: int | None = Field(
        None, ge=0, description="Memory a local job's processes use (0: none)."
    )
    max_job_seconds: int | None = Field(
        None, ge=0, description="Wall-clock limit of a local job's run (0: none)."
    )
    hf_token_env: str | None = Field(
        None,
        pattern=r"^[A-Z_][A-Z0-9_]{0,127}$",
        description="A variable of the service's environment holding this tenant's Hugging Face token: "
        "its local drivers get it as HF_TOKEN (no other tenant's, and never the service's stored one).",
    )
    max_stored_jobs: int | None = Field(None, ge=1, description="Jobs kept, every phase counted.")
    max_stored_bytes: int | None = Field(
        None, ge=1024, description="Bytes of the jobs kept (spec and status)."
    )


AUTO = -1  # max_resident_mb, max_cpus: from the machine (auto_resident_mb, auto_cpus)


def auto_resident_mb() -> int:
    """Half the machine's memory, in MiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 // 2**20


def auto_cpus() -> int:
    """All CPUs this process may use but one, where it may use 4 or more (the service keeps one
    for itself); else 0, all."""
    n = len(os.sched_getaffinity(0))
    return n - 1 if n >= 4 else 0


# the caps on one job, each a setting and a TenantLimits field (service.admission)
CAPS = (
    "max_problems",
    "max_new_tokens",
    "max_actors",
    "max_parameters",
    "max_tokens_per_step",
    "max_threads",
    "max_task_params_bytes",
)


class Settings(BaseSettings):
    """``fp8rl serve`` settings; each field can be set as ``FP8RL_<FIELD>`` (e.g. ``FP8RL_PORT``)."""

    model_config = SettingsConfigDict(env_prefix="FP8RL_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    metrics_port: int = Field(
        9401,
        ge=0,
        le=65535,
        description="Port of the control plane's Prometheus series (fp8rl_jobs), on the same address; "
        "0 = any free port. Not the API port: the series name every tenant.",
    )
    data_dir: Path = Field(Path("fp8rl-data"), description="SQLite database and job run directories.")
    tokens_file: Path | None = Field(None, description="YAML/JSON {token: tenant}; required to serve.")
    store: Literal["sql", "kubernetes"] = Field("sql", description="Where jobs are recorded.")
    max_body_bytes: int = Field(
        1 << 20, ge=1024, le=64 << 20, description="Largest accepted request body, bytes."
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description="A request's line and headers must arrive within this many seconds of the "
        "connection's start or the previous response (service.listener).",
    )
    idle_timeout_s: float = Field(
        5.0, gt=0, le=300, description="An idle keep-alive connection is closed after this many seconds."
    )
    body_timeout_s: float = Field(
        30.0, gt=0, le=600, description="A request's body must arrive within this many seconds (else 408)."
    )
    max_connections: int = Field(
        1000,
        ge=1,
        le=100_000,
        description="Open connections to the API port at once; one more is closed unread (keep it well "
        "under the process's file limit, ulimit -n).",
    )
    max_concurrent_jobs: int = Field(
        4, ge=0, description="Each tenant's default: jobs Pending/Starting/Running at once."
    )
    max_gpus: int = Field(8, ge=0, description="Each tenant's default: GPUs requested by its active jobs.")
    max_problems: int = Field(
        1_000_000,
        ge=1,
        description="Each tenant's default: task.size + validation.size of one job (generated in memory).",
    )
    max_new_tokens: int = Field(
        32_768, ge=1, description="Each tenant's default: rollout.max_new_tokens of one job."
    )
    max_actors: int = Field(
        64, ge=2, description="Each tenant's default: resources.trainers + generators of one job."
    )
    max_parameters: int = Field(
        2_000_000_000,
        ge=1,
        description="Each tenant's default: parameters of one job's tiny model (rljob.costs; a "
        "pretrained model is bounded by its files).",
    )
    max_tokens_per_step: int = Field(
        1 << 26,
        ge=1,
        description="Each tenant's default: prompts_per_step x group_size x max_new_tokens of one job "
        "(every response of a step at its longest).",
    )
    max_threads: int = Field(
        256,
        ge=1,
        description="Each tenant's default: (trainers + generators) x threads_per_actor of one job "
        "(0 threads counts as 1).",
    )
    max_task_params_bytes: int = Field(
        16_384, ge=2, le=1 << 20, description="Each tenant's default: task.params of one job as JSON, bytes."
    )
    max_memory_mb: int = Field(
        0,
        ge=0,
        description="Each tenant's default: address space (RLIMIT_AS) of each process of a local job "
        "(driver and its Ray processes), MiB, a hard limit the kernel enforces at allocation; 0 = none "
        "(the default: CUDA, and a pretrained model's mapped files, reserve far more address space than "
        "they use; max_resident_mb bounds what is used).",
    )
    max_resident_mb: int = Field(
        AUTO,
        ge=AUTO,
        description="Each tenant's default: memory a local job's processes use together (their "
        "proportional set size, read every poll), MiB; over it the job is stopped, Failed with reason "
        "OutOfMemory. -1 (the default) = half the machine's memory; 0 = none.",
    )
    max_cpus: int = Field(
        AUTO,
        ge=AUTO,
        description="Each tenant's default: CPUs a local job's processes may run on (affinity); 0 = all; "
        "-1 (the default) = all but one on a machine with 4 or more (the service keeps one), else all.",
    )
    max_job_seconds: int = Field(
        7 * 86400,
        ge=0,
        le=366 * 86400,
        description="Each tenant's default: wall-clock limit of a local job's run, seconds (restarts of "
        "its driver count; a resume starts a new run); 0 = none. Over it the job is Failed, reason "
        "DeadlineExceeded, resumable.",
    )
    max_stored_jobs: int = Field(
        1000,
        ge=1,
        le=10_000_000,
        description="Each tenant's default: jobs kept in every phase (finished ones too); delete some to "
        "submit more.",
    )
    max_stored_bytes: int = Field(
        64 << 20,
        ge=1024,
        description="Each tenant's default: bytes of the jobs kept (their spec and status as JSON).",
    )
    max_local_drivers: int = Field(
        4,
        ge=1,
        le=1024,
        description="Local drivers running at once, all tenants together (--store sql); more jobs wait "
        "Pending, oldest first, until one ends.",
    )
    sandbox: Literal["auto", "bwrap", "off"] = Field(
        "auto",
        description="Local drivers in a bubblewrap sandbox (service.sandbox): auto = where bubblewrap runs "
        "(fp8rl serve says at start when it does not); bwrap = refuse to start without it; off = none.",
    )
    bwrap: str = Field("bwrap", description="The bubblewrap program: a name on PATH or a path.")
    allow_unsandboxed_graders: bool = Field(
        False,
        description="Accept python and code graders (tenants' code) where no grader sandbox runs: in "
        "local jobs (--store sql) and POST /v1/graders/*. Off: such a grader is refused with 422 "
        "unless bubblewrap runs here.",
    )
    grader_runs_per_minute: int = Field(
        30, ge=1, le=10_000, description="POST /v1/graders/run and /validate calls per tenant per minute."
    )
    driver_nice: int = Field(
        10, ge=0, le=19, description="Scheduling priority of local drivers: below the service's own (0)."
    )
    driver_retries: int = Field(
        2,
        ge=0,
        le=100,
        description="Times a local job's failed driver is started again with --resume before the job is "
        "Failed: the last line behind the driver's own recovery from actor faults (as a RayJob's "
        "backoffLimit). Not after a bad spec, out of memory, or more faults than the job allows.",
    )
    driver_env: str = Field(
        "",
        description="Environment variables (names, separated by ',') that local drivers get from the "
        "service's environment beyond their own minimal list (service.driver_process."
        "driver_environment), e.g. HF_TOKEN,HTTPS_PROXY. Everything else the service holds stays out.",
    )
    model_roots: str = Field(
        "",
        description="Read-only directories every tenant's jobs may name by absolute path (shared "
        "checkpoints, datasets), separated by ':'; a tenant's own files are under "
        "<data-dir>/tenants/<tenant>/.",
    )
    tenant_limits: dict[str, TenantLimits] = Field(
        default_factory=dict,
        description='Per-tenant overrides, e.g. {"team-a": {"max_gpus": 32}} (JSON in FP8RL_TENANT_LIMITS).',
    )
    kubeconfig: str | None = Field(
        None, description="--store kubernetes outside a pod: kubeconfig file (default: KUBECONFIG)."
    )

    @field_validator("data_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        """Absolute from the start: drivers run in the tenant's directory, so a path relative to
        the service's working directory would name another place there."""
        return value.absolute()

    @property
    def driver_env_names(self) -> list[str]:
        return [n.strip() for n in self.driver_env.split(",") if n.strip()]

    @property
    def read_only_roots(self) -> list[Path]:
        return [Path(p) for p in self.model_roots.split(":") if p]

    def tenant_home(self, tenant: str) -> Path:
        """Where a tenant's jobs run and its relative paths resolve (``rljob.paths.tenant_home``)."""
        return paths.tenant_home(self.data_dir, tenant)

    def limit(self, tenant: str, name: str) -> int:
        """Setting ``name`` for ``tenant``: its own (``FP8RL_TENANT_LIMITS``) where set, else the
        service-wide one."""
        own = getattr(self.tenant_limits.get(tenant, TenantLimits()), name)
        return int(own if own is not None else getattr(self, name))

    def caps(self, tenant: str) -> dict[str, int]:
        """The size caps of ``tenant``'s jobs (``CAPS``)."""
        return {name: self.limit(tenant, name) for name in CAPS}

    def driver_limits(self, tenant: str) -> DriverLimits:
        """What each of ``tenant``'s local drivers may take (memory, CPUs, priority, wall clock)."""
        mib = self.limit(tenant, "max_memory_mb")
        seconds = self.limit(tenant, "max_job_seconds")
        used = self.limit(tenant, "max_resident_mb")
        cpus = self.limit(tenant, "max_cpus")
        used = auto_resident_mb() if used == AUTO else used
        cpus = auto_cpus() if cpus == AUTO else cpus
        return DriverLimits(
            mib * 2**20 if mib else None,
            cpus or None,
            self.driver_nice,
            seconds or None,
            used * 2**20 if used else None,
        )

    def hf_token(self, tenant: str) -> str | None:
        """``tenant``'s Hugging Face token, from the variable its settings name (None: none)."""
        name = self.tenant_limits.get(tenant, TenantLimits()).hf_token_env
        return os.environ.get(name) if name else None

    def limits(self, tenant: str) -> Limits:
        """``tenant``'s caps: active jobs, their GPUs, and the jobs and bytes it keeps stored."""
        names = ("max_concurrent_jobs", "max_gpus", "max_stored_jobs", "max_stored_bytes")
        return Limits(*(self.limit(tenant, name) for name in names))
