"""Dependencies of the routes: the tenant behind the bearer token, the store, the settings, the
executor (all set on the app by ``service.main.create_app``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.convertors import Convertor, register_url_convertor

from rljob.jobs import JobStore
from service.auth import UNAUTHORIZED, UNAUTHORIZED_HEADERS, TokenAuth
from service.executor import Executor
from service.settings import Settings


class JobName(Convertor[str]):
    """A job name in a path: a DNS label, so never ``/`` or ``:`` and ``/v1/jobs/x:suspend`` (a
    custom method, AIP-136 style) never matches the ``{name}`` routes: a wrong method on it is a
    405 listing the custom method's own, not GET's."""

    # a DNS label (service.schemas.NAME_PATTERN), the only names a job can have: any other is
    # 404 here, never a request the store (the Kubernetes API server) would refuse as malformed
    regex = "[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("jobname", JobName())
JOB = "{name:jobname}"  # the path parameter of every /v1/jobs/{name} route


async def get_store(request: Request) -> JobStore:
    store: JobStore = request.app.state.store
    return store


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_executor(request: Request) -> Executor | None:
    """What runs the jobs; None where the app only records them (jobs stay Pending)."""
    executor: Executor | None = request.app.state.executor
    return executor


async def get_tenant(request: Request) -> str:
    auth: TokenAuth = request.app.state.auth
    tenant = auth.tenant(request.headers.get("authorization"))
    if tenant is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, UNAUTHORIZED, headers=UNAUTHORIZED_HEADERS)
    return tenant


StoreDep = Annotated[JobStore, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
TenantDep = Annotated[str, Depends(get_tenant)]
ExecutorDep = Annotated[Executor | None, Depends(get_executor)]


def strict_body(model: type[BaseModel]) -> Callable[[Request], Awaitable[None]]:
    """A dependency holding the body's JSON types exactly to ``model``'s schema: ``0`` is not a
    boolean and ``"5"`` not an integer over the API (``fp8rl run`` keeps YAML's looser reading:
    ``lr: 1e-5`` is a string there). Unparsable bodies are left to FastAPI's 400."""

    async def strict(request: Request) -> None:
        try:
            model.model_validate_json(await request.body(), strict=True)
        except ValidationError as err:
            errors = err.errors()
            if any(e["type"] == "json_invalid" for e in errors):
                return  # not JSON at all: FastAPI's own parse answers 400
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None

    return strict
