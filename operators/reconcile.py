"""What the operator does for one RLJob, through the Kubernetes API: read the RLJob and the objects
of its names (RayJob, ConfigMap, NetworkPolicy; and the driver's metrics while it trains), ask
``operators.plan`` what to do, and do it in order. The Ray token Secret is written, never read:
the operator has no right to read Secrets, and its name carries the RLJob's uid
(``operators.ownership``). The decisions are all in the plan; this module only executes its
actions, each idempotent, so a restarted operator creates no duplicates. A create that finds the
name taken (409) plans again from fresh reads, where the plan sees whose object it is. The kopf
handlers (``handlers.py``) only call into this."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from operators import builders
from operators.actions import (
    Action,
    CreateConfigMap,
    CreateNetworkPolicy,
    CreateRayJob,
    CreateRayTokenSecret,
    DeleteRayJob,
    Event,
    Observed,
    PatchRayJobSuspend,
    ReplaceConfigMap,
    ReplaceNetworkPolicySpec,
    WriteStatus,
)
from operators.ownership import RLJOB_LABEL, Ownership, ownership
from operators.plan import plan, settled, wants_progress
from operators.settings import OperatorSettings
from rljob import resource as rl
from rljob.kube import CONFLICT_RETRIES
from rljob.status import JobStatus

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


class _Stale(Exception):
    """What the plan was made from changed since it was read (409 on the status write, or a name
    taken by the time of a create): plan again."""


class CleanupPending(Exception):
    """The job's RayJob or pods are still going: the finalizer stays until they are gone, so that
    its NetworkPolicy (collected after the RLJob) never outlives the pods it guards' end."""


