"""The base of the job spec's pydantic models (:mod:`rljob.spec`, :mod:`rljob.resources_spec`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown fields are errors, so a typo never silently falls back to a default; assignments
    are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
