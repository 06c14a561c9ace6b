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
    """Counts kernel launches by operator (``aten``) and by Triton kernel (``triton``) while it is
    the active mode; raises :class:`HostCopyError` at a blocking copy to the host.

    ``F.scaled_dot_product_attention`` counts as one kernel, as a GPU runs it (flash or memory-
    efficient attention); on fake tensors it takes torch's math path, whose operators are not
    counted."""

    def __init__(self) -> None:
        super().__init__()
        self.aten: Counter[str] = Counter()
        self.triton: Counter[str] = Counter()
        self.active = False
        self.inside_fused = 0
        self.reads: int | None = None  # host reads, counted inside counting_reads (else they raise)

    def __enter__(self) -> Launches:
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if blocking_copy_to_host(func, args, kwargs):
            if self.reads is None:
                raise HostCopyError(f"{func}: a blocking copy from the GPU to the host")
            self.reads += 1
        if launches_kernel(func) and not self.inside_fused:
            self.aten[func.overloadpacket.__name__] += 1
        return func(*args, **kwargs)

    def launched(self, kernel: str) -> None:
        """A Triton kernel's launch (counted while active)."""
        if self.active:
            self.triton[kernel] += 1

    def fused(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` counted as the one kernel ``name``."""
        if self.active and not self.inside_fused:
            self.aten[name] += 1
        self.inside_fused += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.inside_fused -= 1

    def clear(self) -> None:
        self.aten.clear()
        self.triton.clear()

    @property
    def total(self) -> int:
        return sum(self.aten.values()) + sum(self.triton.values())


def added(before: Counter[str], after: Counter[str]) -> Counter[str]:
    """The launches ``after`` has beyond ``before`` (a longer run's against a shorter one's), which
    must have none that ``after`` lacks."""
    assert not before - after, before - after
    return after - before


class _Event:
    """``torch.cuda.Event`` without a driver: recorded, never seen to complete (a loop that polls
    one without waiting reads nothing)."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return False


@contextmanager
def fake_cuda(
    monkeypatch: pytest.MonkeyPatch, processors: int = 132
) -> Iterator[tuple[FakeTensorMode, Launches]]:
    """A fake-tensor mode whose ``cuda`` tensors need no GPU, and a :class:`Launches` that Triton's
    launches (``kernel[grid](...)``) report to; use the counter as a mode (``with launches:``)
    around the code to count.

    What the CUDA driver would answer is stood in for: the GPU has ``processors`` multiprocessors
    (an H200's 132 by default; kernels size their grids by it), pinned host memory is ordinary
    memory, an event never completes (:class:`_Event`), and a CUDA random generator is ``None``
    (a fake tensor cannot draw from one; the draw is still one kernel)."""
    import triton.runtime.jit as jit

    from workers.fp8 import dispatch

    launches = Launches()
    real_generator = torch.Generator

    class Generator(torch.Generator):  # a type still, for annotations evaluated meanwhile
        def __new__(cls, device: Any = "cpu") -> Any:
            return None if torch.device(device).type == "cuda" else real_generator(device)

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def attention(*args: Any, **kwargs: Any) -> Any:
        return launches.fused("scaled_dot_product_attention", sdpa, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", attention)
    monkeypatch.setattr(dispatch, "_sm_count", lambda index: processors)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *args, **kwargs: t)
    monkeypatch.setattr(torch.cuda, "Event", lambda *args, **kwargs: _Event())
    monkeypatch.setattr(torch, "Generator", Generator)

    def launcher(kernel: Any, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            launches.launched(kernel.fn.__name__)

        return launch

    monkeypatch.setattr(jit.JITFunction, "__getitem__", launcher)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode, launches


@contextmanager
def counting_reads(monkeypatch: pytest.MonkeyPatch, launches: Launches) -> Iterator[None]:
    """Inside, each read of a fake CUDA tensor's values by the host (``tolist()``, ``item()``,
    ``float()``, ``int()``, a blocking copy to the CPU) counts one in ``launches.reads`` and reads
    zeros, instead of raising: to count the reads of code that must read (a report's checksums).
    Values of a fake CPU tensor (what such a copy made) read as zeros, uncounted. A copy is seen
    only while ``launches`` is the active mode: use both (``with counting_reads(...), launches:``)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def zeros(t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda:
            assert launches.reads is not None
            launches.reads += 1
        launches.inside_fused += 1  # the stand-in's own zeros are no launch of the code's
        try:
            with unset_fake_temporarily():
                return torch.zeros(t.shape, dtype=t.dtype)
        finally:
            launches.inside_fused -= 1

    def on_fakes(real: Any, read: Any) -> Any:
        return lambda t, *args: read(zeros(t)) if isinstance(t, FakeTensor) else real(t, *args)

    monkeypatch.setattr(FakeTensor, "tolist", lambda t: zeros(t).tolist())
    for name in ("item", "__float__", "__int__"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, on_fakes(method, method))
    launches.reads = 0
    try:
        yield
    finally:
        launches.reads = None


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


def build_on_fake_cuda(monkeypatch: pytest.MonkeyPatch, mode: FakeTensorMode, *modules: Any) -> None:
    """``build_policy`` as each of ``modules`` imported it builds the model on ``meta`` and moves it
    to the fake GPU, with SDPA attention (what it picks on CUDA). The FP8 conversion's audit skips
    its one read of the weights' maxima (at start-up, not in a hot loop)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from workers.engines.models import build_policy
    from workers.fp8 import convert

    def built(
        spec: Any, vocab: int, dtype: torch.dtype, device: Any, init_on_host: bool = False
    ) -> nn.Module:
        with unset_fake_temporarily():
            model = build_policy(spec, vocab, dtype, "meta")
        model.config._attn_implementation = "sdpa"
        return to_fake_cuda(model, mode)

    for module in modules:
        monkeypatch.setattr(module, "build_policy", built)
    monkeypatch.setattr(convert, "_with_weight_amax", lambda rows, amax: rows)
