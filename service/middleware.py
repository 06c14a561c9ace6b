"""ASGI middleware of the service, written against ASGI itself rather than Starlette's
``BaseHTTPMiddleware``, which runs every request's app in a task of its own and streams the
response back through a memory channel.

Two guards stand before any route, so that a client without a token cannot make the service hold
a large body in memory:

- :class:`TokenFirst`: a request to ``/v1/`` that carries a body is answered 401 before a byte of
  the body is read, unless its bearer token is known. (FastAPI reads a route's body before it
  resolves the route's dependencies, so without this the tenant check would come after the read.)
- :class:`BodyLimit`: the body is counted while it streams in, whatever its framing
  (``Content-Length``, ``Transfer-Encoding: chunked``, or neither); the message that goes over the
  limit is never handed to the app, and the answer is 413. Nothing is buffered here. The body
  must also arrive within ``timeout_s`` of the headers (408 otherwise): a client that trickles a
  body does not hold a connection and a worker for long (:mod:`service.listener` bounds the headers).
"""

from __future__ import annotations

import asyncio
import time

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.auth import UNAUTHORIZED, UNAUTHORIZED_HEADERS, TokenAuth
from service.problems import problem_response


class BodyTooLarge(HTTPException):
    """Raised by the limited ``receive`` when the body goes over the limit. An HTTPException, so
    that a route that is reading (FastAPI re-raises these from its body parsing instead of making
    them a 400) ends in the app's own 413 problem response."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over {limit} bytes; job specs are small, check what is sent")


class BodyTimeout(HTTPException):
    """Raised by the limited ``receive`` when the body has not arrived within its deadline."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"request body not received within {timeout_s:g} s; send it at once")


def _carries_body(headers: Headers) -> bool:
    """A body follows the headers: a non-zero ``Content-Length`` or any ``Transfer-Encoding``
    (RFC 9112 section 6.3: without either, the request has no body)."""
    return "transfer-encoding" in headers or headers.get("content-length", "0") not in ("", "0")


class BodyLimit:
    """413 for bodies over ``limit`` bytes. A ``Content-Length`` over the limit (or not a number)
    is refused before anything is read; any other body is counted as its messages arrive, and the
    one that goes over is not passed on: the app gets :class:`BodyTooLarge` from ``receive``
    instead (and again on any later call). If the app lets that escape before it started its
    response, the 413 is sent here."""

    def __init__(self, app: ASGIApp, limit: int, timeout_s: float | None = None) -> None:
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await problem_response(413, BodyTooLarge(self.limit).detail)(scope, receive, send)
            return
        received = 0
        started = False
        complete = False  # the body's last message arrived: later receives wait for a disconnect
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s

        async def limited_receive() -> Message:
            nonlocal received, complete
            if received > self.limit:
                raise BodyTooLarge(self.limit)
            if complete or deadline is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise BodyTimeout(self.timeout_s or 0.0) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except (BodyTooLarge, BodyTimeout) as err:
            if started:  # too late for a 413 or 408: the server ends the connection
                raise
            await problem_response(err.status_code, str(err.detail))(scope, receive, send)


class TokenFirst:
    """401 for a request under ``prefix`` that carries a body but no known bearer token, answered
    from the headers alone (the body is never read). Requests without a body go on to the routes,
    whose own 401 (or 404, 405) answers them. Every route under ``prefix`` needs a token, so this
    refuses nothing that a route would accept."""

    def __init__(self, app: ASGIApp, auth: TokenAuth, prefix: str = "/v1/") -> None:
        self.app = app
        self.auth = auth
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            headers = Headers(scope=scope)
            if _carries_body(headers) and self.auth.tenant(headers.get("authorization")) is None:
                response = problem_response(401, UNAUTHORIZED, headers=UNAUTHORIZED_HEADERS)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
