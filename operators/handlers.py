"""The kopf handlers: thin edges that call ``Reconciler``. ``registry(settings)`` registers them on
a registry of their own (``operators.main`` runs it), so the settings are an argument, not
something read at import.

- create / update / resume (operator start) of an RLJob, and a timer per RLJob: ``reconcile``.
- any event of a RayJob this operator made: reconcile its RLJob at once, by name (status mirrors
  quickly, and a RayJob deleted by someone else is recreated).
- delete of an RLJob: remove its RayJob and ConfigMap first (kopf holds the finalizer
  ``fp8rl.io/finalizer`` until this returns), not relying on garbage collection alone.

Every handler is registered with an explicit ``id`` (its function's name): kopf records handler
progress in the RLJob's annotations under that id.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import kopf

from operators.ownership import MANAGED_BY, RLJOB_LABEL
from operators.reconcile import CleanupPending, Reconciler
from operators.settings import OperatorSettings
from rljob import resource as rl

RLJOB = (rl.GROUP, rl.VERSION, rl.PLURAL)
CLEANUP_WAIT_S = 300  # how long a deleted RLJob waits for its RayJob and pods to go


def _reconciler(memo: kopf.Memo) -> Reconciler:
    r: Reconciler = memo["reconciler"]
    return r


def on_rljob(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    if namespace:  # RLJobs are namespaced: always set
        _reconciler(memo).reconcile(namespace, name)


def on_rayjob(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    owner = (body.get("metadata", {}).get("labels") or {}).get(RLJOB_LABEL)
    namespace = body.get("metadata", {}).get("namespace")
    if not owner or not namespace:
        return
    # the body only says which RLJob to look at; reconcile reads both objects afresh (a gone
    # RLJob is a no-op: garbage collection and its delete handler remove the RayJob)
    _reconciler(memo).reconcile(namespace, owner)


def on_delete(body: kopf.Body, memo: kopf.Memo, runtime: datetime.timedelta, **_: Any) -> None:
    try:
        _reconciler(memo).cleanup(dict(body))
    except CleanupPending as pending:
        if runtime.total_seconds() < CLEANUP_WAIT_S:
            raise kopf.TemporaryError(str(pending), delay=2) from None
        # pods that never go (a node lost with its kubelet) must not hold the RLJob forever
        logging.getLogger("fp8rl.operator").warning(
            "%s after %.0f s: releasing the RLJob anyway; the garbage collector removes the rest",
            pending,
            runtime.total_seconds(),
        )


def registry(operator: OperatorSettings, kubeconfig: str | None = None) -> kopf.OperatorRegistry:
    """The operator's handlers, using ``operator`` (its defaults and poll interval) and the API
    server of ``kubeconfig`` (None: ``KUBECONFIG`` or the in-cluster config)."""
    reg = kopf.OperatorRegistry()
    # kopf's default registry logs in through the kubernetes client by itself; a registry of our
    # own names it (in-cluster config, else KUBECONFIG, which ``operators.main`` sets)
    kopf.on.login(id="login_via_client", registry=reg)(kopf.login_via_client)

    @kopf.on.startup(id="configure", registry=reg)
    def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        from rljob.kube import api_client

        settings.persistence.finalizer = "fp8rl.io/finalizer"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="fp8rl.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="fp8rl.io", key="last-handled-configuration"
        )
        settings.posting.level = logging.WARNING  # our own Events say what happened; kopf's only on trouble
        settings.watching.server_timeout = 300
        settings.execution.max_workers = 16
        # a delete waits for the RLJob's timer to stop; kopf re-checks a timer caught mid-tick only
        # after this many seconds (default 60: a deletion would hang a minute)
        settings.background.cancellation_polling = 1
        reconciler = Reconciler(api_client(kubeconfig), operator)
        problem = reconciler.rljob_crd_problem() or reconciler.kuberay_problem()
        if problem:  # no job may start on a Ray cluster that would not require its token
            raise kopf.PermanentError(problem)
        memo["reconciler"] = reconciler

    for on in (kopf.on.update, kopf.on.create, kopf.on.resume):
        on(*RLJOB, id="on_rljob", registry=reg)(on_rljob)
    every = operator.poll_seconds
    kopf.timer(*RLJOB, id="on_timer", interval=every, initial_delay=every, registry=reg)(on_rljob)
    kopf.on.event("ray.io", "v1", "rayjobs", id="on_rayjob", labels=MANAGED_BY, registry=reg)(on_rayjob)
    kopf.on.delete(*RLJOB, id="on_delete", registry=reg)(on_delete)
    return reg
