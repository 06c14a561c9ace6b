"""The monitored stack (tests/helm/monitoring.py), started once for the dashboard and alert tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helm.monitoring import Prometheus, monitored


@pytest.fixture(scope="session")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A real Prometheus holding a tiny ``fp8rl run`` and an ``fp8rl serve`` (see monitoring.py)."""
    with monitored(tmp_path_factory.mktemp("monitoring")) as prometheus:
        yield prometheus
