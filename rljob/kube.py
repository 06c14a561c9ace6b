"""The RLJob client both the service (``--store kubernetes``) and the operator use: each job is an
RLJob custom resource in its tenant's namespace.

The RLJob is the record; there is no second copy. Creating a job creates the object (a name taken
in that namespace is 409 from the API server, surfaced as ``JobExists``); status changes write the
status subresource with the ``resourceVersion`` that was read, so a concurrent writer (the
operator) makes the API server answer 409 Conflict and the change is re-applied to the fresh
status. Suspend and resume set ``spec.suspend``, which the operator acts on. The tenant's
namespace is the tenant name (a DNS label, checked when tokens are loaded); it must exist.

Talks to the API server through the official ``kubernetes`` client: in-cluster config when running
in a pod, else ``KUBECONFIG`` / ``~/.kube/config``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

from pydantic import ValidationError

from rljob import resource as rl
from rljob.jobs import (
    InvalidRecord,
    Job,
    JobExists,
    JobNotFound,
    Limits,
    OverLimit,
    TenantNamespaceMissing,
    check_limits,
    check_storage,
    gpus_of,
)
from rljob.spec import JobSpec, describe_errors
from rljob.status import ACTIVE, IllegalTransition, JobStatus, Phase

log = logging.getLogger("fp8rl.rljob")

CONFLICT_RETRIES = 8


@contextmanager
def _job_not_found(name: str) -> Iterator[None]:
    """A 404 from the API server as ``JobNotFound``."""
    from kubernetes.client.exceptions import ApiException

    try:
        yield
    except ApiException as err:
        if err.status == 404:
            raise JobNotFound(name) from None
        raise


def api_client(kubeconfig: str | None = None) -> Any:
    """A ``kubernetes.client.ApiClient``: in-cluster config in a pod, else the kubeconfig."""
    from kubernetes import client, config

    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()  # type: ignore[no-untyped-call]
        return client.ApiClient()
    return config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]


class PhaseWatch:
    """Every RLJob's (namespace, name) -> phase, kept by a watch: one cluster-wide LIST when it
    starts (and again only when the API server has compacted past the watch's version: 410 Gone),
    then WATCH events, in a daemon thread. ``counts`` reads memory, so a scrape costs the API
    server nothing."""

    WATCH_S = 240  # each WATCH call's server-side bound; the next resumes from the last version
    RETRY_S = (2.0, 60.0)  # after a failed call: the first wait, doubled up to the second

    def __init__(self, objects: Any) -> None:
        self._objects = objects
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="rljob-phase-watch", daemon=True)
        self._thread.start()

    def counts(self, timeout: float = 30.0) -> dict[tuple[str, str], int]:
        """(namespace, phase) -> RLJobs; waits for the first LIST (at most ``timeout`` s)."""
        if not self._ready.wait(timeout):
            raise TimeoutError("the RLJob watch has not listed the jobs yet; the API server may be down")
        out: dict[tuple[str, str], int] = {}
        with self._lock:
            for (namespace, _), phase in self._phases.items():
                out[namespace, phase] = out.get((namespace, phase), 0) + 1
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    @staticmethod
    def _key_phase(obj: dict[str, Any]) -> tuple[tuple[str, str], str]:
        meta = obj.get("metadata") or {}
        return (meta.get("namespace", ""), meta.get("name", "")), rl.status_of(obj).phase.value

    def _list(self) -> str:
        out = self._objects.list_cluster_custom_object(rl.GROUP, rl.VERSION, rl.PLURAL)
        phases = dict(self._key_phase(obj) for obj in out.get("items") or [])
        with self._lock:
            self._phases = phases
        self._ready.set()
        return str((out.get("metadata") or {}).get("resourceVersion", ""))

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        version, wait = "", self.RETRY_S[0]
        while not self._stop.is_set():
            try:
                if not version:
                    version = self._list()
                self._watch = watch.Watch()  # type: ignore[no-untyped-call]
                for event in self._watch.stream(
                    self._objects.list_cluster_custom_object, rl.GROUP, rl.VERSION, rl.PLURAL,
                    resource_version=version, timeout_seconds=self.WATCH_S, allow_watch_bookmarks=True,
                ):  # fmt: skip
                    obj, kind = event["object"], event["type"]
                    if kind == "ERROR":
                        version = ""  # 410 Gone: the version is compacted away; list again
                        break
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if kind == "BOOKMARK":
                        continue
                    key, phase = self._key_phase(obj)
                    with self._lock:
                        if kind == "DELETED":
                            self._phases.pop(key, None)
                        else:
                            self._phases[key] = phase
                wait = self.RETRY_S[0]  # a call that ended well
            except ApiException as err:
                if err.status == 410:
                    version = ""
                    continue
                log.warning("RLJob watch: %s %s; retrying in %.0f s", err.status, err.reason, wait)
                self._stop.wait(wait)
                wait = min(2 * wait, self.RETRY_S[1])
            except Exception as err:  # the connection dropped: watch again from the last version
                if self._stop.is_set():
                    return
                log.warning("RLJob watch: %s; retrying in %.0f s", err, wait)
                self._stop.wait(wait)
                wait = min(2 * wait, self.RETRY_S[1])


class KubernetesJobStore:
    """The ``JobStore`` protocol over RLJob objects."""

    def __init__(self, api: Any = None) -> None:
        from kubernetes import client

        self._api = api if api is not None else api_client()
        self._objects = client.CustomObjectsApi(self._api)
        self._phase_watch: PhaseWatch | None = None  # started by the first count_by_phase
        self._watch_lock = threading.Lock()

    # -- helpers --------------------------------------------------------------------------------

    def _args(self, namespace: str) -> tuple[str, str, str, str]:
        return (rl.GROUP, rl.VERSION, namespace, rl.PLURAL)

    def _job(self, obj: dict[str, Any]) -> Job:
        """The record of an RLJob. One whose spec does not validate (written with kubectl past the
        CRD schema) raises ``InvalidRecord``: listings skip it, GET says what is wrong."""
        meta = obj.get("metadata") or {}
        try:
            spec = rl.spec_of(obj).job
        except ValidationError as err:
            problems = "; ".join(describe_errors(err))
            invalid = InvalidRecord(
                f"RLJob {meta.get('name')!r} has an invalid spec: {problems}; "
                "fix it (kubectl edit) or delete it"
            )
            invalid.problem = problems
            raise invalid from None
        status = rl.status_of(obj)
        created = rl.created_of(obj)
        stamps = [c.last_transition for c in status.conditions]
        return Job(
            tenant=meta.get("namespace", ""),
            name=meta["name"],
            spec=spec,
            status=status,
            created=created,
            updated=max([created, *stamps]),
        )

    def _read(self, tenant: str, name: str) -> dict[str, Any]:
        with _job_not_found(name):
            return cast(dict[str, Any], self._objects.get_namespaced_custom_object(*self._args(tenant), name))

    def _list(self, tenant: str | None) -> list[dict[str, Any]]:
        if tenant is None:
            out = cast(
                dict[str, Any], self._objects.list_cluster_custom_object(rl.GROUP, rl.VERSION, rl.PLURAL)
            )
        else:
            out = cast(dict[str, Any], self._objects.list_namespaced_custom_object(*self._args(tenant)))
        items: list[dict[str, Any]] = out.get("items") or []
        return items

    # -- JobStore -------------------------------------------------------------------------------

    def create(self, tenant: str, name: str, spec: JobSpec, limits: Limits | None = None) -> Job:
        """The API server has no transaction across a list and a create: two POSTs racing for a
        tenant's last slot may both pass ``limits`` (the cluster's ResourceQuota, if any, is the
        hard cap there)."""
        from kubernetes.client.exceptions import ApiException

        body = rl.manifest(name, tenant, spec, tenant=tenant)
        if limits is not None:
            items = self._list(tenant)
            size = sum(
                len(json.dumps(obj.get("spec") or {})) + len(json.dumps(obj.get("status") or {}))
                for obj in items
            )
            check_storage(tenant, len(items), size, len(json.dumps(body["spec"])), limits)
            check_limits(tenant, spec, *self._usage_of(items), limits)

        try:
            obj = cast(
                dict[str, Any], self._objects.create_namespaced_custom_object(*self._args(tenant), body)
            )
        except ApiException as err:
            if err.status == 409:
                raise JobExists(name) from None
            if err.status == 404:
                raise TenantNamespaceMissing(
                    f"namespace {tenant!r} of tenant {tenant!r} does not exist on the cluster; "
                    "a cluster admin must create it"
                ) from None
            said = str(err.body or "")
            if err.status == 403 and "exceeded quota" in said:
                raise OverLimit(
                    f"the namespace's ResourceQuota allows no more RLJobs for tenant {tenant!r}; delete "
                    "finished or cancelled jobs first"
                ) from None
            if err.status == 403 and "cannot create resource" in said:
                # the control plane may write RLJobs in the tenants' namespaces alone (RBAC)
                raise TenantNamespaceMissing(
                    f"namespace {tenant!r} of tenant {tenant!r} is not a tenant namespace of this "
                    "installation (or does not exist); a cluster admin must add it (the chart's tenants[])"
                ) from None
            raise  # anything else, a quota not counted yet among them: 503, try again
        return self._job(obj)

    def get(self, tenant: str, name: str) -> Job:
        return self._job(self._read(tenant, name))

    def _valid(self, items: list[dict[str, Any]]) -> list[Job]:
        jobs = []
        for obj in items:
            try:
                jobs.append(self._job(obj))
            except InvalidRecord as err:
                log.warning("%s (skipped; the operator marks it Failed)", err)
        return jobs

    def query(
        self, tenant: str | None, phase: Phase | None = None, limit: int = 50, offset: int = 0
    ) -> tuple[list[Job], int]:
        jobs = self._valid(self._list(tenant))
        if phase is not None:
            jobs = [j for j in jobs if j.status.phase is phase]
        jobs.sort(key=lambda j: (j.created, j.name))
        return jobs[offset : offset + limit], len(jobs)

    def update(
        self,
        tenant: str,
        name: str,
        change: Callable[[JobStatus], JobStatus],
        limits: Limits | None = None,
    ) -> Job:
        """Read, apply ``change`` (which may raise IllegalTransition), write with the version read;
        on 409 Conflict read again and re-apply. With ``limits``, a change that makes the job active
        is refused with ``OverLimit`` where the tenant's other active jobs leave no room (read just
        before: as with ``create``, two racing resumes may both pass; a ResourceQuota is the hard cap)."""
        if limits is not None:
            job = self.get(tenant, name)
            if job.status.phase not in ACTIVE:
                try:
                    activates = change(job.status).phase in ACTIVE
                except IllegalTransition:
                    activates = False  # the write below raises it again
                if activates:
                    check_limits(tenant, job.spec, *self.usage(tenant), limits)
        return self._job(self.write_status(tenant, name, change))

    def write_status(
        self, tenant: str, name: str, change: Callable[[JobStatus], JobStatus]
    ) -> dict[str, Any]:
        """``update`` without reading the spec (the operator writes status of invalid RLJobs too);
        returns the object as written."""
        from kubernetes.client.exceptions import ApiException

        for _ in range(CONFLICT_RETRIES):
            obj = self._read(tenant, name)
            new = change(rl.status_of(obj))
            body: dict[str, Any] = {"status": new.model_dump(mode="json")}
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if version:
                body["metadata"] = {"resourceVersion": version}
            try:
                written = self._objects.patch_namespaced_custom_object_status(*self._args(tenant), name, body)
            except ApiException as err:
                if err.status == 409:
                    continue
                if err.status == 404:
                    raise JobNotFound(name) from None
                raise
            return cast(dict[str, Any], written)
        raise RuntimeError(f"RLJob {tenant}/{name}: status kept changing under us; try again")

    def set_suspend(self, tenant: str, name: str, suspend: bool) -> None:
        """Set ``spec.suspend`` (the operator suspends or resumes the RayJob)."""
        with _job_not_found(name):
            self._objects.patch_namespaced_custom_object(
                *self._args(tenant), name, {"spec": {"suspend": suspend}}
            )

    def delete(self, tenant: str, name: str) -> None:
        with _job_not_found(name):
            self._objects.delete_namespaced_custom_object(*self._args(tenant), name)

    def usage(self, tenant: str) -> tuple[int, int]:
        return self._usage_of(self._list(tenant))

    def _usage_of(self, items: list[dict[str, Any]]) -> tuple[int, int]:
        """(active jobs, GPUs they request) among ``items``, RLJobs as listed."""
        active = [j for j in self._valid(items) if j.status.phase in ACTIVE]
        return len(active), sum(gpus_of(j.spec) for j in active)

    def count_by_phase(self) -> dict[tuple[str, str], int]:
        """From a watch on every RLJob (:class:`PhaseWatch`), started at the first call."""
        with self._watch_lock:
            if self._phase_watch is None:
                self._phase_watch = PhaseWatch(self._objects)
        return self._phase_watch.counts()

    def ping(self) -> None:
        """One cheap API call for ``/readyz``."""
        self._objects.list_cluster_custom_object(rl.GROUP, rl.VERSION, rl.PLURAL, limit=1)

    def close(self) -> None:
        if self._phase_watch is not None:
            self._phase_watch.stop()
        self._api.close()
