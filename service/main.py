"""The composition root of the control plane: ``create_app`` builds the FastAPI application (routes,
auth, body limits, error bodies as RFC 9457 problem details, :mod:`service.problems`) and, for
``fp8rl serve``, the job store and the executor the settings name, started and stopped with the app.

``--store sql`` (the embedded default): ``SqlJobStore`` + ``LocalExecutor`` (a driver process per
job on this machine). ``--store kubernetes``: ``KubernetesJobStore`` (RLJobs) + ``OperatorHandoff``
(the operator runs them).

The API port answers callers without a token only with what holds no tenant data (``/healthz``,
``/readyz``, ``/docs``, ``/openapi.json``). The Prometheus series, which name every tenant, are on
the metrics port (:mod:`service.metrics_port`), which ``fp8rl serve`` opens beside it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from rljob.jobs import InvalidRecord, JobStore
from rljob.version import __version__
from service import metrics_port, middleware, problems
from service.auth import TokenAuth, load_tokens
from service.executor import Executor
from service.graders import GraderRuntime, RateLimit
from service.local_executor import LocalExecutor
from service.problems import RETRY_AFTER_S, problem_response
from service.routes import graders, jobs, runs
from service.sandbox import Sandbox
from service.settings import Settings
from service.store import SqlJobStore


def _kube_error(request: Request, exc: Exception) -> JSONResponse:
    """The Kubernetes API failed or could not be reached: 503 with Retry-After, never a bare 500."""
    what = f"{getattr(exc, 'status', '')} {getattr(exc, 'reason', '') or type(exc).__name__}".strip()
    return problem_response(
        503,
        f"the Kubernetes API server did not accept the request ({what}); try again later",
        "kubernetes-unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def _invalid_record(request: Request, exc: Exception) -> JSONResponse:
    return problem_response(409, str(exc), "invalid-record")


# The error statuses each operation can answer (problems.document_errors adds 405, 408 and 413)
_V1 = [401]
ERRORS: dict[tuple[str, str], list[int]] = {
    ("POST", "/v1/jobs"): [*_V1, 403, 409, 422, 503],
    ("GET", "/v1/jobs"): [*_V1, 409, 422, 503],
    ("GET", "/v1/jobs/{name}"): [*_V1, 404, 409, 503],
    ("DELETE", "/v1/jobs/{name}"): [*_V1, 404, 503],
    ("POST", "/v1/jobs/{name}:suspend"): [*_V1, 404, 409, 503],
    ("POST", "/v1/jobs/{name}:resume"): [*_V1, 403, 404, 409, 503],
    ("GET", "/v1/jobs/{name}/metrics"): [*_V1, 404, 409, 422, 503],
    ("GET", "/v1/jobs/{name}/logs"): [*_V1, 404, 409, 422, 503],
    ("POST", "/v1/graders/validate"): [*_V1, 422, 429, 503],
    ("POST", "/v1/graders/run"): [*_V1, 422, 429, 501, 503],
    ("GET", "/readyz"): [503],
}
_TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}}
SUCCESS: dict[tuple[str, str], dict[int, dict[str, Any]]] = {
    ("POST", "/v1/jobs"): {
        201: {
            "headers": {
                "Location": {"description": "The URL of the created job.", "schema": {"type": "string"}}
            }
        }
    },
    ("GET", "/v1/jobs/{name}/logs"): {200: {"description": "The driver's log, streamed.", **_TEXT}},
}


def build_store(settings: Settings) -> JobStore:
    """The job store the settings name: SQLite under the data dir, or RLJobs in the cluster."""
    if settings.store == "kubernetes":
        from rljob.kube import KubernetesJobStore, api_client

        return KubernetesJobStore(api_client(settings.kubeconfig))
    return SqlJobStore(settings.data_dir / "jobs.sqlite")


def build_executor(settings: Settings, store: JobStore) -> Executor:
    """The executor of ``store``: the operator runs RLJobs; the service runs SQLite's jobs itself."""
    from rljob.kube import KubernetesJobStore

    if isinstance(store, KubernetesJobStore):
        from service.operator_handoff import OperatorHandoff

        return OperatorHandoff(store)
    return LocalExecutor(
        store,
        settings.data_dir,
        read_only=settings.read_only_roots,
        limits=settings.driver_limits,
        driver_retries=settings.driver_retries,
        driver_env=settings.driver_env_names,
        max_drivers=settings.max_local_drivers,
        sandbox=Sandbox.choose(settings.sandbox, settings.bwrap, settings.read_only_roots),
        hf_token=settings.hf_token,
    )


