"""Control-plane settings: command-line options and ``FP8RL_*`` environment variables, one class."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rljob import paths
from service.driver_process import DriverLimits


class TenantLimits(BaseModel):
    """Limits of one tenant; unset fields take the service-wide ``max_*`` settings."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent_jobs: int | None = Field(None, ge=0, description="Jobs Pending/Starting/Running.")
    max_gpus: int | None = Field(None, ge=0, description="GPUs requested by its active jobs.")
    max_problems: int | None = Field(None, ge=1, description="task.size + validation.size of one job.")
    max_new_tokens: int | None = Field(None, ge=1, description="rollout.max_new_tokens of one job.")
    max_actors: int | None = Field(None, ge=2, description="resources.trainers + generators of one job.")
    max_memory_mb: int | None = Field(
        None, ge=0, description="Address space of each of a local job's processes, MiB (0: none)."
    )
    max_cpus: int | None = Field(None, ge=0, description="CPUs a local job's processes may run on (0: all).")


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
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest accepted request body, bytes.")
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
    max_memory_mb: int = Field(
        0,
        ge=0,
        description="Each tenant's default: address space (RLIMIT_AS) of each process of a local job "
        "(driver and its Ray processes), MiB; 0 = no limit. For CPU jobs: CUDA reserves far more "
        "address space than it uses, so leave it 0 where jobs use GPUs.",
    )
    max_cpus: int = Field(
        0,
        ge=0,
        description="Each tenant's default: CPUs a local job's processes may run on (affinity); 0 = all.",
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

    def caps(self, tenant: str) -> dict[str, int]:
        """The size caps of ``tenant``'s jobs: max_problems, max_new_tokens, max_actors."""
        own = self.tenant_limits.get(tenant, TenantLimits())
        names = ("max_problems", "max_new_tokens", "max_actors")
        return {n: getattr(own, n) if getattr(own, n) is not None else getattr(self, n) for n in names}

    def driver_limits(self, tenant: str) -> DriverLimits:
        """What each of ``tenant``'s local drivers may take (memory, CPUs, priority)."""
        own = self.tenant_limits.get(tenant, TenantLimits())
        mib = own.max_memory_mb if own.max_memory_mb is not None else self.max_memory_mb
        cpus = own.max_cpus if own.max_cpus is not None else self.max_cpus
        return DriverLimits(mib * 2**20 if mib else None, cpus or None, self.driver_nice)

    def limits(self, tenant: str) -> tuple[int, int]:
        """(max concurrent jobs, max GPUs) of ``tenant``."""
        own = self.tenant_limits.get(tenant, TenantLimits())
        jobs = own.max_concurrent_jobs if own.max_concurrent_jobs is not None else self.max_concurrent_jobs
        gpus = own.max_gpus if own.max_gpus is not None else self.max_gpus
        return jobs, gpus
