"""``/v1/graders``: check a grader, and run it on one sample, before a job pays for it.

Both need a tenant's token and are rate-limited per tenant (``FP8RL_GRADER_RUNS_PER_MINUTE``: 429
with ``Retry-After`` past it). A grader's code never runs in this process: see
:mod:`service.graders` for where it runs, and what answers where it cannot.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool

from rljob.graders import needs_sandbox, walk
from service.deps import TenantDep, strict_body
from service.graders import NO_RUNTIME, GraderRuntime, GraderUnavailable, RateLimit
from service.problems import RETRY_AFTER_S
from service.schemas import GraderResult, GraderRun, GraderValidate, GraderValidation

router = APIRouter(prefix="/v1/graders", tags=["graders"])


def _runtime(request: Request) -> GraderRuntime:
    runtime: GraderRuntime = request.app.state.graders
    return runtime


def _limit(request: Request, tenant: str) -> None:
    limit: RateLimit = request.app.state.grader_rate
    wait = limit.retry_after(tenant)
    if wait is not None:
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            f"at most {limit.per_minute} grader calls a minute per tenant; try again in {wait} s",
            headers={"Retry-After": str(wait)},
        )


def _unavailable(err: GraderUnavailable) -> HTTPException:
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    return HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"{err}; try again", headers=retry)


def _invalid(message: str) -> RequestValidationError:
    return RequestValidationError([{"loc": ("body", "grader"), "msg": message, "type": "grader"}])


def _no_files(body: GraderValidate) -> None:
    if any(kind == "python" and g.file is not None for kind, g in walk(body.grader)):
        raise _invalid("a python grader's file is read by the job that names it; here, give its source")
    if any(kind == "http" and g.token_file is not None for kind, g in walk(body.grader)):
        raise _invalid("an http grader's token_file is read by the job that names it, not here")


@router.post(
    "/validate", response_model=GraderValidation, dependencies=[Depends(strict_body(GraderValidate))]
)
async def validate_grader(body: GraderValidate, request: Request, tenant: TenantDep) -> GraderValidation:
    """The grader as the service reads it (422 naming the field otherwise), with a python grader
    compiled (imports run) in the grader sandbox where this service has one."""
    _limit(request, tenant)
    _no_files(body)
    try:
        runtime = await run_in_threadpool(_runtime(request).probe)
    except GraderUnavailable as err:
        raise _unavailable(err) from None
    user_code = needs_sandbox([body.grader])
    in_sandbox = bool(user_code) and runtime.available and runtime.refusal([body.grader]) is None
    if runtime.available:
        launcher_ok = in_sandbox or not user_code
        try:
            problems = await run_in_threadpool(runtime.check, body.grader) if launcher_ok else []
        except GraderUnavailable as err:
            raise _unavailable(err) from None
        if problems:
            raise _invalid("; ".join(problems))
    return GraderValidation(
        grader=body.grader, user_code=user_code, checked_in_sandbox=in_sandbox, sandbox=runtime.how
    )


@router.post("/run", response_model=GraderResult, dependencies=[Depends(strict_body(GraderRun))])
async def run_grader(
    body: GraderRun, request: Request, tenant: TenantDep, response: Response
) -> GraderResult:
    """The grader's reward for ``sample`` given the data row ``item``, and each (sub-)grader's
    score, error and timeout, computed as a job would."""
    _limit(request, tenant)
    _no_files(body)
    if any(kind == "http" for kind, _ in walk(body.grader)):
        # the control plane does not call out on a tenant's behalf (it would reach what it reaches)
        raise _invalid("an http grader is called by the job that uses it, not by the control plane")
    if any(kind == "model" for kind, _ in walk(body.grader)):
        raise _invalid("a model grader's model runs on the job's own actor, not in the control plane")
    runtime = await run_in_threadpool(_runtime(request).probe)
    if not runtime.available:
        raise HTTPException(status.HTTP_501_NOT_IMPLEMENTED, NO_RUNTIME)
    refused = runtime.refusal([body.grader])
    if refused is not None:
        raise _invalid(refused)
    try:
        result = await run_in_threadpool(runtime.run, body.grader, body.item, body.sample.output_text)
    except GraderUnavailable as err:
        raise _unavailable(err) from None
    return GraderResult.model_validate(result)
