"""Which objects are an RLJob's own, so that the operator touches nothing else.

Every object the operator makes for an RLJob (its RayJob, ConfigMap, NetworkPolicy and Ray token
Secret) carries two marks: the labels ``app.kubernetes.io/managed-by: fp8rl-operator`` and
``fp8rl.io/rljob: <name>``, and an owner reference to the RLJob's uid (``controller: true``, so that
Kubernetes collects it with the RLJob). An object is the RLJob's own only with both. Names are
predictable (``<name>``, ``<name>-spec``), so an object of that name may be someone else's: an
admin's deny-all NetworkPolicy, a tenant's ConfigMap, a RayJob made by hand. The operator reads
before it writes, and one that is not its own fails the RLJob with condition ``NameConflict``
instead of being patched, rewritten or deleted (``operators.plan``).

Labels alone prove nothing (whoever may create the object may copy them); the owner reference to
the RLJob's uid can only be set by someone who could see that uid, and it is what the garbage
collector follows. Both are checked because labels are what the operator's watches select on.

An object left by an earlier RLJob of the same name (same labels, another uid: the garbage
collector has not reached it yet) is ``PREVIOUS``: the operator waits for it to go.

The owner reference sets no ``blockOwnerDeletion``: on clusters with the
OwnerReferencesPermissionEnforcement admission plugin that needs the right to update the RLJob's
finalizers, and the operator's own finalizer already deletes a job's RayJob before the RLJob goes.

The Ray token Secret is never read (the operator may create Secrets, not read them), so its name
carries the RLJob's uid: no object made before the RLJob existed can have it, and it is never
deleted by name, only collected with its owner.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from rljob import resource as rl
from rljob.resource import ObjectMeta, RLJob

MANAGED_BY = {"app.kubernetes.io/managed-by": "fp8rl-operator"}
RLJOB_LABEL = "fp8rl.io/rljob"


class Ownership(StrEnum):
    OURS = "ours"  # this RLJob's (labels, and an owner reference to its uid)
    PREVIOUS = "previous"  # an earlier RLJob of the same name's, not yet collected
    FOREIGN = "foreign"  # anything else: never touched


def owner_reference(job: RLJob) -> dict[str, Any]:
    return {
        "apiVersion": rl.API_VERSION,
        "kind": rl.KIND,
        "name": job.metadata.name,
        "uid": job.metadata.uid,
        "controller": True,
    }


def meta(job: RLJob, name: str, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    """``metadata`` of an object made for ``job``: its name and namespace, the two marks."""
    return {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": {**MANAGED_BY, RLJOB_LABEL: job.metadata.name, **(extra_labels or {})},
        "ownerReferences": [owner_reference(job)],
    }


def ownership(obj: dict[str, Any], job: ObjectMeta) -> Ownership:
    """Whose ``obj`` (as read from the API server) is, seen from the RLJob of ``job``."""
    metadata = obj.get("metadata") or {}
    labels = metadata.get("labels") or {}
    marked = all(labels.get(k) == v for k, v in MANAGED_BY.items()) and labels.get(RLJOB_LABEL) == job.name
    controllers = [
        ref
        for ref in metadata.get("ownerReferences") or []
        if ref.get("kind") == rl.KIND
        and str(ref.get("apiVersion", "")).startswith(f"{rl.GROUP}/")
        and ref.get("controller")
    ]
    if marked and job.uid and any(ref.get("uid") == job.uid for ref in controllers):
        return Ownership.OURS
    if marked and controllers and all(ref.get("name") == job.name for ref in controllers):
        return Ownership.PREVIOUS
    return Ownership.FOREIGN


def describe(kind: str, obj: dict[str, Any]) -> str:
    """``Kind namespace/name`` of an object, as events and conditions name it."""
    metadata = obj.get("metadata") or {}
    return f"{kind} {metadata.get('namespace', '')}/{metadata.get('name', '')}"
