"""The ``RLJob`` custom resource: its ``spec`` (the job spec plus where and how it runs on a
cluster) and helpers that build and read the object, shared by the control plane's Kubernetes
store and the operator. The CRD is generated from these models (``rljob.crd``).

```yaml
apiVersion: fp8rl.io/v1alpha1
kind: RLJob
metadata: {name: arithmetic, namespace: team-a}
spec:
  job: {...}            # the job spec, exactly what `fp8rl run` reads
  suspend: false        # true stops the job with a checkpoint; false resumes it from there
  cluster: {...}        # optional placement: image, node pools, queue, priority, limits
status: {...}           # phase, reason, conditions, progress (rljob.status.JobStatus)
```
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rljob.spec import JobSpec
from rljob.status import JobStatus

GROUP = "fp8rl.io"
VERSION = "v1alpha1"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ("rlj",)
API_VERSION = f"{GROUP}/{VERSION}"
TENANT_LABEL = "fp8rl.io/tenant"
# On a cluster each Ray worker group advertises a custom resource and the driver's actors ask for
# it, so generators land on the generation pool and trainers on the training pool.
RAY_GROUP_RESOURCES = {"generation": "fp8rl_generation", "training": "fp8rl_training"}
RAY_GROUPS_ENV = "FP8RL_RAY_GROUPS"  # "1" in the RayJob's head container
# Ray's token authentication (Ray >= 2.52): every Ray process and client reads these. The operator
# sets them on a job's containers (or KubeRay does); `fp8rl run` sets the mode for its local Ray.
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


YEAR_S = 366 * 86400  # the longest deadline or retention an RLJob takes


class Toleration(_Strict):
    """A Kubernetes toleration (the fields the operator passes through)."""

    key: str | None = Field(None, description="Taint key; empty with operator Exists matches all.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect; empty matches all."
    )
    toleration_seconds: int | None = Field(
        None, alias="tolerationSeconds", description="With NoExecute: how long to stay bound."
    )


class Pool(_Strict):
    """A GPU node pool for one Ray worker group; unset fields take the operator's defaults."""

    node_selector: dict[str, str] | None = Field(
        None, alias="nodeSelector", description="Node labels the group's pods must match."
    )
    tolerations: list[Toleration] | None = Field(None, description="Taints the group's pods tolerate.")


class Queue(_Strict):
    """A batch scheduler queue: the operator sets that scheduler's labels on the RayJob."""

    scheduler: Literal["kueue", "volcano", "kai"] = Field(description="Which scheduler reads the queue.")
    name: str = Field(min_length=1, max_length=253, description="Queue name (LocalQueue for Kueue).")


class ClusterSpec(_Strict):
    """Where and how the job runs on Kubernetes; every field has an operator-wide default."""

    image: str | None = Field(
        None,
        description="GPU worker image; default: the operator's. Must be on the operator's allow-list "
        "(rljob.images: an allowed prefix, or it followed by ':tag', '@digest' or '/path').",
    )
    generation: Pool = Field(default_factory=Pool, description="Node pool of the generation group.")
    training: Pool = Field(default_factory=Pool, description="Node pool of the training group.")
    queue: Queue | None = Field(None, description="Kueue, Volcano or KAI queue.")
    priority_class: str | None = Field(
        None, alias="priorityClassName", description="PriorityClass of the job's pods."
    )
    active_deadline_seconds: int | None = Field(
        None, alias="activeDeadlineSeconds", ge=1, le=YEAR_S, description="Fail the job after this long."
    )
    backoff_limit: int | None = Field(
        None,
        alias="backoffLimit",
        ge=0,
        le=100,
        description="Retries of a failed job on a new Ray cluster (after the in-place ones).",
    )
    in_place_retries: int | None = Field(
        None,
        alias="inPlaceRetries",
        ge=0,
        le=10,
        description="Times a failed driver is started again (--resume) on the same Ray cluster, where that "
        "is safe: not after a bad spec, out of memory or too many actor faults, nor once the cluster lost a "
        "node.",
    )
    ttl_seconds_after_finished: int | None = Field(
        None,
        alias="ttlSecondsAfterFinished",
        ge=0,
        le=YEAR_S,
        description="Keep the Ray cluster this long after.",
    )
    volume_claim: str | None = Field(
        None,
        alias="volumeClaim",
        description="PersistentVolumeClaim (ReadWriteMany) mounted at /runs on every pod: put "
        "job.output_dir under /runs so checkpoints survive a suspend or a restart.",
    )


class RLJobSpec(_Strict):
    """``spec`` of an RLJob."""

    job: JobSpec = Field(default_factory=JobSpec, description="The RL job (as `fp8rl run` reads it).")
    suspend: bool = Field(False, description="True: stop after a checkpoint; false again: resume.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Placement on the cluster.")


@dataclass(frozen=True)
class ObjectMeta:
    """The metadata fields of an RLJob that fp8rl reads (as the API server returns them)."""

    name: str
    namespace: str
    uid: str = ""
    resource_version: str | None = None  # the version read: a status write carries it
    deletion_timestamp: str | None = None  # set once the object is being deleted

    @classmethod
    def of(cls, obj: dict[str, Any]) -> ObjectMeta:
        """The metadata of ``obj``, an object as read from the API server."""
        meta = obj.get("metadata") or {}
        return cls(
            name=str(meta["name"]),
            namespace=str(meta["namespace"]),
            uid=str(meta.get("uid") or ""),
            resource_version=str(meta["resourceVersion"]) if meta.get("resourceVersion") else None,
            deletion_timestamp=str(meta["deletionTimestamp"]) if meta.get("deletionTimestamp") else None,
        )


@dataclass(frozen=True)
class RLJob:
    """An RLJob with a valid spec: what the operator builds a RayJob and a ConfigMap from."""

    metadata: ObjectMeta
    spec: RLJobSpec

    @classmethod
    def of(cls, obj: dict[str, Any]) -> RLJob:
        """``obj`` (an object as read from the API server), parsed; raises pydantic's
        ValidationError on an invalid spec."""
        return cls(ObjectMeta.of(obj), spec_of(obj))


def manifest(
    name: str, namespace: str, spec: JobSpec, tenant: str | None = None, suspend: bool = False
) -> dict[str, Any]:
    """A new RLJob object (no status: the status subresource is written separately)."""
    labels = {"app.kubernetes.io/managed-by": "fp8rl"}
    if tenant is not None:
        labels[TENANT_LABEL] = tenant
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"job": spec.model_dump(mode="json", exclude_unset=True), "suspend": suspend},
    }


def spec_of(obj: dict[str, Any]) -> RLJobSpec:
    """The parsed ``spec`` (raises pydantic's ValidationError on an invalid one)."""
    return RLJobSpec.model_validate(obj.get("spec") or {})


def status_of(obj: dict[str, Any]) -> JobStatus:
    """The parsed ``status``; an object nobody has written status to yet is Pending."""
    return JobStatus.model_validate(obj.get("status") or {})


def created_of(obj: dict[str, Any]) -> datetime:
    stamp = (obj.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return datetime.now(UTC)
    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
