"""Bearer tokens mapped to tenants by a tokens file. Tokens are compared in constant time and are
never logged or returned; a missing or unknown token is 401.

The file is read again when it changes (looked at every ``RELOAD_S`` seconds at most): a Secret
the kubelet updates in a pod, or a file an operator edits, takes effect without a restart, so the
chart needs no checksum of the tokens on its pods. A new file that does not load is logged (never
its content) and the tokens held stay in force."""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
from pathlib import Path

import yaml

# The 401 of every route (service.deps.get_tenant) and of service.middleware.TokenFirst
UNAUTHORIZED = "missing or unknown bearer token: send 'Authorization: Bearer <token>'"
UNAUTHORIZED_HEADERS = {"WWW-Authenticate": "Bearer"}
RELOAD_S = 5.0
log = logging.getLogger(__name__)


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


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file does: a kubelet swaps a Secret's files by renaming a directory,
    so the inode of the resolved file changes too."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class TokenAuth:
    """Looks a bearer token up; holds only the mapping, logs nothing. With ``path``, the mapping
    is read again from it when it changes (the module docstring)."""

    def __init__(self, tokens: dict[str, str], path: Path | None = None) -> None:
        self._tokens = list(tokens.items())
        self._path = path
        self._stamp = _stamp(path) if path is not None else None
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def _reload_if_changed(self) -> None:
        if self._path is None or time.monotonic() - self._checked < RELOAD_S:
            return
        with self._lock:
            if time.monotonic() - self._checked < RELOAD_S:
                return
            self._checked = time.monotonic()
            stamp = _stamp(self._path)
            if stamp is None or stamp == self._stamp:
                return
            try:
                tokens = load_tokens(self._path)
            except TokenFileError as err:
                log.warning("the tokens file changed and does not load; keeping the tokens held: %s", err)
                return
            self._tokens, self._stamp = list(tokens.items()), stamp
            log.warning(
                "tokens file read again: %d tokens for %d tenants", len(tokens), len(set(tokens.values()))
            )

    @property
    def tenants(self) -> list[str]:
        """Every tenant a token maps to (names, never tokens)."""
        self._reload_if_changed()
        return sorted({tenant for _, tenant in self._tokens})

    def tenant(self, authorization: str | None) -> str | None:
        self._reload_if_changed()
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization.removeprefix("Bearer ").strip().encode()
        found = None
        for token, tenant in self._tokens:  # check all: timing does not reveal which matched
            if hmac.compare_digest(token.encode(), given):
                found = tenant
        return found
