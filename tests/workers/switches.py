"""A check every opt-in Triton switch (``FP8RL_*=triton``) passes: off unless set, a wrong value
refused by name, and set, on for CUDA tensors and off for CPU ones (no interpreter); and the
switches turned on for a block of the interpreter's check modules."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch


def assert_off_by_default_and_checked(
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    enabled: Callable[[torch.device], bool],
    bad: str = "fused",
) -> None:
    monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    assert not enabled(cuda)
    monkeypatch.setenv(variable, bad)
    with pytest.raises(ValueError, match=f"{variable}='{bad}'"):
        enabled(cuda)
    monkeypatch.setenv(variable, "triton")
    assert enabled(cuda) and not enabled(torch.device("cpu"))


@contextmanager
def switched_on(*variables: str) -> Iterator[None]:
    """Within the block each ``FP8RL_*`` switch is ``triton``; on leaving, each is unset."""
    os.environ.update(dict.fromkeys(variables, "triton"))
    try:
        yield
    finally:
        for variable in variables:
            os.environ.pop(variable, None)
