"""What a job's driver wrote: ``/v1/jobs/{name}/metrics`` (per-step history) and ``/logs``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.responses import StreamingResponse

from rljob.jobs import JobNotFound
from rljob.status import ACTIVE
from service.deps import JOB, ExecutorDep, SettingsDep, StoreDep, TenantDep
from service.executor import Executor
from service.local_runs import read_metrics, run_dir
from service.problems import ProblemError

router = APIRouter(prefix="/v1/jobs", tags=["runs"])


def _local_only(executor: Executor | None, what: str) -> None:
    """With ``--store kubernetes`` the driver runs in the job's Ray cluster, not beside the service:
    404 (this server has no such resource; a 5xx would say the server failed), with where to look."""
    if executor is not None and not executor.runs_locally:
        raise ProblemError(
            status.HTTP_404_NOT_FOUND,
            f"{what} is not kept by the control plane with --store kubernetes: the driver runs in the "
            "job's RayJob. Read the fp8rl_* series in Prometheus/Grafana, `kubectl logs` of the "
            "RayJob's submitter pod, or metrics.jsonl under the job's output_dir",
            "not-kept-here",
        )


@router.get(f"/{JOB}/metrics")
def job_metrics(
    name: str,
    tenant: TenantDep,
    store: StoreDep,
    settings: SettingsDep,
    executor: ExecutorDep,
    since: Annotated[int, Query(ge=0, description="Only steps after this one.")] = 0,
) -> list[dict[str, Any]]:
    """One object per completed step, as in the run's ``metrics.jsonl``."""
    try:
        job = store.get(tenant, name)
    except JobNotFound:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {name!r} not found") from None
    _local_only(executor, "per-step history")
    return [r for r in read_metrics(settings.data_dir, job) if int(str(r.get("step", 0))) > since]


@router.get(f"/{JOB}/logs", response_class=StreamingResponse)
def job_logs(
    name: str,
    tenant: TenantDep,
    store: StoreDep,
    settings: SettingsDep,
    executor: ExecutorDep,
    request: Request,
    follow: Annotated[bool, Query(description="Keep streaming until the job stops.")] = False,
) -> StreamingResponse:
    """The driver's log, streamed (``follow=true`` tails it while the job is active)."""
    try:
        job = store.get(tenant, name)
    except JobNotFound:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {name!r} not found") from None
    _local_only(executor, "the driver log")
    path = run_dir(settings.data_dir, job.tenant, job.name).driver_log

    async def stream() -> AsyncIterator[bytes]:
        # without an executor nothing will ever write the log: do not wait for it
        offset, tail = 0, follow and executor is not None
        while True:
            if path.exists():
                with path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                if chunk:
                    yield chunk
            if not tail or await request.is_disconnected():
                return
            try:
                if store.get(tenant, name).status.phase not in ACTIVE:
                    tail = False  # one more read, then stop
                    continue
            except JobNotFound:
                return
            await asyncio.sleep(0.5)

    return StreamingResponse(stream(), media_type="text/plain")
