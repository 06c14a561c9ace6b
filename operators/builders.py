"""Pure builders: an RLJob (``rljob.resource.RLJob``: metadata and parsed spec) and the operator's
defaults in, Kubernetes objects out. No builder changes its arguments.

- ``spec_configmap``: the job spec the driver reads, as ``job.json`` (owned by the RLJob).
- ``rayjob``: a KubeRay ``ray.io/v1`` RayJob in HTTPMode whose Ray cluster has a CPU head (runs the
  driver), a generation group and a training group. Each actor gets its own pod with its GPUs
  (requests = limits), ``num-gpus`` and a custom Ray resource (``fp8rl_generation`` /
  ``fp8rl_training``) that pins the driver's actors to their group.
- ``network_policy``: the job's pods admit traffic only from each other, from the metrics scrapers
  (Prometheus, this operator) on the driver's metrics port, and from the KubeRay operator on the
  Ray dashboard port; everything else is denied.
- ``ray_token_secret`` (``ray_auth: secret`` only): the token every Ray process and client of the
  job must present; with ``ray_auth: kuberay`` the RayJob asks KubeRay for one (``authOptions``).
- everything built carries the RLJob's marks (``operators.ownership``): its labels and an owner
  reference, so Kubernetes garbage-collects it with the RLJob and the operator knows it as its own.

Every pod (head, workers, submitter) passes Pod Security ``restricted``: non-root (uid 1000, the
worker image's), no privilege escalation, no capabilities, the runtime's default seccomp profile.
Each works in ``/data`` (``rljob.paths.POD_HOME``), an emptyDir of ``work_dir_size`` that any uid
may write, so a job's relative ``output_dir`` and downloads land somewhere writable.

Nothing here talks to the API server; every builder is unit-tested and validated against
KubeRay's CRD schema and the Kubernetes schemas.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any

from operators.attempts import CAUSE
from operators.ownership import RLJOB_LABEL, meta
from operators.settings import OperatorSettings
from rljob import resource as rl
from rljob.graders import GRADER_SECRETS_DIR, grader_secrets
from rljob.paths import POD_HOME
from rljob.resource import Pool, RLJob, RLJobSpec
from rljob.run_dir import JOB_SPEC, driver_argv

SPEC_HASH = "fp8rl.io/spec-hash"
SPEC_DIR = "/etc/fp8rl"
RUNS_DIR = "/runs"
DASHBOARD_PORT = 8265  # Ray's dashboard: the Jobs API KubeRay submits HTTP-mode jobs to
RAY_TOKEN_KEY = "auth_token"  # the Secret's key (the name KubeRay uses for the Secrets it makes)

# scheduler -> labels on the RayJob for its queue (KubeRay's batch-scheduler integrations)
QUEUE_LABELS = {
    "kueue": lambda q: {"kueue.x-k8s.io/queue-name": q},
    "volcano": lambda q: {"ray.io/scheduler-name": "volcano", "volcano.sh/queue-name": q},
    "kai": lambda q: {"ray.io/scheduler-name": "kai-scheduler", "kai.scheduler/queue": q},
}


def configmap_name(name: str) -> str:
    return f"{name}-spec"


def ray_token_secret_name(job: RLJob) -> str:
    """``<name>-ray-token-<uid prefix>``: never an object that existed before the RLJob
    (``operators.ownership``: the operator cannot read Secrets to check whose one is)."""
    return f"{job.metadata.name}-ray-token-{job.metadata.uid[:8]}"


def spec_hash(spec: RLJobSpec) -> str:
    """Identifies the job spec a RayJob was built from (``spec.suspend`` excluded)."""
    text = json.dumps(spec.model_dump(mode="json", exclude={"suspend"}, by_alias=True), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def spec_configmap(job: RLJob) -> dict[str, Any]:
    """The job spec the driver reads, mounted at ``SPEC_DIR`` (its key is the file name)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(job, configmap_name(job.metadata.name)),
        "data": {JOB_SPEC: job.spec.job.model_dump_json(indent=2)},
    }


