"""Request and response bodies of the REST API (the job spec itself is ``rljob.JobSpec``)."""

from __future__ import annotations

import re
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

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
