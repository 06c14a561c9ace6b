"""Bearer tokens mapped to tenants by a tokens file. Tokens are compared in constant time and are
never logged or returned; a missing or unknown token is 401."""

from __future__ import annotations

import hmac
import json
from pathlib import Path

import yaml

# The 401 of every route (service.deps.get_tenant) and of service.middleware.TokenFirst
UNAUTHORIZED = "missing or unknown bearer token: send 'Authorization: Bearer <token>'"
UNAUTHORIZED_HEADERS = {"WWW-Authenticate": "Bearer"}


class TokenFileError(ValueError):
    pass


def load_tokens(path: Path) -> dict[str, str]:
    """``{token: tenant}`` from a YAML or JSON file; tenants must be DNS labels (namespaces)."""
    try:
        text = path.read_text()
    except OSError as err:
        raise TokenFileError(f"tokens file {path}: {err.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise TokenFileError(f"tokens file {path}: not valid YAML/JSON ({err})") from None
    if not isinstance(data, dict) or not data:
        raise TokenFileError(f"tokens file {path}: expected a non-empty mapping {{token: tenant}}")
    from service.schemas import NAME_PATTERN

    for i, (token, tenant) in enumerate(data.items(), 1):
        if not isinstance(token, str) or len(token) < 16:
            raise TokenFileError(f"tokens file {path}: entry {i}: tokens must be strings of >= 16 characters")
        if not isinstance(tenant, str) or not NAME_PATTERN.fullmatch(tenant):
            raise TokenFileError(f"tokens file {path}: entry {i}: tenant must be a DNS label (a-z, 0-9, -)")
    return {str(k): str(v) for k, v in data.items()}


class TokenAuth:
    """Looks a bearer token up; holds only the mapping, logs nothing."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self._tokens = list(tokens.items())

    @property
    def tenants(self) -> list[str]:
        """Every tenant a token maps to (names, never tokens)."""
        return sorted({tenant for _, tenant in self._tokens})

    def tenant(self, authorization: str | None) -> str | None:
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization.removeprefix("Bearer ").strip().encode()
        found = None
        for token, tenant in self._tokens:  # check all: timing does not reveal which matched
            if hmac.compare_digest(token.encode(), given):
                found = tenant
        return found
