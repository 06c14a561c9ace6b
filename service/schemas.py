"""Request and response bodies of the REST API (the job spec itself is ``rljob.JobSpec``)."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rljob.graders import GraderKind
from rljob.spec import JobSpec
from rljob.status import JobStatus

NAME_PATTERN = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class JobCreate(BaseModel):
    """``POST /v1/jobs`` body."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=f"^{NAME_PATTERN.pattern}$",
        description="DNS label, unique per tenant.",
    )
    spec: JobSpec = Field(default_factory=JobSpec, description="The RL job spec (docs/job-spec.md).")


class JobPublic(BaseModel):
    """A job as the API returns it."""

    name: str
    tenant: str
    spec: JobSpec
    status: JobStatus
    created: datetime
    updated: datetime


class JobList(BaseModel):
    items: list[JobPublic]
    total: int
    next_offset: int | None = Field(None, description="Pass as `offset` for the next page; null at the end.")


MAX_ITEM_BYTES = 64 * 1024


class GraderSample(BaseModel):
    """A response as graders read it."""

    model_config = ConfigDict(extra="forbid")

    output_text: str = Field(max_length=MAX_ITEM_BYTES, description="The model's response.")


class GraderValidate(BaseModel):
    """``POST /v1/graders/validate`` body."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    grader: GraderKind = Field(description="A grader, as in task.grader (docs/job-spec.md: Graders).")


class GraderRun(GraderValidate):
    """``POST /v1/graders/run`` body: one grader, one data row, one response."""

    item: dict[str, Any] = Field(
        default_factory=dict, description="The data row ({{item.*}}), at most 64 KiB as JSON."
    )
    sample: GraderSample

    @field_validator("item")
    @classmethod
    def _bounded(cls, item: dict[str, Any]) -> dict[str, Any]:
        if len(json.dumps(item)) > MAX_ITEM_BYTES:
            raise ValueError(f"at most {MAX_ITEM_BYTES} bytes as JSON")
        return item


class GraderValidation(BaseModel):
    """The answer of ``/v1/graders/validate``: the grader as the service reads it (defaults filled)."""

    grader: GraderKind
    user_code: list[str] = Field(description="Graders that run tenants' code (python, code): in the sandbox.")
    checked_in_sandbox: bool = Field(
        description="A python grader was compiled in the grader sandbox (false: the schema alone was "
        "checked)."
    )
    sandbox: str = Field(description="How this service runs graders' code.")


class GraderScore(BaseModel):
    score: float
    error: str | None = Field(None, description="The grader's own error (scored 0).")
    timeout: bool = Field(False, description="It ran out of time (scored 0).")


class GraderResult(BaseModel):
    """The answer of ``/v1/graders/run``."""

    reward: float = Field(description="The grader's reward for the sample.")
    graders: dict[str, GraderScore] = Field(description="By grader (a multi's children as <multi>.<child>).")
