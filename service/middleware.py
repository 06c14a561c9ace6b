"""ASGI middleware of the service, written against ASGI itself rather than Starlette's
``BaseHTTPMiddleware``, which runs every request's app in a task of its own and streams the
response back through a memory channel: a cost paid on each request for a check of one header."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from service.problems import problem_response


class BodyLimit:
    """413 for bodies whose ``Content-Length`` is over the limit (or not a number), before they are
    read into memory."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for key, value in scope["headers"]:
                if key == b"content-length":
                    length = value.decode("latin-1")
                    if not length.isdigit() or int(length) > self.limit:
                        response = problem_response(
                            413,
                            f"request body over {self.limit} bytes; job specs are small, check what is sent",
                        )
                        await response(scope, receive, send)
                        return
                    break
        await self.app(scope, receive, send)
