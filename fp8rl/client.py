"""The REST client behind ``fp8rl submit/list/get/cancel/suspend/resume/logs``.

Server and token come from ``--server``/``--token`` or ``FP8RL_SERVER``/``FP8RL_TOKEN``. Errors
from the server are shown as it sent them (field paths for 422), with the HTTP status.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx


class ClientError(Exception):
    """A request the server refused, or a server that could not be reached."""


class Client:
    def __init__(self, server: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.server = (server or os.environ.get("FP8RL_SERVER") or "http://127.0.0.1:8000").rstrip("/")
        token = token or os.environ.get("FP8RL_TOKEN")
        if not token:
            raise ClientError("no token: pass --token or set FP8RL_TOKEN")
        self._http = httpx.Client(
            base_url=self.server, headers={"Authorization": f"Bearer {token}"}, timeout=timeout
        )

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise ClientError(f"cannot reach {self.server}: {err}") from None
        if r.status_code >= 400:
            raise ClientError(f"HTTP {r.status_code}: {describe(r)}")
        return r.json() if r.content else None

    def submit(self, name: str, spec: dict[str, Any]) -> Any:
        return self._call("POST", "/v1/jobs", json={"name": name, "spec": spec})

    def list(self, phase: str | None = None, limit: int = 50, offset: int = 0) -> Any:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if phase:
            params["phase"] = phase
        return self._call("GET", "/v1/jobs", params=params)

    def get(self, name: str) -> Any:
        return self._call("GET", f"/v1/jobs/{name}")

    def cancel(self, name: str) -> Any:
        return self._call("DELETE", f"/v1/jobs/{name}")

    def action(self, name: str, action: str) -> Any:
        return self._call("POST", f"/v1/jobs/{name}:{action}")

    def logs(self, name: str, follow: bool) -> Iterator[str]:
        try:
            with self._http.stream(
                "GET", f"/v1/jobs/{name}/logs", params={"follow": follow}, timeout=None
            ) as r:
                if r.status_code >= 400:
                    r.read()
                    raise ClientError(f"HTTP {r.status_code}: {describe(r)}")
                yield from r.iter_text()
        except httpx.HTTPError as err:
            raise ClientError(f"cannot reach {self.server}: {err}") from None


def describe(r: httpx.Response) -> str:
    """The service's RFC 9457 problem as one line: every invalid field of a 422, else ``detail``."""
    try:
        body = r.json()
        errors, detail = body.get("errors"), body.get("detail")
    except (json.JSONDecodeError, AttributeError):
        return r.text[:500]
    if isinstance(errors, list) and errors:
        return "; ".join(f"{e.get('field')}: {e.get('message')}" for e in errors)
    return str(detail)


def table(jobs: list[dict[str, Any]]) -> str:
    """A readable table: name, phase, step, reward, tokens/s, mismatch."""
    header = f"{'NAME':<24} {'PHASE':<10} {'STEP':>9} {'REWARD':>7} {'TOK/S':>8} {'MISMATCH':>9}  REASON"
    lines = [header]
    for j in jobs:
        p, st = j["status"]["progress"], j["status"]
        step = f"{p['step']}/{p['total_steps'] or j['spec']['steps']}"
        reward = "-" if p["reward"] is None else f"{p['reward']:.3f}"
        tps = "-" if p["generation_tokens_per_s"] is None else f"{p['generation_tokens_per_s']:.0f}"
        mm = "-" if p["token_mult_prob_error"] is None else f"{p['token_mult_prob_error']:.4f}"
        lines.append(
            f"{j['name']:<24} {st['phase']:<10} {step:>9} {reward:>7} {tps:>8} {mm:>9}  {st['reason']}"
        )
    return "\n".join(lines)
