"""One error format for every error the API answers: RFC 9457 problem details.

Every 4xx and 5xx is ``application/problem+json``::

    {"type": "about:blank", "title": "Not Found", "status": 404, "detail": "job 'x' not found"}

``type`` is ``about:blank`` (the status code says it all, RFC 9457 section 4.2.1) except for the
problems a client may want to tell apart, which get a URI of their own under ``PROBLEM_BASE``
(``.../validation``, ``.../kubernetes-unavailable``, ``.../invalid-record``,
``.../not-kept-here``). A 422 adds ``errors``: one ``{field, message}`` per problem, the field as
a dotted path into the body (``spec.rollout.group_size``), the message saying what was wrong and
what is allowed.

The OpenAPI document states, per operation, which of these statuses it can answer, with the
headers that come along (``WWW-Authenticate`` on 401, ``Retry-After`` on 503, ``Allow`` on 405):
:func:`document_errors` rewrites FastAPI's generated document so that it says exactly what the
handlers here send.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

MEDIA_TYPE = "application/problem+json"
PROBLEM_BASE = "https://fp8rl.io/problems/"
RETRY_AFTER_S = 5  # 503: the Kubernetes API server did not answer; ask again after this long


class Problem(BaseModel):
    """RFC 9457 problem details."""

    type: str = Field(
        "about:blank", description="A URI naming the kind of problem; about:blank = see status."
    )
    title: str = Field(description="Short summary of the kind of problem (the status's reason phrase).")
    status: int = Field(description="The HTTP status code.")
    detail: str = Field(description="What went wrong with this request, and what to do about it.")


class FieldError(BaseModel):
    """One invalid field of a request."""

    field: str = Field(
        description="Dotted path into the request body or the query (e.g. spec.rollout.group_size)."
    )
    message: str = Field(description="What was wrong and what is allowed.")


class ValidationProblem(Problem):
    """A 422: the request is well-formed but some fields are invalid."""

    errors: list[FieldError] = Field(description="Every invalid field, one entry each.")


class ProblemError(Exception):
    """Raised by the service's own code for an error with a problem type of its own."""

    def __init__(self, status: int, detail: str, kind: str = "", headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status, self.detail, self.kind, self.headers = status, detail, kind, headers or {}


def problem_response(
    status: int, detail: str, kind: str = "", headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    """The response for one problem (``kind``: the last part of its type URI, or about:blank)."""
    body = Problem(
        type=f"{PROBLEM_BASE}{kind}" if kind else "about:blank",
        title=HTTPStatus(status).phrase,
        status=status,
        detail=detail,
    ).model_dump()
    return JSONResponse({**body, **extra}, status, headers=headers, media_type=MEDIA_TYPE)


_NOT_JSON = "the request body is not valid JSON; send a JSON object (Content-Type: application/json)"


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this request's path (Starlette's own 405 names only the
    first route that matched the path, e.g. POST for ``/v1/jobs`` although GET is there too).
    The routes are the app's endpoints as :func:`install` was told them (``app.state.api_routes``):
    included routers are matched through their own routes, which carry their full paths."""
    methods: set[str] = set()
    for route in request.app.state.api_routes:
        match, _ = route.matches({**request.scope, "method": "__none__"})
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    methods.discard("HEAD")  # served with GET, not documented
    return sorted(methods)


def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    headers = dict(exc.headers or {})
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no such resource: {request.url.path}; the API is under /v1/jobs (see /docs)"
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(allowed_methods(request))
        detail = f"{request.method} is not allowed on {request.url.path}; allowed: {headers['Allow']}"
    if exc.status_code == 400 and detail == "There was an error parsing the body":
        detail = _NOT_JSON
    return problem_response(exc.status_code, detail, headers=headers or None)


def _problem_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ProblemError)
    return problem_response(exc.status, exc.detail, exc.kind, exc.headers)


def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    if any(e.get("type") == "json_invalid" for e in exc.errors()):  # not JSON at all: malformed, 400
        return problem_response(400, _NOT_JSON)
    errors = []
    for e in exc.errors():
        loc = [str(p) for p in e.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path"):
            loc = loc[1:]
        errors.append(FieldError(field=".".join(loc) or "(body)", message=str(e.get("msg", ""))).model_dump())
    first = f"{errors[0]['field']}: {errors[0]['message']}" if errors else "invalid request"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return problem_response(422, f"{first}{more}; see errors", "validation", errors=errors)


def install(app: FastAPI, routes: list[BaseRoute]) -> None:
    """Route every error through the problem format; ``routes``: every endpoint of the app (what
    a 405's ``Allow`` lists)."""
    app.state.api_routes = routes
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ProblemError, _problem_error)
    app.add_exception_handler(RequestValidationError, _validation_error)


# -- the OpenAPI document -------------------------------------------------------------------------

# What each status means for a client, and the headers it carries
_ERRORS: dict[int, tuple[str, dict[str, str]]] = {
    400: ("The request body is not valid JSON.", {}),
    401: ("Missing or unknown bearer token.", {"WWW-Authenticate": "Bearer"}),
    403: ("Over a tenant limit, or the tenant cannot run jobs here.", {}),
    404: (
        "No such job for this tenant (or, with --store kubernetes, a driver's metrics or log, which "
        "the control plane does not keep: type .../not-kept-here).",
        {},
    ),
    405: ("The method is not allowed on this path.", {"Allow": "The allowed methods."}),
    408: ("The request body did not arrive within the service's deadline.", {}),
    409: ("The job's state does not allow this (name taken, wrong phase, invalid record).", {}),
    413: ("The request body is over the service's limit.", {}),
    422: ("Some fields are invalid: `errors` lists each.", {}),
    429: ("Over the tenant's rate of grader calls; retry after Retry-After seconds.", {"Retry-After": ""}),
    501: ("This control plane has no grader runtime (the control-plane image): use `fp8rl grade`.", {}),
    503: (
        "The Kubernetes API server (or a grader's process) did not answer; retry after Retry-After seconds.",
        {"Retry-After": ""},
    ),
}
_HEADER_DESCRIPTIONS = {
    "WWW-Authenticate": "The authentication scheme: Bearer.",
    "Allow": "The methods this path allows.",
    "Retry-After": "Seconds to wait before retrying.",
    "Location": "The URL of the created job.",
}


def _response(status: int) -> dict[str, Any]:
    description, headers = _ERRORS[status]
    schema = "ValidationProblem" if status == 422 else "Problem"
    out: dict[str, Any] = {
        "description": description,
        "content": {MEDIA_TYPE: {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }
    if headers:
        out["headers"] = {
            name: {
                "description": _HEADER_DESCRIPTIONS[name],
                "schema": {"type": "integer" if name == "Retry-After" else "string"},
            }
            for name in headers
        }
    return out


def document_errors(
    app: FastAPI,
    errors: dict[tuple[str, str], list[int]],
    extra: dict[tuple[str, str], dict[int, dict[str, Any]]],
) -> None:
    """Make ``app.openapi()`` say what the handlers answer.

    ``errors``: ``{(METHOD, path): [status, ...]}`` for each operation (every operation also gets
    the statuses any request can meet: 405, and 408 and 413 where a body is read). FastAPI's own 422
    (``HTTPValidationError``) is replaced by :class:`ValidationProblem`. ``extra``: per
    ``(METHOD, path)`` a dict merged into the operation's responses (success media types and
    headers).
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (Problem, FieldError, ValidationProblem):
            schemas.update(
                model.model_json_schema(ref_template="#/components/schemas/{model}").pop("$defs", {})
            )
            schemas[model.__name__] = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas[model.__name__].pop("$defs", None)
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        for path, item in doc.get("paths", {}).items():
            for method, op in item.items():
                key = (method.upper(), path)
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                statuses = set(errors.get(key, [])) | {405}
                if method in ("post", "put", "patch"):
                    statuses |= {408, 413}  # the body's deadline and limit apply to every such request
                if "requestBody" in op:
                    statuses.add(400)
                for status in sorted(statuses):
                    responses[str(status)] = _response(status)
                for status, override in extra.get(key, {}).items():
                    responses.setdefault(str(status), {}).update(override)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
