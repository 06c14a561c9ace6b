"""Shared test fixtures: fresh random inputs each run, with the seed printed for reproduction."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# the real Kubernetes of the suite (tests/kube/README.md): kube, chart, operator, podnet, tenant, ...
pytest_plugins = ["tests.kube.fixtures"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> Iterator[int]:
    """A fresh seed per test (or FP8RL_TEST_SEED), printed so a failure can be replayed."""
    value = int(os.environ.get("FP8RL_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(value)
    random.seed(value)
    print(f"\n[seed] FP8RL_TEST_SEED={value} reproduces {request.node.nodeid}")
    yield value


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory, fetched once per machine into the real
    cache ($FP8RL_HOME, else ~/.cache/fp8rl; docs/models.md) and reused by every test and run.
    A fetch that fails fails the tests with its message (no skip: offline machines must know)."""
    from workers.models.store import ModelStoreError, fetch

    try:
        return fetch("smollm2-135m-instruct")
    except ModelStoreError as err:
        pytest.fail(f"fetching smollm2-135m-instruct: {err}", pytrace=False)
