"""Property-based API testing from the service's own OpenAPI schema: no input gives a 5xx."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings

from service.app import create_app
from service.settings import Settings

TOKEN = "schema-token-0123456789"
_app = create_app(Settings(data_dir=Path(tempfile.mkdtemp()), max_concurrent_jobs=10**9), tokens={TOKEN: "t"})
schema = schemathesis.openapi.from_asgi("/openapi.json", _app)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: Any) -> None:
    response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:300]}"
    )