def ray_token_secret(job: RLJob, token: str) -> dict[str, Any]:
    """The job's Ray token (``ray_auth: secret``): ``token`` comes from the caller, so that this
    builder stays a function of its arguments."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta(job, ray_token_secret_name(job)),
        "type": "Opaque",
        "stringData": {RAY_TOKEN_KEY: token},
    }


def network_policy(job: RLJob, s: OperatorSettings) -> dict[str, Any]:
    """Ingress to the job's pods (head, workers, submitter: all carry ``RLJOB_LABEL``) only from
    the job's own pods (any port: Ray's GCS, object manager, workers and NCCL all connect between
    them), from ``s.metrics_from`` on the driver's metrics port, and from ``s.dashboard_from`` on
    the Ray dashboard port. Other traffic to these pods is denied once a policy selects them;
    egress is left open (models and datasets are downloaded)."""
    own = {"podSelector": {"matchLabels": {RLJOB_LABEL: job.metadata.name}}}
    ingress: list[dict[str, Any]] = [{"from": [own]}]
    if s.metrics_from:
        ingress.append({"from": [p.manifest() for p in s.metrics_from], "ports": _tcp(s.metrics_port)})
    if s.dashboard_from:
        ingress.append({"from": [p.manifest() for p in s.dashboard_from], "ports": _tcp(DASHBOARD_PORT)})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(job, job.metadata.name),
        "spec": {
            "podSelector": {"matchLabels": {RLJOB_LABEL: job.metadata.name}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _tcp(port: int) -> list[dict[str, Any]]:
    return [{"port": port, "protocol": "TCP"}]


def _pool(own: Pool, default: Pool) -> dict[str, Any]:
    selector = own.node_selector if own.node_selector is not None else default.node_selector
    tolerations = own.tolerations if own.tolerations is not None else default.tolerations
    out: dict[str, Any] = {}
    if selector:
        out["nodeSelector"] = dict(selector)
    if tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]
    return out


def _security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


# the pods' identity: the worker image's user (uid 1000, gid 100), Pod Security "restricted"
POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 100,
    "fsGroup": 100,
    "seccompProfile": {"type": "RuntimeDefault"},
}
WORK_VOLUME = "work"


def _work_volume(s: OperatorSettings) -> tuple[dict[str, Any], str]:
    """The pods' working directory: an emptyDir (world-writable, so any uid may write it)."""
    return {"name": WORK_VOLUME, "emptyDir": {"sizeLimit": s.work_dir_size}}, str(POD_HOME)


def _pod(
    job: RLJob,
    s: OperatorSettings,
    container: dict[str, Any],
    group: str,
    placement: dict[str, Any],
    extra_volumes: list[tuple[dict[str, Any], str]],
) -> dict[str, Any]:
    """A pod template; ``extra_volumes``: (volume, where it is mounted)."""
    cluster = job.spec.cluster
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": s.shm_size}}]
    extra_volumes = [_work_volume(s), *extra_volumes]
    volumes += [volume for volume, _ in extra_volumes]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    mounts += [{"name": volume["name"], "mountPath": path} for volume, path in extra_volumes]
    if cluster.volume_claim:
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": cluster.volume_claim}})
        mounts.append({"name": "runs", "mountPath": RUNS_DIR})
    spec: dict[str, Any] = {
        "containers": [
            {
                "image": cluster.image or s.image,
                "imagePullPolicy": s.image_pull_policy,
                "workingDir": str(POD_HOME),  # the job's relative paths resolve here (rljob.paths)
                "securityContext": _security(),
                "volumeMounts": mounts,
                **container,
            }
        ],
        "volumes": volumes,
        "securityContext": dict(POD_SECURITY),
        # a job's code never calls the Kubernetes API: no token of its service account in its pods
        "automountServiceAccountToken": False,
        **placement,
    }
    if s.service_account:
        spec["serviceAccountName"] = s.service_account
    if cluster.priority_class:
        spec["priorityClassName"] = cluster.priority_class
    labels = {RLJOB_LABEL: job.metadata.name, "fp8rl.io/group": group}
    return {"metadata": {"labels": labels}, "spec": spec}


