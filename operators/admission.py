"""What the operator refuses before it builds anything for an RLJob: asks no node of the default
pools can meet, files outside the pods' reach, an output directory the pods cannot write, an
image outside the allow-list. Each is a list of problems, each naming its field and what to do;
``operators.plan`` fails the RLJob with reason ``InvalidSpec`` and all of them."""

from __future__ import annotations

import posixpath
from typing import Any

from operators.builders import RUNS_DIR
from operators.settings import OperatorSettings
from rljob import images, paths
from rljob.paths import POD_HOME
from rljob.resource import RLJobSpec


def problems(spec: RLJobSpec, s: OperatorSettings, namespace: str = "") -> list[str]:
    """Every refusal below, in order."""
    return (
        placement_problems(spec, s)
        + policy_problems(spec, s, namespace)
        + path_problems(spec, s)
        + output_problems(spec)
        + image_problems(spec, s)
    )


def policy_problems(spec: RLJobSpec, s: OperatorSettings, namespace: str) -> list[str]:
    """What ``spec.cluster`` asks for beyond its namespace's policy (``OperatorSettings.job_policy``):
    a priority class, node selector, toleration, queue or volume claim the cluster's admin did not
    list for this tenant. Unchecked, a tenant with only RLJob rights could schedule onto the control
    plane's nodes, preempt other teams (system-node-critical), use their queue or mount their data."""
    policy, cluster, out = s.job_policy(namespace), spec.cluster, []
    where = f"for namespace {namespace!r}" if namespace else "for this namespace"
    how = "ask the cluster's admin to list it in the chart's tenants[].jobPolicy, or leave the field unset"

    def refuse(field: str, value: object, allowed: list[Any]) -> None:
        shown = ", ".join(repr(a) for a in allowed) or "none"
        out.append(f"{field}: {value!r} is not allowed {where} (allowed: {shown}); {how}")

    if cluster.priority_class is not None and cluster.priority_class not in policy.priority_classes:
        refuse("spec.cluster.priorityClassName", cluster.priority_class, policy.priority_classes)
    for group in ("generation", "training"):
        pool = getattr(cluster, group)
        if pool.node_selector is not None and pool.node_selector not in policy.node_selectors:
            refuse(f"spec.cluster.{group}.nodeSelector", pool.node_selector, policy.node_selectors)
        for i, toleration in enumerate(pool.tolerations or []):
            if toleration not in policy.tolerations:
                allowed = [t.model_dump(by_alias=True, exclude_none=True) for t in policy.tolerations]
                refuse(
                    f"spec.cluster.{group}.tolerations.{i}",
                    toleration.model_dump(by_alias=True, exclude_none=True),
                    allowed,
                )
    if cluster.queue is not None:
        queue = f"{cluster.queue.scheduler}/{cluster.queue.name}"
        if queue not in policy.queues:
            refuse("spec.cluster.queue", queue, policy.queues)
    if cluster.volume_claim is not None and cluster.volume_claim not in policy.volume_claims:
        refuse("spec.cluster.volumeClaim", cluster.volume_claim, policy.volume_claims)
    return out


def placement_problems(spec: RLJobSpec, s: OperatorSettings) -> list[str]:
    """Asks no node of the default pools can meet: a pod wanting more GPUs than a node has would
    stay Pending forever, so the operator fails the job at once, naming the field. A job that
    picks its own pool (``spec.cluster.<group>.nodeSelector``) is not checked."""
    res, out = spec.job.resources, []
    if res.share_gpu:
        out.append(
            "spec.job.resources.share_gpu: true puts every actor on one GPU of one machine (fp8rl run); "
            "on a cluster each pod gets whole GPUs: set it to false"
        )
    checks = (
        ("generation", "gpus_per_generator", res.gpus_per_generator, s.generation_max_gpus_per_pod),
        ("training", "gpus_per_trainer", res.gpus_per_trainer, s.training_max_gpus_per_pod),
    )
    for group, field, asked, most in checks:
        own_pool = getattr(spec.cluster, group).node_selector is not None
        if most is not None and asked > most and not own_pool:
            out.append(
                f"spec.job.resources.{field}: {asked} GPUs in one pod, but nodes of the {group} pool have "
                f"{most}; ask for at most {most}, or name a larger pool in spec.cluster.{group}.nodeSelector"
            )
    return out


def path_problems(spec: RLJobSpec, s: OperatorSettings) -> list[str]:
    """Files the job names outside its pods' /data and the read-only roots (:mod:`rljob.paths`):
    the same rule the service applies at POST, here for RLJobs created with kubectl."""
    found = paths.path_problems(spec.job, POD_HOME, s.model_roots, resolve=False)
    return [f"spec.job.{p.field}: {p.message}" for p in found]


def output_problems(spec: RLJobSpec) -> list[str]:
    """Where the driver writes must be writable in its pod: relative (under /data, the pods' work
    directory) or absolute under /data, or under /runs when ``spec.cluster.volumeClaim`` mounts a
    volume there. Anything else (``/runs`` without a volume, ``/tmp``, ``/``) fails at the first
    checkpoint, as uid 1000 on a root-owned directory."""
    out = spec.job.output_dir
    if not posixpath.isabs(out):
        out = posixpath.join(str(POD_HOME), out)
    out = posixpath.normpath(out)
    writable = [str(POD_HOME)] + ([RUNS_DIR] if spec.cluster.volume_claim else [])
    if any(out == root or out.startswith(root + "/") for root in writable):
        return []
    runs = (
        f"; {RUNS_DIR} is writable only with spec.cluster.volumeClaim (a volume mounted there)"
        if out.startswith(RUNS_DIR + "/") or out == RUNS_DIR
        else ""
    )
    return [
        f"spec.job.output_dir: {spec.job.output_dir!r} is not writable in the job's pods: give a path "
        f"relative to {POD_HOME} (e.g. runs/<name>), where the driver runs{runs}"
    ]


def image_problems(spec: RLJobSpec, s: OperatorSettings) -> list[str]:
    """``spec.cluster.image`` outside the operator's allow-list (:mod:`rljob.images`). The
    operator's own default image is not checked: the chart set it."""
    image = spec.cluster.image
    if image is None:
        return []
    found = images.image_problems(image, s.image_prefixes())
    hint = "the cluster's admin allows more with the chart's jobDefaults.allowedImages"
    return [f"spec.cluster.image: {problem}; {hint}" for problem in found]
