"""Control-plane settings: command-line options and ``FP8RL_*`` environment variables, one class."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TenantLimits(BaseModel):
    """Limits of one tenant; unset fields take the service-wide ``max_*`` settings."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent_jobs: int | None = Field(None, ge=0, description="Jobs Pending/Starting/Running.")
    max_gpus: int | None = Field(None, ge=0, description="GPUs requested by its active jobs.")


class Settings(BaseSettings):
    """``fp8rl serve`` settings; each field can be set as ``FP8RL_<FIELD>`` (e.g. ``FP8RL_PORT``)."""

    model_config = SettingsConfigDict(env_prefix="FP8RL_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    data_dir: Path = Field(Path("fp8rl-data"), description="SQLite database and job run directories.")
    tokens_file: Path | None = Field(None, description="YAML/JSON {token: tenant}; required to serve.")
    store: Literal["sql", "kubernetes"] = Field("sql", description="Where jobs are recorded.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest accepted request body, bytes.")
    max_concurrent_jobs: int = Field(
        4, ge=0, description="Each tenant's default: jobs Pending/Starting/Running at once."
    )
    max_gpus: int = Field(8, ge=0, description="Each tenant's default: GPUs requested by its active jobs.")
    tenant_limits: dict[str, TenantLimits] = Field(
        default_factory=dict,
        description='Per-tenant overrides, e.g. {"team-a": {"max_gpus": 32}} (JSON in FP8RL_TENANT_LIMITS).',
    )
    kubeconfig: str | None = Field(
        None, description="--store kubernetes outside a pod: kubeconfig file (default: KUBECONFIG)."
    )

    def limits(self, tenant: str) -> tuple[int, int]:
        """(max concurrent jobs, max GPUs) of ``tenant``."""
        own = self.tenant_limits.get(tenant, TenantLimits())
        jobs = own.max_concurrent_jobs if own.max_concurrent_jobs is not None else self.max_concurrent_jobs
        gpus = own.max_gpus if own.max_gpus is not None else self.max_gpus
        return jobs, gpus
