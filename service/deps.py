"""Dependencies of the routes: the tenant behind the bearer token, the store, the settings."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request, status

from service.auth import TokenAuth
from service.settings import Settings
from service.store import JobStore


def get_store(request: Request) -> JobStore:
    store: JobStore = request.app.state.store
    return store


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_tenant(request: Request) -> str:
    auth: TokenAuth = request.app.state.auth
    tenant = auth.tenant(request.headers.get("authorization"))
    if tenant is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or unknown bearer token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return tenant


StoreDep = Annotated[JobStore, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
TenantDep = Annotated[str, Depends(get_tenant)]
