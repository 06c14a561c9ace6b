"""``http`` graders: the requests of a batch, with their retries, and the bearer token.

Each sample is ``POST``-ed as ``{"item": row, "sample": {"output_text", "output_json"}}``, at most
``max_concurrency`` at once (threads sharing one connection pool); an answer is ``{"score": x}`` or
a bare number. A connection error, a timeout, a 429 or a 5xx is tried again (``retries`` times,
0.1 s, 0.2 s, 0.4 s ... apart); any other 4xx, text that is not JSON, or JSON without a finite
number is an error at once. The token comes from ``token_file`` or, on Kubernetes, the Secret the
operator mounts for ``token_secret`` (``rljob.graders.SecretRef.path``): never from the spec.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rljob.graders import HttpGrader

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


def post_all(g: HttpGrader, token: str | None, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each body's answer, in order: ``{"score"}``, ``{"error"}`` or ``{"timeout"}``."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    limits = httpx.Limits(max_connections=g.max_concurrency)
    with (
        httpx.Client(timeout=g.timeout_s, headers=headers, limits=limits) as client,
        ThreadPoolExecutor(g.max_concurrency) as pool,
    ):
        return list(pool.map(lambda body: _post(client, g, body), bodies))


def http_token(g: HttpGrader, base: Path | None) -> str | None:
    """An http grader's bearer token: its ``token_file``, or the file the operator mounts for its
    ``token_secret``; None without either."""
    if g.token_secret is not None:
        path = Path(g.token_secret.path())
        if not path.is_file():
            raise ValueError(
                f"an http grader's token_secret {g.token_secret.name}/{g.token_secret.key} is mounted by "
                f"the operator on Kubernetes ({path}), and is not here; outside Kubernetes give token_file"
            )
    elif g.token_file is not None:
        path = Path(g.token_file) if base is None or Path(g.token_file).is_absolute() else base / g.token_file
    else:
        return None
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"an http grader's token file cannot be read: {err}") from None
    if not token or any(c in token for c in "\r\n"):
        raise ValueError(f"an http grader's token file {path} holds no token on one line")
    return token


def _post(client: Any, g: HttpGrader, body: dict[str, Any]) -> dict[str, Any]:
    """One sample to an http grader, with its retries (after 0.1, 0.2, 0.4 ... s): ``{"score"}``,
    ``{"error"}`` or ``{"timeout"}``."""
    import httpx

    last: dict[str, Any] = {"error": "no answer"}
    for attempt in range(g.retries + 1):
        if attempt:
            time.sleep(0.1 * 2 ** (attempt - 1))
        try:
            r = client.post(g.url, json=body)
        except httpx.TimeoutException:
            last = {"timeout": True}
            continue
        except httpx.HTTPError as err:
            last = {"error": f"{g.url}: {type(err).__name__}: {err}"}
            continue
        if r.status_code in RETRY_STATUS:
            last = {"error": f"{g.url} answered {r.status_code}"}
            continue
        if r.status_code >= 400:
            return {"error": f"{g.url} answered {r.status_code}: {r.text[:200]}"}
        try:
            value = r.json()
        except ValueError:
            return {"error": f"{g.url} answered {r.text[:200]!r}, not JSON"}
        score = value.get("score") if isinstance(value, dict) else value
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
            shown = json.dumps(value)[:200]
            return {"error": f'{g.url} answered {shown}: expected {{"score": <number>}}'}
        return {"score": float(score)}
    return last
