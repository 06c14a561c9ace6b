"""Control-plane settings: command-line options and ``FP8RL_*`` environment variables, one class."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


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
        4, ge=1, description="Per tenant: jobs Pending/Starting/Running at once."
    )
    max_gpus: int = Field(8, ge=0, description="Per tenant: GPUs requested by its active jobs.")
