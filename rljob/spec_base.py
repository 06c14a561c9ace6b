"""The base of the job spec's pydantic models (:mod:`rljob.spec`, :mod:`rljob.resources_spec`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# The largest seed a spec takes: numpy's and Python's generators take any, but 32 bits is what
# every engine's seeding accepts.
MAX_SEED = 2**31 - 1


class StrictModel(BaseModel):
    """Unknown fields are errors, so a typo never silently falls back to a default; assignments
    are validated too. ``NaN``, ``Infinity`` and numbers past a float's range (``1e309``) are
    refused in every float field: JSON cannot carry them, so a stored spec could never be read
    back."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
