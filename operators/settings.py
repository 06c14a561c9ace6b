"""Operator-wide settings: the defaults it applies to every RLJob (image, node pools, head size,
shared memory, NCCL environment, limits) and how often it polls. ``FP8RL_OPERATOR_*`` environment
variables (complex fields as JSON), or a YAML file (``fp8rl operator --config``) that the chart
renders from its values."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rljob.resource import Pool, Toleration

# a Kubernetes resource quantity, e.g. 16Gi, 500M, 1.5Ti
QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
GPU_TOLERATION = Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")


class LabelSelectorRequirement(BaseModel):
    """One ``matchExpressions`` entry of a Kubernetes label selector."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] | None = None


class LabelSelector(BaseModel):
    """A Kubernetes label selector (``matchLabels`` and ``matchExpressions``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    match_labels: dict[str, str] = Field(default_factory=dict, alias="matchLabels")
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, alias="matchExpressions")

    def manifest(self) -> dict[str, Any]:
        """As a Kubernetes object field (empty parts left out)."""
        out: dict[str, Any] = {}
        if self.match_labels:
            out["matchLabels"] = dict(self.match_labels)
        if self.match_expressions:
            out["matchExpressions"] = [e.model_dump(exclude_none=True) for e in self.match_expressions]
        return out


class Peer(BaseModel):
    """Pods outside a job that may reach it: those matching ``podSelector`` in the namespaces
    matching ``namespaceSelector``. The namespace selector must select something specific: an
    empty one matches every namespace, where any tenant could start a pod with the right labels."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    namespace_selector: LabelSelector = Field(alias="namespaceSelector")
    pod_selector: LabelSelector = Field(default_factory=LabelSelector, alias="podSelector")

    @field_validator("namespace_selector")
    @classmethod
    def _specific(cls, value: LabelSelector) -> LabelSelector:
        if not value.manifest():
            raise ValueError(
                "an empty namespaceSelector admits pods of every namespace (any tenant's); name the "
                "namespace, e.g. {matchLabels: {kubernetes.io/metadata.name: monitoring}}"
            )
        return value

    def manifest(self) -> dict[str, Any]:
        """As a NetworkPolicy ``from`` entry (both selectors in one entry: pods of those
        namespaces that match, not the union)."""
        return {
            "namespaceSelector": self.namespace_selector.manifest(),
            "podSelector": self.pod_selector.manifest(),
        }


def _peer(namespace: str, **pod_labels: str) -> Peer:
    return Peer(
        namespace_selector=LabelSelector(match_labels={"kubernetes.io/metadata.name": namespace}),
        pod_selector=LabelSelector(match_labels=pod_labels),
    )


# the chart renders all three from its values and release; these defaults serve a bare `fp8rl operator`
PROMETHEUS_PEER = _peer("monitoring", **{"app.kubernetes.io/name": "prometheus"})
OPERATOR_PEER = _peer(
    "fp8rl-system", **{"app.kubernetes.io/name": "fp8rl", "app.kubernetes.io/component": "operator"}
)
KUBERAY_PEER = _peer("kuberay-system", **{"app.kubernetes.io/name": "kuberay-operator"})