def create_app(
    settings: Settings,
    store: JobStore | None = None,
    tokens: dict[str, str] | None = None,
    executor: Executor | None = None,
    *,
    run_jobs: bool = False,
) -> FastAPI:
    """The app for ``settings``; ``store`` and ``tokens`` default to what the settings name.

    ``executor`` runs the jobs the routes record; its ``start`` and ``shutdown`` are the caller's.
    Without one (and without ``run_jobs``) jobs are recorded and stay Pending. ``run_jobs``
    (``fp8rl serve``): the executor of the store instead (``build_executor``), started before the
    app serves and shut down after it stopped (the app's lifespan), and the metrics port
    (``settings.metrics_port``) open as long. Either way ``app.state.metrics`` is the registry of
    the control plane's series.
    """
    tokens_path = None
    if tokens is None:
        if settings.tokens_file is None:
            raise ValueError("no tokens: pass --tokens-file (or FP8RL_TOKENS_FILE) with {token: tenant}")
        tokens, tokens_path = load_tokens(settings.tokens_file), settings.tokens_file
    store = store if store is not None else build_store(settings)
    owned = build_executor(settings, store) if run_jobs and executor is None else None
    auth = TokenAuth(tokens, tokens_path)  # read again when the file changes
    registry = metrics_port.registry(store, lambda: auth.tenants)
    exporter = (
        metrics_port.MetricsServer(registry, settings.host, settings.metrics_port) if run_jobs else None
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if exporter is not None:
            exporter.start()  # first: a port in use stops the service before any driver starts
            app.state.metrics_port = exporter.port
        try:
            if owned is not None:
                owned.start()  # re-attach drivers a previous process left, start pending jobs
            try:
                yield
            finally:
                if owned is not None:
                    owned.shutdown()
        finally:
            if exporter is not None:
                exporter.stop()

    app = FastAPI(
        title="fp8rl control plane",
        version=__version__,
        description="Submit and watch end-to-end FP8 RL post-training jobs.",
        lifespan=lifespan,
        # no redirect to the path with(out) a trailing slash: it would be built from the Host header
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.auth = auth
    app.state.executor = owned or executor
    app.state.metrics = registry
    app.state.graders = GraderRuntime(settings)
    app.state.grader_rate = RateLimit(settings.grader_runs_per_minute)
    # outermost last: a body without a token is refused before the body limit counts a byte of it
    app.add_middleware(middleware.BodyLimit, limit=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(middleware.TokenFirst, auth=auth)
    app.add_exception_handler(InvalidRecord, _invalid_record)
    if settings.store == "kubernetes":
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        app.add_exception_handler(ApiException, _kube_error)
        app.add_exception_handler(HTTPError, _kube_error)
    app.include_router(jobs.router)
    app.include_router(runs.router)
    app.include_router(graders.router)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    def metrics_moved() -> None:
        """Not here: the series name every tenant, and this port answers callers without a token."""
        raise HTTPException(
            404,
            "the control plane's Prometheus series are on its metrics port (fp8rl serve "
            "--metrics-port), not on the API port",
        )

    @app.get("/readyz", tags=["health"])
    def readyz() -> dict[str, str]:
        """Ready when the store answers (SQLite, or the Kubernetes API server)."""
        app.state.store.ping()
        return {"status": "ready"}

    own = [r for r in app.router.routes if isinstance(r, APIRoute)]
    problems.install(app, [*jobs.router.routes, *runs.router.routes, *graders.router.routes, *own])
    problems.document_errors(app, ERRORS, SUCCESS)
    return app
