"""CUDA tensors without a GPU: run the CUDA branches of a hot loop on a CPU and count what it launches.

Under torch's ``FakeTensorMode`` a tensor has a device, shape, strides and dtype but no data. On a
fake ``cuda`` device ``x.is_cuda`` is true, so fp8rl takes its GPU paths (the Triton quantizers,
the padded layouts for cuBLAS, the fused groups), and every torch operator runs its meta
implementation, which applies CUDA's own checks (``F.scaled_mm``'s operand and scale layouts among
them). An operator that would read a value back to the host (``.item()``, ``.tolist()``, ``bool()``
of a tensor, ``nonzero``) cannot run on a tensor without data, so a host sync raises here instead
of waiting there; :class:`Launches` raises for the other kind, a blocking copy to the host.

:class:`Launches` counts the operators that launch a kernel (views, metadata queries and empty
allocations launch none) and the Triton kernels launched, by name; Triton's launches are recorded
and not run (the interpreter checks their arithmetic elsewhere). A model is built on ``meta`` and
moved to the fake device with :func:`to_fake_cuda`: building it under the mode would make
``nn.Module.to`` swap fake parameters, which torch refuses while the mode holds references to them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.device("cuda", 0)
# operators that launch no kernel although their schema does not say they alias their input
NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view"}


def launches_kernel(func: Any) -> bool:
    """Whether ``func`` (an ``OpOverload``) launches a kernel on a GPU: not a ``prim`` query (device,
    layout), not a view or alias of its input (its first output aliases without writing), not an
    empty allocation."""
    if func.namespace == "prim" or func.overloadpacket.__name__ in NO_KERNEL:
        return False
    returns = func._schema.returns
    alias = returns[0].alias_info if returns else None
    return alias is None or alias.is_write


class HostCopyError(AssertionError):
    """A blocking copy from the GPU to the host: the host waits for the GPU there."""


def blocking_copy_to_host(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``func(*args, **kwargs)`` copies a CUDA tensor to the host and waits for it."""
    name = func.overloadpacket.__name__
    if name == "_to_copy":
        target = kwargs.get("device")
        leaving = args[0].is_cuda and target is not None and torch.device(target).type == "cpu"
        return leaving and not kwargs.get("non_blocking", False)
    if name == "copy_":
        return args[0].device.type == "cpu" and args[1].is_cuda and not (len(args) > 2 and args[2])
    return False


class Launches(TorchDispatchMode):
    """Counts kernel launches by operator (``aten``) and by Triton kernel (``triton``); raises
    :class:`HostCopyError` at a blocking copy to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.aten: Counter[str] = Counter()
        self.triton: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if blocking_copy_to_host(func, args, kwargs):
            raise HostCopyError(f"{func}: a blocking copy from the GPU to the host")
        if launches_kernel(func):
            self.aten[func.overloadpacket.__name__] += 1
        return func(*args, **kwargs)

    def clear(self) -> None:
        self.aten.clear()
        self.triton.clear()

    @property
    def total(self) -> int:
        return sum(self.aten.values()) + sum(self.triton.values())


@contextmanager
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeTensorMode, Launches]]:
    """A fake-tensor mode whose ``cuda`` tensors need no GPU, and a :class:`Launches` that Triton's
    launches (``kernel[grid](...)``) report to; use the counter as a mode (``with launches:``)
    around the code to count."""
    import triton.runtime.jit as jit

    launches = Launches()

    def launcher(kernel: Any, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            launches.triton[kernel.fn.__name__] += 1

        return launch

    monkeypatch.setattr(jit.JITFunction, "__getitem__", launcher)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode, launches


def to_fake_cuda(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """``model`` (built on ``meta``) with every parameter and buffer on the fake ``cuda`` device,
    tied ones still tied."""
    moved: dict[int, Any] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if t is None:
                    continue
                if id(t) not in moved:
                    fake = FakeTensor(mode, t.data, CUDA)
                    is_param = isinstance(t, nn.Parameter)
                    moved[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake
                store[name] = moved[id(t)]
    return model