class JobPolicy(BaseModel):
    """What a tenant's RLJobs may ask for in ``spec.cluster`` beyond the operator's defaults. Each
    list is an allow-list; empty (the default) means the field must be left unset, so the job gets
    the operator's own pools, no priority class, no queue and no volume."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    priority_classes: list[str] = Field(
        default_factory=list, alias="priorityClasses", description="PriorityClass names it may set."
    )
    node_selectors: list[dict[str, str]] = Field(
        default_factory=list,
        alias="nodeSelectors",
        description="Node selectors a pool may name, each exactly as listed (a label more or less is "
        "another selector).",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations a pool may carry, each exactly as listed."
    )
    queues: list[str] = Field(
        default_factory=list, description="Queues it may name, as '<scheduler>/<name>' (kueue/team-a)."
    )
    volume_claims: list[str] = Field(
        default_factory=list,
        alias="volumeClaims",
        description="PersistentVolumeClaims (in its own namespace) it may mount at /runs.",
    )


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
    work_dir_size: str = Field(
        "100Gi",
        pattern=QUANTITY,
        description="Size limit of each pod's /data, the emptyDir the job works in (relative output_dir, "
        "downloads); a pod writing more is evicted. Checkpoints to keep go on spec.cluster.volumeClaim.",
    )
    job_policies: dict[str, JobPolicy] = Field(
        default_factory=dict,
        description="Per tenant namespace: what its RLJobs may ask for in spec.cluster (priority "
        "classes, node selectors, tolerations, queues, volume claims); a namespace not listed gets "
        "default_job_policy.",
    )
    default_job_policy: JobPolicy = Field(
        default_factory=JobPolicy,
        description="The policy of namespaces job_policies does not list; by default nothing beyond the "
        "operator's own defaults.",
    )
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
    backoff_limit: int = Field(
        0,
        ge=0,
        le=100,
        description="Retries of a failed job on a new Ray cluster (resume from the checkpoint).",
    )
    in_place_retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Times a failed driver is started again on the same Ray cluster where that is safe "
        "(workers.job.supervisor), before the job fails and backoff_limit rebuilds the cluster.",
    )
    poll_seconds: float = Field(
        10.0, gt=0, le=3600, description="How often each job's RayJob and progress are read."
    )
    allowed_images: list[str] = Field(
        default_factory=list,
        description="Prefixes of the images an RLJob may name in spec.cluster.image (rljob.images: the "
        "prefix itself, or it followed by ':tag' or '@digest'; a path under it only where it ends in '/'); "
        "empty: `image` itself.",
    )
    ray_auth: Literal["kuberay", "secret"] = Field(
        "kuberay",
        description="How each job's Ray cluster requires a token: 'kuberay' (KubeRay >= 1.5.1: "
        "rayClusterSpec.authOptions, KubeRay makes the Secret and sends the token itself) or 'secret' "
        "(older KubeRay: the operator makes a Secret per job and sets RAY_AUTH_MODE/RAY_AUTH_TOKEN on "
        "every container, and a submitter pod with the token submits the driver).",
    )
    network_policy: bool = Field(
        True,
        description="Create a NetworkPolicy per job admitting only the peers below and the job's own pods.",
    )
    metrics_from: list[Peer] = Field(
        default_factory=lambda: [PROMETHEUS_PEER, OPERATOR_PEER],
        description="Who may reach the driver's metrics port on the head pod (Prometheus; this operator, "
        "which reads progress there).",
    )
    dashboard_from: list[Peer] = Field(
        default_factory=lambda: [KUBERAY_PEER],
        description="Who may reach the Ray dashboard (8265: the Jobs API) of the head pod: the KubeRay "
        "operator, which submits and watches HTTP-mode jobs there.",
    )
    progress_url: str = Field(
        "http://{pod_ip}:{port}/metrics",
        description="Where the driver's metrics are scraped with progress_route pod-ip ({pod_ip} of the head "
        "pod, {port}).",
    )
    progress_route: Literal["auto", "pod-ip", "api-proxy"] = Field(
        "auto",
        description="How the driver's metrics are reached: 'pod-ip' (the head pod's IP, from inside the "
        "cluster: the chart's operator), 'api-proxy' (through the API server's pods/proxy, from outside: a "
        "laptop; needs get on pods/proxy and, where NetworkPolicies are enforced, the API server admitted to "
        "the metrics port), 'auto' (pod-ip in a pod, else api-proxy).",
    )

    @field_validator("allowed_images")
    @classmethod
    def _prefixes(cls, value: list[str]) -> list[str]:
        bad = [p for p in value if not p.strip() or p != p.strip()]
        if bad:
            raise ValueError(f"image prefixes must be non-empty, without surrounding spaces: {bad}")
        return value

    def job_policy(self, namespace: str) -> JobPolicy:
        """What RLJobs of ``namespace`` may ask for in ``spec.cluster``."""
        return self.job_policies.get(namespace, self.default_job_policy)

    def image_prefixes(self) -> list[str]:
        """The allow-list of ``spec.cluster.image`` (``allowed_images``, else the default ``image``
        itself: not every tag of its repository)."""
        return list(self.allowed_images) or [self.image]

    @classmethod
    def load(cls, path: Path | None = None) -> OperatorSettings:
        """From ``path`` (YAML) over the environment, or the environment alone."""
        if path is None:
            return cls()
        data = yaml.safe_load(path.read_text()) or {}
        return cls(**data)