def _env(job: RLJob, s: OperatorSettings, values: dict[str, str]) -> list[dict[str, Any]]:
    """``values`` as container env, and with ``ray_auth: secret`` the job's Ray token (KubeRay sets
    both itself with ``ray_auth: kuberay``)."""
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(values.items())]
    if s.ray_auth == "secret":
        ref = {"name": ray_token_secret_name(job), "key": RAY_TOKEN_KEY}
        env += [
            {"name": rl.RAY_AUTH_MODE_ENV, "value": "token"},
            {"name": rl.RAY_AUTH_TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}},
        ]
    return env


def metrics_linger(s: OperatorSettings) -> int:
    """How long the driver serves its metrics after its run ends with ``ray_auth: secret``: such a
    KubeRay cannot read the Ray job's outcome, so the operator reads ``fp8rl_run_complete`` there;
    three of its polls (10 s to 10 min). None is needed where KubeRay reads the outcome itself."""
    if s.ray_auth != "secret":
        return 0
    return int(min(600, max(10, 3 * s.poll_seconds)))


def entrypoint(job: RLJob, s: OperatorSettings) -> str:
    """The driver command (``rljob.run_dir.driver_argv``): always ``--resume``, so a resumed RayJob
    continues from the checkpoint (on a fresh output directory it starts from step 1), and
    Prometheus on the operator's metrics port of the head pod, where the operator scrapes progress."""
    argv = driver_argv(
        f"{SPEC_DIR}/{JOB_SPEC}",
        job.spec.job.output_dir,
        job=job.metadata.name,
        namespace=job.metadata.namespace,
        resume=True,
        metrics_port=s.metrics_port,
        metrics_linger=metrics_linger(s),
        in_place_retries=_pick(job.spec.cluster.in_place_retries, s.in_place_retries),
    )
    return shlex.join(argv)


def _group(job: RLJob, s: OperatorSettings, group: str, actors: int, gpus: int) -> dict[str, Any]:
    spec = job.spec
    cluster = spec.cluster
    own, default = (
        (cluster.generation, s.generation) if group == "generation" else (cluster.training, s.training)
    )
    limits: dict[str, str] = {
        "memory": s.worker_memory,
        "cpu": str(max(1, int(spec.job.resources.cpus_per_actor))),
    }
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    container = {
        "name": "ray-worker",
        "env": _env(job, s, s.nccl_env),
        "resources": {"requests": dict(limits), "limits": dict(limits)},
    }
    return {
        "groupName": group,
        "replicas": actors,
        "minReplicas": actors,
        "maxReplicas": actors,
        "rayStartParams": {
            "num-gpus": str(gpus),
            "resources": json.dumps(json.dumps({rl.RAY_GROUP_RESOURCES[group]: 1})),
        },
        "template": _pod(job, s, container, group, _pool(own, default), []),
    }


