"""Shared test fixtures: fresh random inputs each run, with the seed printed for reproduction."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch


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
