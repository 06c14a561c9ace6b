"""What the operator does for one RLJob, through the Kubernetes API: keep its ConfigMap and RayJob
as the builders say, mirror the RayJob's status and the driver's progress into the RLJob's
status, and post an Event for every transition and error. The kopf handlers (``handlers.py``) only
call into this; every step is idempotent, so a restarted operator creates no duplicates."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import ValidationError

from operators import builders
from operators.settings import OperatorSettings
from operators.status import advance, progress_of, target_of
from rljob import resource as rl
from rljob.jobs import JobNotFound
from rljob.kube import KubernetesJobStore
from rljob.spec import describe_errors
from rljob.status import TERMINAL, Condition, JobStatus, Phase, Reason

log = logging.getLogger("fp8rl.operator")
RAY = ("ray.io", "v1")


def unless_missing(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or None where the API server answers 404 (a read finds nothing; a delete
    finds it already gone)."""
    from kubernetes.client.exceptions import ApiException

    try:
        return call(*args)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def _condition(status: JobStatus, kind: str, on: bool, reason: str, message: str) -> JobStatus:
    """``status`` with condition ``kind`` set (its transition time kept if nothing changed)."""
    old = next((c for c in status.conditions if c.type == kind), None)
    if old is not None and (old.status, old.reason, old.message) == (on, reason, message):
        return status
    rest = [c for c in status.conditions if c.type != kind]
    return status.model_copy(
        update={"conditions": [*rest, Condition(type=kind, status=on, reason=reason, message=message)]}
    )