def rayjob(job: RLJob, s: OperatorSettings, cause: str = "created") -> dict[str, Any]:
    """The RayJob for an RLJob (same name and namespace); ``cause``: why it is made (its
    ``fp8rl.io/attempt-cause`` annotation, read back by ``operators.attempts``)."""
    spec, name = job.spec, job.metadata.name
    cluster, res = spec.cluster, spec.job.resources
    labels = QUEUE_LABELS[cluster.queue.scheduler](cluster.queue.name) if cluster.queue else {}
    head_resources = {"cpu": s.head_cpu, "memory": s.head_memory}
    spec_volume = {"name": "job-spec", "configMap": {"name": configmap_name(name)}}
    head_container = {
        "name": "ray-head",
        "env": _env(job, s, {**s.nccl_env, rl.RAY_GROUPS_ENV: "1"}),
        "resources": {"requests": dict(head_resources), "limits": dict(head_resources)},
        "ports": [
            {"name": "gcs", "containerPort": 6379},
            {"name": "dashboard", "containerPort": DASHBOARD_PORT},
            {"name": "client", "containerPort": 10001},
            {"name": "fp8rl-metrics", "containerPort": s.metrics_port},
        ],
    }
    # Kueue admits a job by unsuspending it: it must be created suspended
    suspend = spec.suspend or bool(cluster.queue and cluster.queue.scheduler == "kueue")
    body: dict[str, Any] = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {**meta(job, name, labels), "annotations": {SPEC_HASH: spec_hash(spec), CAUSE: cause}},
        "spec": {
            # KubeRay (>= 1.5.1, with authOptions) submits with the token itself; a KubeRay that
            # cannot does not know the token, so a submitter pod that has it submits (ray_auth: secret)
            "submissionMode": "HTTPMode" if s.ray_auth == "kuberay" else "K8sJobMode",
            "entrypoint": entrypoint(job, s),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": _pick(
                cluster.ttl_seconds_after_finished, s.ttl_seconds_after_finished
            ),
            "activeDeadlineSeconds": _pick(cluster.active_deadline_seconds, s.active_deadline_seconds),
            # KubeRay retries a Failed RayJob on a new cluster; with ray_auth: secret every ending
            # looks Failed to a KubeRay older than 1.5.1 (it cannot read the outcome), so a
            # succeeded job would run again: the operator retries those itself (operators.plan)
            "backoffLimit": _pick(cluster.backoff_limit, s.backoff_limit) if s.ray_auth == "kuberay" else 0,
            "suspend": suspend,
            "rayClusterSpec": {
                "rayVersion": s.ray_version,
                "enableInTreeAutoscaling": False,
                "headGroupSpec": {
                    "rayStartParams": {"num-gpus": "0", "no-monitor": "true", "dashboard-host": "0.0.0.0"},
                    "template": _pod(
                        job, s, head_container, "head", {}, [(spec_volume, SPEC_DIR), *_grader_secrets(job)]
                    ),
                },
                "workerGroupSpecs": [
                    _group(job, s, "generation", res.generators, res.gpus_per_generator),
                    _group(job, s, "training", res.trainers, res.gpus_per_trainer),
                ],
            },
        },
    }
    if s.ray_auth == "kuberay":
        body["spec"]["rayClusterSpec"]["authOptions"] = {"mode": "token"}
    else:
        body["spec"]["submitterPodTemplate"] = _submitter(job, s)
    return body


def _grader_secrets(job: RLJob) -> list[tuple[dict[str, Any], str]]:
    """The Secrets the job's http graders read their tokens from, as (volume, mount path) on the
    head pod, where the driver grades: each at ``GRADER_SECRETS_DIR/<name>`` (its keys as files)."""
    refs = grader_secrets(job.spec.job.task.grader_list())
    names = sorted({r.name for r in refs})
    return [
        ({"name": f"grader-secret-{i}", "secret": {"secretName": name}}, f"{GRADER_SECRETS_DIR}/{name}")
        for i, name in enumerate(names)
    ]


def kuberay_knows_auth_options(crd: dict[str, Any]) -> bool:
    """Whether KubeRay's RayJob CRD (``rayjobs.ray.io`` as read from the API server) has
    ``spec.rayClusterSpec.authOptions`` in its ``v1`` schema (KubeRay >= 1.5.1). An older CRD
    prunes the field without an error, and the job's Ray cluster would start without a token."""
    for version in (crd.get("spec") or {}).get("versions") or []:
        if version.get("name") != "v1":
            continue
        node: Any = ((version.get("schema") or {}).get("openAPIV3Schema")) or {}
        for key in ("spec", "rayClusterSpec", "authOptions"):
            node = (node.get("properties") or {}).get(key) if isinstance(node, dict) else None
            if node is None:
                return False
        return True
    return False


def _submitter(job: RLJob, s: OperatorSettings) -> dict[str, Any]:
    """The pod that runs ``ray job submit`` (``ray_auth: secret``): KubeRay fills in its command
    and the dashboard's address; it brings the token, the image and the job's pod rules."""
    resources = {"cpu": "500m", "memory": "512Mi"}
    container = {
        "name": "ray-job-submitter",
        "image": job.spec.cluster.image or s.image,
        "imagePullPolicy": s.image_pull_policy,
        "env": _env(job, s, {}),
        "securityContext": _security(),
        "resources": {"requests": dict(resources), "limits": dict(resources)},
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "securityContext": dict(POD_SECURITY),
        "automountServiceAccountToken": False,
    }
    if s.service_account:
        spec["serviceAccountName"] = s.service_account
    labels = {RLJOB_LABEL: job.metadata.name, "fp8rl.io/group": "submitter"}
    return {"metadata": {"labels": labels}, "spec": spec}


def _pick(own: int | None, default: int) -> int:
    return own if own is not None else default
