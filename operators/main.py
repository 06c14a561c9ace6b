"""``fp8rl operator``: run the kopf operator (KUBECONFIG or in-cluster config)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path


def run(
    namespaces: Sequence[str] = (),
    kubeconfig: str | None = None,
    config: Path | None = None,
    liveness: str | None = None,
    verbose: bool = False,
) -> None:
    """Watch RLJobs in ``namespaces`` (all namespaces when empty) until interrupted."""
    if kubeconfig:
        os.environ["KUBECONFIG"] = str(kubeconfig)
    if config is not None:
        from operators.handlers import CONFIG_ENV

        os.environ[CONFIG_ENV] = str(config)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if not verbose:  # kopf logs every timer tick at INFO
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    import kopf

    import operators.handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=liveness,
    )
