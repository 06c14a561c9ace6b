"""The fixtures of the real Kubernetes (``tests/kube/README.md``), a pytest plugin that
``tests/conftest.py`` loads so that any test may ask for them: one cluster for the session, built
once per machine and started once per run (seconds), torn down at the end. Tests take namespaces
of their own (``tenant``) or act in the chart's tenants (team-a, team-b, team-c)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kube import build, install
from tests.kube.cluster import KubeCluster
from tests.kube.podnet import PodNetwork

_names = itertools.count()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests on the test cluster run together, in their order, so the cluster is up only while
    they run: last in a run on one process; on one worker, beside the others, under `make test`'s
    two workers (tests/conftest.py puts them in one xdist group)."""
    on_cluster = [item for item in items if "kube" in getattr(item, "fixturenames", ())]
    if on_cluster:
        others = [item for item in items if "kube" not in getattr(item, "fixturenames", ())]
        items[:] = others + on_cluster


@pytest.fixture(scope="session")
def podnet() -> Iterator[PodNetwork]:
    net = PodNetwork().start()
    yield net
    net.stop()


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory, podnet: PodNetwork) -> Iterator[KubeCluster]:
    built = build.ensure()  # minutes on a new machine, then nothing
    cluster = KubeCluster(built, tmp_path_factory.mktemp("kube"), proxy=podnet.url)
    podnet.attach(cluster)
    with cluster:
        yield cluster


@pytest.fixture
def tenant(kube: KubeCluster) -> str:
    """A new tenant namespace that enforces Pod Security ``restricted``, as the chart makes them,
    where the control plane may write RLJobs (the RoleBinding the chart makes per tenant)."""
    return install.add_tenant(kube, f"tenant-{next(_names)}")


@pytest.fixture(scope="session")
def chart(kube: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart, installed once (release ``fp8rl`` in ``fp8rl-system``, tenants team-a/b/c)."""
    return install.install(kube, tmp_path_factory.mktemp("chart"))


@pytest.fixture(scope="session")
def operator(
    kube: KubeCluster, chart: Path, podnet: PodNetwork, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[install.Process]:
    """``fp8rl operator`` with the chart's ServiceAccount and config, for the whole session."""
    proc = install.start_operator(kube, tmp_path_factory.mktemp("operator"), podnet.url)
    yield proc
    proc.stop()
    print(proc.tail())


@pytest.fixture
def second_tenant(kube: KubeCluster) -> str:
    """Another tenant namespace (``tenant`` is the first)."""
    return install.add_tenant(kube, f"tenant-{next(_names)}")


@pytest.fixture
def control_plane_kubeconfig(kube: KubeCluster, chart: Path, tmp_path: Path) -> Path:
    """Acting as the chart's control plane (its ServiceAccount ``fp8rl-api`` and nothing more)."""
    return kube.token_kubeconfig(tmp_path / "api.kubeconfig", install.NAMESPACE, "fp8rl-api")
