"""``/v1/jobs``: create, list, get, delete, suspend and resume RL jobs of the caller's tenant.

A tenant only ever sees its own jobs: another tenant's job is 404, as if it did not exist.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool

from rljob.jobs import (
    InvalidRecord,
    Job,
    JobExists,
    JobNotFound,
    JobStore,
    Limits,
    OverLimit,
    TenantNamespaceMissing,
)
from rljob.status import ACTIONS, IllegalTransition, Phase, Reason
from service.admission import admission_problems
from service.deps import JOB, ExecutorDep, SettingsDep, StoreDep, TenantDep, strict_body
from service.executor import Executor
from service.graders import GraderRuntime
from service.schemas import JobCreate, JobList, JobPublic
from service.settings import Settings

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def public(job: Job) -> JobPublic:
    return JobPublic(
        name=job.name,
        tenant=job.tenant,
        spec=job.spec,
        status=job.status,
        created=job.created,
        updated=job.updated,
    )


def _not_found(name: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"job {name!r} not found")


strict_json = strict_body(JobCreate)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobPublic,
    dependencies=[Depends(strict_json)],
)
async def create_job(
    body: JobCreate,
    request: Request,
    tenant: TenantDep,
    store: StoreDep,
    settings: SettingsDep,
    executor: ExecutorDep,
    response: Response,
) -> JobPublic:
    """Record a job (201, with its URL in ``Location``). 422 for files outside the tenant's reach,
    sizes over its caps, or tenants' code without a grader sandbox (:mod:`service.admission`); 409
    if the name exists for this tenant; 403 over the tenant's job or GPU limits."""
    # Checking paths, counting, committing and starting a driver block: one trip to a worker
    # thread for them all. The rest (validation, the answer) stays on the event loop.
    runtime: GraderRuntime = request.app.state.graders
    job = await run_in_threadpool(_create, body, tenant, store, settings, executor, runtime)
    response.headers["Location"] = f"{router.prefix}/{job.name}"
    return public(job)


def _create(
    body: JobCreate,
    tenant: str,
    store: JobStore,
    settings: Settings,
    executor: Executor | None,
    graders: GraderRuntime | None = None,
) -> Job:
    refused = admission_problems(body.spec, tenant, settings, graders)
    if refused:  # files outside the tenant's reach, or sizes over its caps: invalid fields, 422
        raise RequestValidationError(
            [
                {"loc": ("body", *field.split(".")), "msg": message, "type": "tenant_policy"}
                for field, message in refused
            ]
        )
    try:  # the limits are checked where the job is recorded, so concurrent POSTs cannot overshoot
        job = store.create(tenant, body.name, body.spec, settings.limits(tenant))
    except OverLimit as err:
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(err)) from None
    except JobExists:
        raise HTTPException(
            status.HTTP_409_CONFLICT, f"job {body.name!r} already exists; pick another name"
        ) from None
    except TenantNamespaceMissing as err:
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(err)) from None
    if executor is not None:
        executor.submit(job)
    return job


@router.get("", response_model=JobList)
def list_jobs(
    tenant: TenantDep,
    store: StoreDep,
    phase: Annotated[Phase | None, Query(description="Only jobs in this phase.")] = None,
    limit: Annotated[int, Query(ge=1, le=500, description="Page size.")] = 50,
    offset: Annotated[int, Query(ge=0, le=10_000_000, description="Jobs to skip.")] = 0,
) -> JobList:
    """The tenant's jobs, oldest first, a page at a time."""
    jobs, total = store.query(tenant, phase, limit, offset)
    nxt = offset + len(jobs) if offset + len(jobs) < total else None
    return JobList(items=[public(j) for j in jobs], total=total, next_offset=nxt)


@router.get(f"/{JOB}", response_model=JobPublic)
async def get_job(name: str, tenant: TenantDep, store: StoreDep) -> JobPublic:
    """Spec, phase, conditions and the latest progress (step, reward, tokens/s, mismatch)."""
    try:  # the store blocks (SQLite, or the Kubernetes API): a worker thread reads it
        return public(await run_in_threadpool(store.get, tenant, name))
    except JobNotFound:
        raise _not_found(name) from None


@router.delete(f"/{JOB}", status_code=status.HTTP_204_NO_CONTENT)
def delete_job(name: str, tenant: TenantDep, store: StoreDep, executor: ExecutorDep) -> None:
    """Cancel the job if it is active, then delete its record."""
    try:
        job: Job | None = store.get(tenant, name)
    except JobNotFound:
        raise _not_found(name) from None
    except InvalidRecord:
        job = None  # nothing runs an invalid job: just delete it
    if executor is not None and job is not None:
        executor.cancel(job)
    try:
        store.delete(tenant, name)
    except JobNotFound:
        raise _not_found(name) from None


def _action(
    name: str, action: str, tenant: str, store: StoreDep, executor: ExecutorDep, limits: Limits | None = None
) -> JobPublic:
    target = ACTIONS[action]
    try:
        job = store.update(
            tenant,
            name,
            lambda s: s.moved(target, Reason.of_action(action), f"{action} requested", action),
            limits,
        )
    except JobNotFound:
        raise _not_found(name) from None
    except IllegalTransition as err:
        raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from None
    except OverLimit as err:
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(err)) from None
    if executor is not None:
        getattr(executor, action)(job)
    return public(job)


@router.post(f"/{JOB}:suspend", response_model=JobPublic)
def suspend_job(name: str, tenant: TenantDep, store: StoreDep, executor: ExecutorDep) -> JobPublic:
    """Stop the job after its current step, with a checkpoint. 409 from a phase that cannot."""
    return _action(name, "suspend", tenant, store, executor)


@router.post(f"/{JOB}:resume", response_model=JobPublic)
def resume_job(
    name: str, tenant: TenantDep, store: StoreDep, executor: ExecutorDep, settings: SettingsDep
) -> JobPublic:
    """Continue a suspended or failed job from its last checkpoint. 403 where the tenant's active
    jobs or their GPUs are at its limits, as for a new job."""
    return _action(name, "resume", tenant, store, executor, settings.limits(tenant))