class Reconciler:
    def __init__(self, api: Any, settings: OperatorSettings) -> None:
        from kubernetes import client

        self.settings = settings
        # typed as Any: the client accepts plain dicts as bodies and returns dicts for custom objects
        self.core: Any = client.CoreV1Api(api)
        self.objects: Any = client.CustomObjectsApi(api)
        self.rljobs = KubernetesJobStore(api)
        self.http = httpx.Client(timeout=3.0)
        # kopf runs handlers of an RLJob and of its RayJob concurrently (they are two objects): one
        # lock per RLJob serializes them, and each reads both objects fresh inside it, so no
        # reconcile acts on a body an event carried from before another's write
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    # -- small API helpers ----------------------------------------------------------------------

    def read_rayjob(self, ns: str, name: str) -> dict[str, Any] | None:
        rayjob: dict[str, Any] | None = unless_missing(
            self.objects.get_namespaced_custom_object, *RAY, ns, "rayjobs", name
        )
        return rayjob

    def read_rljob(self, ns: str, name: str) -> dict[str, Any] | None:
        rljob: dict[str, Any] | None = unless_missing(
            self.objects.get_namespaced_custom_object, rl.GROUP, rl.VERSION, ns, rl.PLURAL, name
        )
        return rljob

    def event(self, rljob: dict[str, Any], kind: str, reason: str, message: str) -> None:
        """A core/v1 Event on the RLJob (what `kubectl describe rljob` shows)."""
        meta = rljob["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": rl.API_VERSION,
                "kind": rl.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid", ""),
            },
            "reason": reason,
            "message": message[:1000],
            "type": kind,
            "source": {"component": "fp8rl-operator"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body)
        except Exception as err:  # an event that cannot be posted must not stop reconciling
            log.warning("could not post event %s on %s: %s", reason, meta["name"], err)
        log.info("%s/%s %s: %s", meta["namespace"], meta["name"], reason, message)

    def _set_status(self, rljob: dict[str, Any], change: Any) -> JobStatus | None:
        meta = rljob["metadata"]
        try:
            return rl.status_of(self.rljobs.write_status(meta["namespace"], meta["name"], change))
        except JobNotFound:
            return None

    # -- the steps ------------------------------------------------------------------------------

    def _lock(self, ns: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((ns, name), threading.Lock())

    def reconcile(self, ns: str, name: str) -> None:
        """Create or repair what the RLJob ``ns/name`` needs, then mirror status. Called on create,
        update, resume (operator start), a timer, and each event of its RayJob; the RLJob and the
        RayJob are read afresh under the RLJob's lock (event bodies can be stale)."""
        with self._lock(ns, name):
            rljob = self.read_rljob(ns, name)
            if rljob is None:
                with self._locks_guard:
                    self._locks.pop((ns, name), None)
                return
            self._reconcile(rljob)

    def _reconcile(self, rljob: dict[str, Any]) -> None:
        meta = rljob["metadata"]
        if meta.get("deletionTimestamp"):
            return
        try:
            spec = rl.spec_of(rljob)
        except ValidationError as err:
            problems = "; ".join(describe_errors(err))
            self._fail_invalid(rljob, problems)
            return
        refused = builders.placement_problems(spec, self.settings) + builders.path_problems(
            spec, self.settings
        )
        if refused:
            self._fail_invalid(rljob, "; ".join(refused))
            return
        status = rl.status_of(rljob)
        if status.phase in TERMINAL:
            return
        rayjob = self.read_rayjob(meta["namespace"], meta["name"])
        if rayjob is None:
            self._ensure_configmap(rljob, spec)
        rayjob = self._ensure_rayjob(rljob, spec, status, rayjob)
        if rayjob is not None:
            self._mirror(rljob, spec, status, rayjob)

    def _fail_invalid(self, rljob: dict[str, Any], problems: str) -> None:
        def change(s: JobStatus) -> JobStatus:
            if s.phase is Phase.FAILED and s.reason == Reason.INVALID_SPEC and s.message == problems:
                return s
            moved, _ = advance(s, (Phase.FAILED, Reason.INVALID_SPEC, problems))
            return moved

        before = rl.status_of(rljob)
        after = self._set_status(rljob, change)
        if after is not None and (after.phase, after.message) != (before.phase, before.message):
            self.event(
                rljob, "Warning", Reason.INVALID_SPEC, f"spec refused: {problems}; fix it with kubectl edit"
            )

    def _ensure_configmap(self, rljob: dict[str, Any], spec: rl.RLJobSpec, replace: bool = False) -> None:
        from kubernetes.client.exceptions import ApiException

        ns = rljob["metadata"]["namespace"]
        body = builders.spec_configmap(rljob, spec)
        try:
            self.core.create_namespaced_config_map(ns, body)
        except ApiException as err:
            if err.status != 409:
                raise
            if replace:
                self.core.patch_namespaced_config_map(body["metadata"]["name"], ns, {"data": body["data"]})

    def _create_rayjob(self, rljob: dict[str, Any], spec: rl.RLJobSpec, why: str) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        ns = rljob["metadata"]["namespace"]
        body = builders.rayjob(rljob, spec, self.settings)
        try:
            created: dict[str, Any] = self.objects.create_namespaced_custom_object(*RAY, ns, "rayjobs", body)
        except ApiException as err:
            if err.status == 409:  # someone (a previous operator run) was first: use theirs
                return self.read_rayjob(ns, rljob["metadata"]["name"]) or body
            raise
        self.event(
            rljob,
            "Normal" if why == Reason.RAYJOB_CREATED else "Warning",
            why,
            f"RayJob {ns}/{body['metadata']['name']}",
        )
        return created

    def _delete_rayjob(self, ns: str, name: str) -> None:
        unless_missing(self.objects.delete_namespaced_custom_object, *RAY, ns, "rayjobs", name)

    def _ensure_rayjob(
        self, rljob: dict[str, Any], spec: rl.RLJobSpec, status: JobStatus, rayjob: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        meta = rljob["metadata"]
        ns, name = meta["namespace"], meta["name"]
        if rayjob is None:
            # a RayJob deleted by someone else while the job should run is recreated
            ran = status.phase in (Phase.STARTING, Phase.RUNNING)
            return self._create_rayjob(rljob, spec, Reason.RAYJOB_RECREATED if ran else Reason.RAYJOB_CREATED)
        rayjob_status = (rayjob.get("status") or {}).get("jobDeploymentStatus") or ""
        built_from = ((rayjob.get("metadata") or {}).get("annotations") or {}).get(builders.SPEC_HASH)
        wanted = builders.spec_hash(spec)
        if built_from != wanted:
            if status.phase in (Phase.STARTING, Phase.RUNNING):
                message = (
                    "spec.job/spec.cluster changed while the job runs: refused (the RayJob keeps the spec "
                    "it started with). Suspend it (spec.suspend: true), change it, then resume."
                )
                newly: list[bool] = []

                def refuse(s: JobStatus) -> JobStatus:
                    was = any(c.type == Reason.SPEC_CHANGE_REFUSED and c.status for c in s.conditions)
                    newly[:] = [not was]  # the write that wins decides: one event per refusal
                    return _condition(s, Reason.SPEC_CHANGE_REFUSED, True, Reason.JOB_RUNNING, message)

                self._set_status(rljob, refuse)
                if newly == [True]:
                    self.event(rljob, "Warning", Reason.SPEC_CHANGE_REFUSED, message)
                return rayjob
            self._delete_rayjob(ns, name)  # not running: rebuild it from the new spec
            self._ensure_configmap(rljob, spec, replace=True)
            self._set_status(
                rljob,
                lambda s: _condition(s, Reason.SPEC_CHANGE_REFUSED, False, Reason.APPLIED, "spec applied"),
            )
            self.event(rljob, "Normal", Reason.SPEC_APPLIED, "RayJob rebuilt from the changed spec")
            return self._create_rayjob(rljob, spec, Reason.RAYJOB_CREATED)
        resumed = status.phase is Phase.PENDING and status.reason == Reason.USER_RESUMED
        if resumed and rayjob_status in ("Complete", "Failed") and not spec.suspend:
            # resumed after a failure: a finished RayJob does not run again, a new one does
            self._delete_rayjob(ns, name)
            return self._create_rayjob(rljob, spec, Reason.RAYJOB_RESTARTED)
        kueue = bool(spec.cluster.queue and spec.cluster.queue.scheduler == "kueue")
        desired = spec.suspend or (kueue and bool((rayjob.get("spec") or {}).get("suspend")))
        if bool((rayjob.get("spec") or {}).get("suspend")) != desired:
            patched: dict[str, Any] = self.objects.patch_namespaced_custom_object(
                *RAY, ns, "rayjobs", name, {"spec": {"suspend": desired}}
            )
            self.event(
                rljob, "Normal", "Suspending" if desired else "Resuming", f"RayJob spec.suspend={desired}"
            )
            return patched
        return rayjob

    def _mirror(
        self, rljob: dict[str, Any], spec: rl.RLJobSpec, read: JobStatus, rayjob: dict[str, Any]
    ) -> None:
        target = target_of(rayjob, spec.suspend)
        progress = (
            self._scrape(rljob, spec, rayjob) if target[0] in (Phase.RUNNING, Phase.SUCCEEDED) else None
        )
        passed: list[Phase] = []

        def change(s: JobStatus) -> JobStatus:
            if (s.phase, s.reason) != (read.phase, read.reason):
                # someone else (the control plane's resume or cancel) moved the job since this
                # reconcile read it: what it decided no longer holds; the next one decides anew
                passed[:] = []
                return s
            moved, steps = advance(s, target)
            passed[:] = steps
            if progress is not None and progress.step >= moved.progress.step:
                moved = moved.model_copy(update={"progress": progress})
            return moved

        if self._set_status(rljob, change) is None:
            return
        for phase in passed:
            kind = "Warning" if phase is Phase.FAILED else "Normal"
            self.event(rljob, kind, phase.value, f"{target[1]}: {target[2]}")

    def _scrape(self, rljob: dict[str, Any], spec: rl.RLJobSpec, rayjob: dict[str, Any]) -> Any:
        """The driver's progress from its Prometheus endpoint on the head pod (None if unreachable)."""
        cluster = (rayjob.get("status") or {}).get("rayClusterName")
        if not cluster:
            return None
        ns = rljob["metadata"]["namespace"]
        try:
            pods = self.core.list_namespaced_pod(
                ns, label_selector=f"ray.io/cluster={cluster},ray.io/node-type=head"
            )
            ips = [p.status.pod_ip for p in pods.items if p.status is not None and p.status.pod_ip]
            if not ips:
                return None
            url = self.settings.progress_url.format(pod_ip=ips[0], port=self.settings.metrics_port)
            text = self.http.get(url).text
        except Exception as err:  # progress is best effort: the phase does not depend on it
            log.debug("no progress for %s: %s", rljob["metadata"]["name"], err)
            return None
        return progress_of(text, spec.job.steps)

    def cleanup(self, rljob: dict[str, Any]) -> None:
        """On delete (behind the finalizer): remove the RayJob and the ConfigMap."""
        meta = rljob["metadata"]
        ns, name = meta["namespace"], meta["name"]
        with self._lock(ns, name):
            self._delete_rayjob(ns, name)
            unless_missing(self.core.delete_namespaced_config_map, builders.configmap_name(name), ns)
        log.info("%s/%s deleted with its RayJob and ConfigMap", ns, name)
