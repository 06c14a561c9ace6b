"""NaN/inf detection for FP8 quantization without a host sync per call.

An FP8 scale computed from a non-finite amax turns a whole block into garbage, so every tensor
that is quantized is checked. Checking with ``bool(...)`` at each call would stop the GPU for the
host once per FP8 linear per decoded token. Instead, inside a :func:`finite_guard`, each call
folds one device-side code into a running minimum:

    code = call_number * 2**32 + first non-finite block     (int64; int64 max when all finite)

Call numbers increase, so the minimum names the first call that saw a non-finite value and, in
it, the first bad scaling block (the amax of each block is what the check reads: a NaN or inf
anywhere in a block makes its amax non-finite). The only host sync is at the end of the guarded
region (one step of the generator or the trainer), where :meth:`FiniteGuard.check` reads the
code and raises :class:`NonFiniteError` naming the call, the tensor's shape and the rows and
columns of the bad block.

Outside any guard, a CPU tensor is checked at once (a CPU has no device to wait for) and the error
names the first bad element; other devices are not checked (run hot paths inside a guard).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

_NONE = torch.iinfo(torch.int64).max
_CALL = 2**32


class NonFiniteError(ValueError):
    """A tensor about to be quantized to FP8 held NaN or inf."""


class _Call(NamedTuple):  # a tuple: one is made per quantization in a guarded step
    where: str
    shape: tuple[int, ...]
    block: tuple[int, int] | None


class FiniteGuard:
    """Accumulates, on each device, the first quantization input that was not finite."""

    def __init__(self) -> None:
        self._codes: dict[torch.device, torch.Tensor] = {}
        self._calls: list[_Call] = []

    def record(
        self, amax: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] | None, where: str
    ) -> None:
        """Fold in the check of one call: ``amax`` is its per-block (or per-tensor) max |x|."""
        buf, call = self.reserve(amax.device, shape, block, where)
        finite = torch.isfinite(amax).reshape(-1)
        # first non-finite block: argmin of the finite flags (0 where all are finite, masked below)
        first = finite.to(torch.uint8).argmin()
        code = torch.where(finite.all(), _NONE, first + call * _CALL)
        torch.minimum(buf, code, out=buf)

    def reserve(
        self, device: torch.device, shape: tuple[int, ...], block: tuple[int, int] | None, where: str
    ) -> tuple[torch.Tensor, int]:
        """For a kernel that checks on its own: the device's int64 code buffer (fold codes in with
        an atomic min) and this call's number (its code is ``call * 2**32 + block``)."""
        buf = self._codes.get(device)
        if buf is None:
            buf = self._codes[device] = torch.full((), _NONE, dtype=torch.int64, device=device)
        self._calls.append(_Call(where, shape, block))
        return buf, len(self._calls) - 1

    @property
    def calls(self) -> int:
        """Quantization calls checked so far."""
        return len(self._calls)

    def check(self) -> None:
        """One host read per device; raise :class:`NonFiniteError` for the first bad call."""
        for code_t in self._codes.values():
            if code_t.device.type == "meta":
                continue  # shapes only: nothing to read
            code = int(code_t)
            if code != _NONE:
                self._raise(code)

    def reset(self) -> None:
        self._codes.clear()
        self._calls.clear()

    def rearm(self, device: torch.device) -> None:
        """Mark every device's code "all finite" again, in place (``device``'s buffer made if it
        is not there yet): a CUDA graph captured under this guard keeps folding into the same
        buffers, and the calls it recorded stay numbered."""
        if device not in self._codes:
            self._codes[device] = torch.full((), _NONE, dtype=torch.int64, device=device)
        for buf in self._codes.values():
            buf.fill_(_NONE)

    def _raise(self, code: int) -> None:
        call = self._calls[code // _CALL]
        block_index = code % _CALL
        raise NonFiniteError(
            f"{call.where}: input of shape {call.shape} holds NaN or inf "
            f"({_locate(block_index, call.shape, call.block)}; call {code // _CALL + 1} of "
            f"{len(self._calls)} checked in this step); FP8 scales computed from it would be "
            "garbage. Find where the non-finite values come from (learning rate, loss, an "
            "overflowing layer) rather than quantizing them."
        )


def _locate(block_index: int, shape: tuple[int, ...], block: tuple[int, int] | None) -> str:
    """Human words for the ``block_index``-th scaling block of a tensor of ``shape``."""
    if block is None:
        return "somewhere in the tensor: one scale per tensor"
    rows, cols = shape[-2], shape[-1]
    n_r, n_c = -(-rows // block[0]), -(-cols // block[1])
    lead, rest = divmod(block_index, n_r * n_c)
    r, c = divmod(rest, n_c)
    r0, c0 = r * block[0], c * block[1]
    where = f"first in block ({r}, {c}): rows {r0}..{min(r0 + block[0], rows) - 1}, "
    where += f"columns {c0}..{min(c0 + block[1], cols) - 1}"
    return where + (f" of leading slice {lead}" if len(shape) > 2 else "")


_ACTIVE: contextvars.ContextVar[FiniteGuard | None] = contextvars.ContextVar("fp8rl_guard", default=None)


def active_guard() -> FiniteGuard | None:
    """The guard of the innermost :func:`finite_guard` block, if any."""
    return _ACTIVE.get()


@contextmanager
def finite_guard(check: bool = True) -> Iterator[FiniteGuard]:
    """Check every quantization input inside the block on the device; read the result once.

    With ``check=True`` (default) the block raises :class:`NonFiniteError` on exit if any input
    was not finite; with ``check=False`` call :meth:`FiniteGuard.check` yourself.
    """
    guard = FiniteGuard()
    token = _ACTIVE.set(guard)
    try:
        yield guard
    finally:
        _ACTIVE.reset(token)
    if check:
        guard.check()


@contextmanager
def use_guard(guard: FiniteGuard) -> Iterator[FiniteGuard]:
    """Make an existing guard the active one inside the block (checked by its owner, e.g. a
    graph-captured decode loop that re-arms and reads its guard around each series of replays)."""
    token = _ACTIVE.set(guard)
    try:
        yield guard
    finally:
        _ACTIVE.reset(token)


def check_input(x: torch.Tensor, amax: torch.Tensor, block: tuple[int, int] | None, where: str) -> None:
    """Record ``x``'s check in the active guard; outside one, check a CPU tensor at once."""
    guard = _ACTIVE.get()
    if guard is not None:
        guard.record(amax, tuple(x.shape), block, where)
    elif x.device.type == "cpu" and not bool(torch.isfinite(amax).all()):
        raise_non_finite(x, where)


def check_known_finite(shape: tuple[int, ...], block: tuple[int, int] | None, where: str) -> None:
    """:func:`check_input` of a CPU call whose block maxima the caller has read and found finite
    (the compiled quantizer's flag): the active guard counts the call, with no tensor work."""
    guard = _ACTIVE.get()
    if guard is not None:
        guard.reserve(torch.device("cpu"), shape, block, where)


def raise_non_finite(x: torch.Tensor, where: str) -> None:
    """Raise :class:`NonFiniteError` naming the first bad element of ``x`` (reads ``x``)."""
    bad = ~torch.isfinite(x)
    n_nan = int(torch.isnan(x).sum())
    n_inf = int(bad.sum()) - n_nan
    first = tuple(int(i) for i in bad.nonzero()[0].tolist())
    raise NonFiniteError(
        f"{where}: input of shape {tuple(x.shape)} has {n_nan} NaN and {n_inf} inf values "
        f"(first at index {first}: {x[first].item()}); FP8 scales computed from it would be "
        "garbage. Find where the non-finite values come from (learning rate, loss, an overflowing "
        "layer) rather than quantizing them."
    )
