"""The kopf handlers: thin edges that call ``Reconciler``. Imported by ``operators.main`` only.

- create / update / resume (operator start) of an RLJob, and a timer per RLJob: ``reconcile``.
- any event of a RayJob this operator made: reconcile its RLJob at once, by name (status mirrors
  quickly, and a RayJob deleted by someone else is recreated).
- delete of an RLJob: remove its RayJob and ConfigMap first (kopf holds the finalizer
  ``fp8rl.io/finalizer`` until this returns), not relying on garbage collection alone.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import kopf

from operators.builders import MANAGED_BY, RLJOB_LABEL
from operators.reconcile import Reconciler
from operators.settings import OperatorSettings
from rljob import resource as rl

RLJOB = (rl.GROUP, rl.VERSION, rl.PLURAL)
CONFIG_ENV = "FP8RL_OPERATOR_CONFIG"
_config = os.environ.get(CONFIG_ENV)
SETTINGS = OperatorSettings.load(Path(_config) if _config else None)


@kopf.on.startup()
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
    memo["reconciler"] = Reconciler(api_client(os.environ.get("KUBECONFIG")), SETTINGS)


def _reconciler(memo: kopf.Memo) -> Reconciler:
    r: Reconciler = memo["reconciler"]
    return r


@kopf.on.resume(*RLJOB)
@kopf.on.create(*RLJOB)
@kopf.on.update(*RLJOB)
def on_rljob(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    if namespace:  # RLJobs are namespaced: always set
        _reconciler(memo).reconcile(namespace, name)


@kopf.timer(*RLJOB, interval=SETTINGS.poll_seconds, initial_delay=SETTINGS.poll_seconds)
def on_timer(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    if namespace:  # RLJobs are namespaced: always set
        _reconciler(memo).reconcile(namespace, name)


@kopf.on.event("ray.io", "v1", "rayjobs", labels=MANAGED_BY)
def on_rayjob(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    owner = (body.get("metadata", {}).get("labels") or {}).get(RLJOB_LABEL)
    namespace = body.get("metadata", {}).get("namespace")
    if not owner or not namespace:
        return
    # the body only says which RLJob to look at; reconcile reads both objects afresh (a gone
    # RLJob is a no-op: garbage collection and its delete handler remove the RayJob)
    _reconciler(memo).reconcile(namespace, owner)


@kopf.on.delete(*RLJOB)
def on_delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _reconciler(memo).cleanup(dict(body))
