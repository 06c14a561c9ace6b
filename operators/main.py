"""``fp8rl operator``: run the kopf operator (KUBECONFIG or in-cluster config)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from operators.settings import OperatorSettings


def run(
    settings: OperatorSettings,
    namespaces: Sequence[str] = (),
    kubeconfig: str | None = None,
    liveness: str | None = None,
    verbose: bool = False,
) -> None:
    """Watch RLJobs in ``namespaces`` (all namespaces when empty) until interrupted, applying
    ``settings`` (the operator's defaults and poll interval)."""
    if kubeconfig:
        os.environ["KUBECONFIG"] = str(kubeconfig)  # kopf's own login reads it
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if not verbose:  # kopf logs every timer tick at INFO
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    import kopf

    from operators.handlers import registry
    from operators.reconcile import Reconciler
    from rljob.kube import api_client

    # before kopf starts: a cluster whose RLJob CRD is older than this operator, or whose KubeRay
    # would run jobs without a token, is refused in one line that says what to do. An API server
    # that cannot be asked yet is left to kopf, whose startup handler makes the same checks.
    try:
        reconciler = Reconciler(api_client(kubeconfig), settings)
        problem = reconciler.rljob_crd_problem() or reconciler.kuberay_problem()
    except Exception as err:  # no kubeconfig, no route: kopf reports those in its own words
        logging.getLogger("fp8rl.operator").debug("KubeRay check left to the startup handler: %s", err)
        problem = None
    if problem:
        raise SystemExit(f"error: {problem}")

    kopf.run(
        registry=registry(settings, kubeconfig),
        standalone=True,
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=liveness,
    )