class Reconciler:
    def __init__(self, api: Any, settings: OperatorSettings) -> None:
        from kubernetes import client

        self.settings = settings
        # typed as Any: the client accepts plain dicts as bodies and returns dicts for custom objects
        self.core: Any = client.CoreV1Api(api)
        self.networking: Any = client.NetworkingV1Api(api)
        self.objects: Any = client.CustomObjectsApi(api)
        self.http = httpx.Client(timeout=3.0)
        # kopf runs handlers of an RLJob and of its RayJob concurrently (they are two objects): one
        # lock per RLJob serializes them, and each reads both objects fresh inside it, so no
        # reconcile acts on a body an event carried from before another's write
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    # -- reads ----------------------------------------------------------------------------------

    def read_crd(self, name: str) -> dict[str, Any] | None:
        """The CRD ``name`` as a dict, or None (listed by name: the operator may list and watch
        CRDs, not get them)."""
        from kubernetes import client

        found = client.ApiextensionsV1Api(self.core.api_client).list_custom_resource_definition(
            field_selector=f"metadata.name={name}"
        )
        crds = [self.core.api_client.sanitize_for_serialization(c) for c in found.items]
        crds = [c for c in crds if c.get("metadata", {}).get("name") == name]
        return dict(crds[0]) if crds else None

    def kuberay_problem(self) -> str | None:
        """Why jobs must not start with these settings, or None. With ``ray_auth: kuberay`` the
        RayJob CRD must know ``authOptions``: an older KubeRay drops it unnoticed and every job's
        Ray cluster would accept anyone. No RayJob CRD at all: nothing to check (RayJobs cannot
        be created until KubeRay is installed, and each such failure is reported then)."""
        if self.settings.ray_auth != "kuberay":
            return None
        crd = self.read_crd("rayjobs.ray.io")
        if crd is None:
            log.warning("no RayJob CRD (rayjobs.ray.io): is KubeRay installed?")
            return None
        if builders.kuberay_knows_auth_options(crd):
            return None
        return (
            "KubeRay's RayJob CRD has no rayClusterSpec.authOptions (KubeRay older than 1.5.1): every "
            "job's Ray cluster would start without a token. Upgrade KubeRay to 1.5.1 or later, or set "
            "the chart's jobDefaults.rayAuth=secret (FP8RL_OPERATOR_RAY_AUTH=secret)"
        )

    def rljob_crd_problem(self) -> str | None:
        """Why this operator must not run on this cluster's RLJob CRD, or None: an older CRD lacks
        fields this operator writes (``rljob.crd.missing_fields``), which the API server would
        drop, so every reconcile would write them again. ``helm upgrade`` does not update CRDs."""
        from rljob.crd import missing_fields

        name = f"{rl.PLURAL}.{rl.GROUP}"
        crd = self.read_crd(name)
        if crd is None:
            return f"no RLJob CRD ({name}) on the cluster: install the chart (its crds/ directory) first"
        missing = missing_fields(crd)
        if not missing:
            return None
        return (
            f"the RLJob CRD on the cluster is older than this operator: it lacks {', '.join(missing)}, which "
            "the API server would drop from what the operator writes. Apply this version's CRD first "
            "(helm install/upgrade does not update CRDs): "
            "kubectl apply --server-side --force-conflicts -f helm/fp8rl/crds/"
        )

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

    def read_configmap(self, ns: str, name: str) -> dict[str, Any] | None:
        """The ConfigMap of the job-spec's name as a dict (the client returns a model for core
        objects), whoever's it is."""
        return self._as_dict(
            unless_missing(self.core.read_namespaced_config_map, builders.configmap_name(name), ns)
        )

    def read_networkpolicy(self, ns: str, name: str) -> dict[str, Any] | None:
        if not self.settings.network_policy:
            return None
        return self._as_dict(unless_missing(self.networking.read_namespaced_network_policy, name, ns))

    def _as_dict(self, found: Any) -> dict[str, Any] | None:
        if found is None:
            return None
        obj: dict[str, Any] = self.core.api_client.sanitize_for_serialization(found)
        return obj

    def observe(self, ns: str, name: str) -> Observed:
        return Observed(
            rayjob=self.read_rayjob(ns, name),
            configmap=self.read_configmap(ns, name),
            networkpolicy=self.read_networkpolicy(ns, name),
        )

    def progress_route(self) -> str:
        """``pod-ip`` or ``api-proxy`` (``auto``: the pod's IP from inside the cluster)."""
        route = self.settings.progress_route
        if route == "auto":
            return "pod-ip" if os.environ.get("KUBERNETES_SERVICE_HOST") else "api-proxy"
        return route

    def scrape(self, ns: str, rayjob: dict[str, Any]) -> str | None:
        """The driver's Prometheus text from the head pod (None if unreachable): from its IP, or
        through the API server's pod proxy (``progress_route``)."""
        cluster = (rayjob.get("status") or {}).get("rayClusterName")
        if not cluster:
            return None
        try:
            pods = self.core.list_namespaced_pod(
                ns, label_selector=f"ray.io/cluster={cluster},ray.io/node-type=head"
            )
            running = [p for p in pods.items if p.status is not None and p.status.pod_ip]
            if not running:
                return None
            port = self.settings.metrics_port
            if self.progress_route() == "api-proxy":
                text: str = self.core.connect_get_namespaced_pod_proxy_with_path(
                    f"{running[0].metadata.name}:{port}", ns, "metrics", _request_timeout=3
                )
            else:
                url = self.settings.progress_url.format(pod_ip=running[0].status.pod_ip, port=port)
                text = self.http.get(url).raise_for_status().text
            # what answered must be Prometheus text (a proxy's or another server's page is not)
            list(text_string_to_metric_families(text))
        except Exception as err:  # progress is best effort: the phase does not depend on it
            log.debug("no progress for %s/%s: %s", ns, rayjob["metadata"]["name"], err)
            return None
        return text

    # -- plan and execute -----------------------------------------------------------------------

    def reconcile(self, ns: str, name: str) -> None:
        """Create or repair what the RLJob ``ns/name`` needs, then mirror status. Called on create,
        update, resume (operator start), a timer, and each event of its RayJob; everything is read
        afresh under the RLJob's lock (event bodies can be stale), and read again if the RLJob
        changed before its status was written."""
        with self._lock(ns, name):
            for _ in range(CONFLICT_RETRIES):
                rljob = self.read_rljob(ns, name)
                if rljob is None:
                    with self._locks_guard:
                        self._locks.pop((ns, name), None)
                    return
                if settled(rljob):
                    return
                observed = self.observe(ns, name)
                rayjob = observed.rayjob
                scrape = rayjob is not None and wants_progress(rljob, rayjob) and _ours(rayjob, rljob)
                metrics = self.scrape(ns, rayjob) if scrape and rayjob is not None else None
                try:
                    self.execute(rl.ObjectMeta.of(rljob), plan(rljob, observed, self.settings, metrics))
                except _Stale:
                    continue
                return
            log.warning("%s/%s kept changing while being reconciled; the next tick retries", ns, name)

    def execute(self, meta: rl.ObjectMeta, actions: Sequence[Action]) -> None:
        """Run ``actions`` for the RLJob of ``meta`` (as read) in order. Raises
        ``_Stale`` (the rest left undone) where the status write finds the RLJob changed since it
        was read."""
        ns, name = meta.namespace, meta.name
        for action in actions:
            match action:
                case CreateNetworkPolicy(body):
                    _create_or_replan(self.networking.create_namespaced_network_policy, ns, body)
                case ReplaceNetworkPolicySpec(body):
                    self.networking.patch_namespaced_network_policy(
                        body["metadata"]["name"], ns, {"spec": body["spec"]}
                    )
                case CreateRayTokenSecret(job):
                    # one that exists was made for this RLJob (its name has the uid): a running
                    # cluster holds its token, so it is kept
                    body = builders.ray_token_secret(job, secrets.token_urlsafe(32))
                    _created(self.core.create_namespaced_secret, ns, body)
                case CreateConfigMap(body):
                    _create_or_replan(self.core.create_namespaced_config_map, ns, body)
                case ReplaceConfigMap(body):
                    self.core.patch_namespaced_config_map(
                        body["metadata"]["name"], ns, {"data": body["data"]}
                    )
                case CreateRayJob(body, event):
                    _create_or_replan(
                        lambda n, b: self.objects.create_namespaced_custom_object(*RAY, n, "rayjobs", b),
                        ns,
                        body,
                    )
                    self.event(meta, event)
                case DeleteRayJob(uid):
                    self._delete_rayjob(ns, name, uid)
                case PatchRayJobSuspend(suspend):
                    body = {"spec": {"suspend": suspend}}
                    self.objects.patch_namespaced_custom_object(*RAY, ns, "rayjobs", name, body)
                case WriteStatus(status):
                    if not self._write_status(meta, status):
                        return  # the RLJob is gone
                case Event():
                    self.event(meta, action)

    # -- the API calls of the actions -----------------------------------------------------------

    def event(self, meta: rl.ObjectMeta, event: Event) -> None:
        """A core/v1 Event on the RLJob (what `kubectl describe rljob` shows)."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta.name}.{uuid.uuid4().hex[:12]}", "namespace": meta.namespace},
            "involvedObject": {
                "apiVersion": rl.API_VERSION,
                "kind": rl.KIND,
                "name": meta.name,
                "namespace": meta.namespace,
                "uid": meta.uid,
            },
            "reason": event.reason,
            "message": event.message[:1000],
            "type": event.type,
            "source": {"component": "fp8rl-operator"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(meta.namespace, body)
        except Exception as err:  # an event that cannot be posted must not stop reconciling
            log.warning("could not post event %s on %s: %s", event.reason, meta.name, err)
        log.info("%s/%s %s: %s", meta.namespace, meta.name, event.reason, event.message)

    def _delete_rayjob(self, ns: str, name: str, uid: str) -> None:
        """Delete the RayJob ``name`` only while it is the object of ``uid`` (the API server checks
        the precondition: a RayJob made by someone else since the read is answered 409)."""
        from kubernetes.client.exceptions import ApiException

        body = {"preconditions": {"uid": uid}}
        try:
            unless_missing(
                lambda: self.objects.delete_namespaced_custom_object(*RAY, ns, "rayjobs", name, body=body)
            )
        except ApiException as err:
            if err.status == 409:
                raise _Stale from None
            raise

    def _write_status(self, meta: rl.ObjectMeta, status: JobStatus) -> bool:
        """PATCH the status at the RLJob's ``resourceVersion`` as read; False if the RLJob is gone.
        Raises ``_Stale`` on 409 Conflict (someone wrote the RLJob since it was read)."""
        from kubernetes.client.exceptions import ApiException

        body: dict[str, Any] = {"status": status.model_dump(mode="json")}
        if meta.resource_version:
            body["metadata"] = {"resourceVersion": meta.resource_version}
        try:
            self.objects.patch_namespaced_custom_object_status(
                rl.GROUP, rl.VERSION, meta.namespace, rl.PLURAL, meta.name, body
            )
        except ApiException as err:
            if err.status == 409:
                raise _Stale from None
            if err.status == 404:
                return False
            raise
        return True

    def _lock(self, ns: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((ns, name), threading.Lock())

    def cleanup(self, rljob: dict[str, Any]) -> None:
        """On delete (behind the finalizer): remove the job's own RayJob and ConfigMap (each only
        if it is this RLJob's, checked by a precondition on its uid), then keep the finalizer
        (raise ``CleanupPending``) until the RayJob and the job's pods are gone. The NetworkPolicy
        and the token Secret are left to the garbage collector, which removes them after the
        RLJob: the pods never run without their policy. Objects of the job's names that are not
        its own are left as they are."""
        meta = rl.ObjectMeta.of(rljob)
        ns, name = meta.namespace, meta.name
        with self._lock(ns, name):
            observed = self.observe(ns, name)
            if observed.rayjob is not None and _ours(observed.rayjob, rljob):
                if not (observed.rayjob.get("metadata") or {}).get("deletionTimestamp"):
                    self._delete_rayjob(ns, name, str(observed.rayjob["metadata"]["uid"]))
                raise CleanupPending(f"RayJob {ns}/{name} is being deleted")
            if observed.configmap is not None and _ours(observed.configmap, rljob):
                uid = observed.configmap["metadata"]["uid"]
                unless_missing(
                    lambda: self.core.delete_namespaced_config_map(
                        builders.configmap_name(name), ns, body={"preconditions": {"uid": uid}}
                    )
                )
            pods = self.core.list_namespaced_pod(ns, label_selector=f"{RLJOB_LABEL}={name}").items
            if pods:
                raise CleanupPending(f"{len(pods)} pod(s) of {ns}/{name} still terminating")
        log.info("%s/%s (uid %s) cleaned up: RayJob and pods gone", ns, name, meta.uid)


def _ours(obj: dict[str, Any], rljob: dict[str, Any]) -> bool:
    return ownership(obj, rl.ObjectMeta.of(rljob)) is Ownership.OURS


def _create_or_replan(create: Callable[[str, dict[str, Any]], Any], ns: str, body: dict[str, Any]) -> None:
    """``create(ns, body)``; a name taken meanwhile (409) plans again, where whose it is counts."""
    if not _created(create, ns, body):
        raise _Stale


def _created(create: Callable[[str, dict[str, Any]], Any], ns: str, body: dict[str, Any]) -> bool:
    """``create(ns, body)``; False where it exists already (409: made by a previous operator run)."""
    from kubernetes.client.exceptions import ApiException

    try:
        create(ns, body)
    except ApiException as err:
        if err.status != 409:
            raise
        return False
    return True
