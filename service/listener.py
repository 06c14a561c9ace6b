"""The API port's HTTP listener: uvicorn with bounds on what one client can hold.

A client that never finishes a request must not hold a connection (a file, a buffer) for long,
and many of them must not hold them all. Beside uvicorn's own idle keep-alive timeout, each
connection here has

- a **header deadline** (``header_timeout_s``): a request's line and headers must arrive within it,
  counted from the connection's start or from the end of the previous response. A client that
  trickles a header byte every few seconds is cut off at the deadline. (uvicorn's keep-alive timer
  is reset by every byte, so alone it would hold such a client forever.)
- a **body deadline** (``body_timeout_s``, :class:`service.middleware.BodyLimit`): the whole body
  within it from the headers' end, else 408.
- a **connection cap** (``max_connections``): a connection over it is closed at once, before a
  byte is read; uvicorn's ``limit_concurrency`` answers 503 to requests over the same number.

uvicorn's H11 protocol is the base (``--http h11``): these bounds are written against its
connection object, which the tests drive over real sockets.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ListenerLimits:
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 5.0  # uvicorn's keep-alive timeout between requests
    body_timeout_s: float = 30.0
    max_connections: int = 1000


def protocol(limits: ListenerLimits) -> type[H11Protocol]:
    """uvicorn's H11 protocol with ``limits``' header deadline and connection cap."""

    class BoundedH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _timed: Any = None  # the request cycle whose head arrived in time

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                log.warning(
                    "connection refused: %d open, the cap is %d",
                    len(self.connections) - 1,
                    limits.max_connections,
                )
                transport.abort()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(limits.header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _header_timeout(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return  # a request is in (its head arrived): the body deadline is the app's
            log.info("connection closed: no request head within %.0f s", limits.header_timeout_s)
            self.transport.abort()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._timed:
                self._timed = self.cycle  # a new request's head is complete: no deadline on it
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head, if any, within the deadline too

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return BoundedH11


def uvicorn_options(limits: ListenerLimits) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` that apply ``limits``."""
    return {
        "http": protocol(limits),
        "timeout_keep_alive": limits.idle_timeout_s,
        "limit_concurrency": limits.max_connections,
        "h11_max_incomplete_event_size": 16 * 1024,  # a request line and headers: at most 16 KiB
    }
