"""An in-memory Kubernetes API over real HTTP (kmock), for ``fp8rl bench operator`` (a laptop has no
cluster; the tests run on a real API server, tests/kube).

``KubeEmulator`` runs kmock's ``KubernetesEmulator`` on a random local port in a background thread
with its own event loop, declares the resources fp8rl touches (namespaces, ConfigMaps, Secrets,
Events, NetworkPolicies, RLJobs, RayJobs) and writes a kubeconfig pointing at it, so the real
``kubernetes`` client, kopf and kubectl all talk to it as to a cluster. ``requests(...)`` lists
the API calls it served (kmock records every request), e.g. to count status writes. kmock is a
development dependency, used through its public API only: this module lives in the tooling tier
(``bench``), never imported by the runtime packages.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import kmock
import yaml

# (group/version/plural, kind, namespaced, short names, subresources)
RESOURCES: tuple[tuple[str, str, bool, tuple[str, ...], tuple[str, ...]], ...] = (
    ("v1/namespaces", "Namespace", False, ("ns",), ()),
    ("v1/configmaps", "ConfigMap", True, ("cm",), ()),
    ("v1/pods", "Pod", True, ("po",), ("status",)),
    ("v1/events", "Event", True, ("ev",), ()),
    ("v1/secrets", "Secret", True, (), ()),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, ("netpol",), ()),
    ("events.k8s.io/v1/events", "Event", True, ("ev",), ()),
    ("coordination.k8s.io/v1/leases", "Lease", True, (), ()),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, (), ()),
    ("fp8rl.io/v1alpha1/rljobs", "RLJob", True, ("rlj",), ("status",)),
    ("ray.io/v1/rayjobs", "RayJob", True, (), ("status",)),
)
VERBS = ("create", "delete", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class Call:
    """One request the emulated API server served."""

    method: str  # GET, POST, PATCH, DELETE, ...
    plural: str | None  # e.g. "rljobs"; None for discovery and other non-resource paths
    namespace: str | None
    name: str | None
    subresource: str | None  # e.g. "status"


class _Cluster(kmock.KubernetesEmulator):
    """kmock's emulator plus four behaviours of a real API server that fp8rl relies on: creating
    in a missing namespace is 404; a create answers 201; created objects get uid,
    creationTimestamp and resourceVersion; a patch naming a stale ``metadata.resourceVersion`` is
    409 Conflict (optimistic concurrency)."""

    known_namespaces: set[str]
    _versions: itertools.count[int]

    async def _handle(self, request: kmock.Request) -> Any:
        res = request.resource
        if res is not None and request.action is not None and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {}) if request.data else {}
            if request.action == kmock.action.CREATE and res.plural != "namespaces":
                ns = request.namespace or meta.get("namespace")
                if ns is not None and ns not in self.known_namespaces:
                    raise kmock.KubernetesObjectNotFoundError(message=f'namespaces "{ns}" not found')
                meta.update(
                    uid=str(uuid.uuid4()),
                    creationTimestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    resourceVersion=str(next(self._versions)),
                )
            elif request.action == kmock.action.UPDATE and request.name is not None and request.data:
                key = (res, request.namespace, request.name)
                current = self.objects[key].raw if key in self.objects else {}
                wanted = meta.get("resourceVersion")
                if (
                    current
                    and wanted is not None
                    and wanted != current.get("metadata", {}).get("resourceVersion")
                ):
                    raise kmock.KubernetesError(
                        status=409,
                        reason="Conflict",
                        message="the object has been modified; apply your changes to the latest version",
                    )
                meta["resourceVersion"] = str(next(self._versions))
        response = await super()._handle(request)
        if request.action == kmock.action.CREATE and response.status == 200 and not response.prepared:
            response.set_status(201)  # what a real API server answers to a create
        return response


class KubeEmulator:
    """``with KubeEmulator(tmp_path, namespaces=["team-a"]) as kube:`` then use ``kube.kubeconfig``."""

    def __init__(self, workdir: Path, namespaces: Iterable[str] = ("default",)) -> None:
        self.workdir = workdir
        self.namespaces = list(namespaces)
        self.kubeconfig = workdir / "kubeconfig.yaml"
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="kmock", daemon=True)
        self._error: BaseException | None = None
        self.handler: kmock.KubernetesEmulator | None = None

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as err:  # surfaced to the caller of __enter__
            self._error = err
            self._ready.set()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        handler = _Cluster()
        handler.known_namespaces = set(self.namespaces)
        handler._versions = itertools.count(1)
        for key, kind, namespaced, shortnames, subresources in RESOURCES:
            handler.resources[key] = kmock.ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=namespaced,
                verbs=set(VERBS),
                shortnames=set(shortnames),
                subresources=set(subresources),
            )
        async with handler, kmock.Server(handler) as server:
            self.handler = handler
            self.url = str(server.url).rstrip("/")
            for ns in self.namespaces:
                obj = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
                handler.objects["v1/namespaces", None, ns] = obj
            # the RLJob CRD, installed as the chart installs it: the operator reads it at start
            from rljob.crd import crd

            crds = "apiextensions.k8s.io/v1/customresourcedefinitions"
            handler.objects[crds, None, "rljobs.fp8rl.io"] = crd()
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> KubeEmulator:
        self._thread.start()
        self._ready.wait(timeout=30)
        if self._error is not None:
            raise RuntimeError(f"kmock did not start: {self._error}") from self._error
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
            "current-context": "kmock",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
        self._loop.close()

    def requests(
        self,
        method: str | None = None,
        plural: str | None = None,
        name: str | None = None,
        subresource: str | None = None,
    ) -> list[Call]:
        """The requests served so far, oldest first, those matching every argument given (e.g.
        ``requests("PATCH", "rljobs", "j1", "status")``: the status writes of RLJob j1)."""
        assert self.handler is not None
        out = []
        for r in list(self.handler):  # kmock's own log of every request (the handler is a view)
            call = Call(
                method=str(r.method.value),
                plural=None if r.resource is None else r.resource.plural,
                namespace=r.namespace,
                name=r.name,
                subresource=r.subresource,
            )
            wanted = (method, plural, name, subresource)
            got = (call.method, call.plural, call.name, call.subresource)
            if all(w is None or w == g for w, g in zip(wanted, got, strict=True)):
                out.append(call)
        return out

    def objects(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """The stored live objects of ``resource`` (e.g. ``"ray.io/v1/rayjobs"``), for assertions."""
        assert self.handler is not None
        out = []
        for (res, ns, _name), obj in list(self.handler.objects.items()):
            wanted = str(res.plural) == resource.rsplit("/", 1)[-1] and namespace in (None, ns)
            if wanted and not obj.deleted:
                out.append(dict(obj.raw))
        return out


def start_operator(
    kubeconfig: Path, log: Path, env: dict[str, str] | None = None, extra_args: Iterable[str] = ()
) -> subprocess.Popen[bytes]:
    """``fp8rl operator`` as a real process against ``kubeconfig``, logging to ``log``."""
    cmd = [sys.executable, "-m", "fp8rl", "operator", "--kubeconfig", str(kubeconfig), *extra_args]
    with log.open("ab") as out:
        full_env = {**os.environ, **(env or {})}
        return subprocess.Popen(
            cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60.0, every: float = 0.1) -> Any:
    """Poll ``check`` until it returns something truthy; fail saying ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
