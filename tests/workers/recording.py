"""Record the calls of a module-level function while the code under test runs. The check modules
that run under Triton's interpreter (``*_checks.py``, outside pytest and its ``monkeypatch``)
count kernel launches with it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

Call = tuple[tuple[Any, ...], dict[str, Any]]


@contextmanager
def recorded(owner: Any, name: str) -> Iterator[list[Call]]:
    """Within the block, ``owner.name`` records each call's ``(args, kwargs)`` in the list it yields,
    then calls the real function; on leaving, the real function is back."""
    calls: list[Call] = []
    real = getattr(owner, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    setattr(owner, name, recording)
    try:
        yield calls
    finally:
        setattr(owner, name, real)
