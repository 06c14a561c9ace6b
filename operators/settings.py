"""Operator-wide settings: the defaults it applies to every RLJob (image, node pools, head size,
shared memory, NCCL environment, limits) and how often it polls. ``FP8RL_OPERATOR_*`` environment
variables (complex fields as JSON), or a YAML file (``fp8rl operator --config``) that the chart
renders from its values."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from rljob.resource import Pool, Toleration

GPU_TOLERATION = Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")


class OperatorSettings(BaseSettings):
    """What an RLJob's ``spec.cluster`` leaves unset, plus the operator's own knobs."""

    model_config = SettingsConfigDict(env_prefix="FP8RL_OPERATOR_", extra="forbid")

    image: str = Field("ghcr.io/fp8rl/worker:0.1.0", description="GPU worker image (Ray + fp8rl).")
    image_pull_policy: str = Field("IfNotPresent", description="Pull policy of the job's pods.")
    ray_version: str = Field("2.60.0", description="Ray version in the image (KubeRay wants it).")
    generation: Pool = Field(
        default_factory=lambda: Pool(tolerations=[GPU_TOLERATION]),
        description="Default node pool of the generation group.",
    )
    training: Pool = Field(
        default_factory=lambda: Pool(tolerations=[GPU_TOLERATION]),
        description="Default node pool of the training group.",
    )
    generation_max_gpus_per_pod: int | None = Field(
        None, ge=1, le=64, description="GPUs per node of the default generation pool (None: unchecked)."
    )
    training_max_gpus_per_pod: int | None = Field(
        None, ge=1, le=64, description="GPUs per node of the default training pool (None: unchecked)."
    )
    head_cpu: str = Field("2", description="CPU of the head pod (it runs the driver, no GPU).")
    head_memory: str = Field("8Gi", description="Memory of the head pod.")
    worker_memory: str = Field("64Gi", description="Memory of each GPU worker pod.")
    shm_size: str = Field("16Gi", description="Memory-backed /dev/shm of each pod (NCCL, Ray).")
    model_roots: list[str] = Field(
        default_factory=list,
        description="Read-only directories in the job's pods that every tenant's jobs may name by absolute "
        "path (shared checkpoints); everything else must be under the pods' /data, where the driver runs.",
    )
    nccl_env: dict[str, str] = Field(
        default_factory=lambda: {
            "NCCL_DEBUG": "WARN",
            "NCCL_IB_DISABLE": "0",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        },
        description="Environment of every worker container (NCCL tuning for the cluster's fabric).",
    )
    service_account: str | None = Field(None, description="ServiceAccount of the job's pods.")
    metrics_port: int = Field(9400, ge=1, le=65535, description="The driver's Prometheus port.")
    ttl_seconds_after_finished: int = Field(600, ge=0, description="Keep a finished job's cluster this long.")
    active_deadline_seconds: int = Field(7 * 24 * 3600, ge=1, description="Fail a job running longer.")
    backoff_limit: int = Field(0, ge=0, le=100, description="Driver retries (resume from the checkpoint).")
    poll_seconds: float = Field(10.0, gt=0, description="How often each job's RayJob and progress are read.")
    progress_url: str = Field(
        "http://{pod_ip}:{port}/metrics",
        description="Where the driver's metrics are scraped ({pod_ip} of the head pod, {port}).",
    )

    @classmethod
    def load(cls, path: Path | None = None) -> OperatorSettings:
        """From ``path`` (YAML) over the environment, or the environment alone."""
        if path is None:
            return cls()
        data = yaml.safe_load(path.read_text()) or {}
        return cls(**data)
