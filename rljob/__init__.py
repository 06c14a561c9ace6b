"""The RLJob API type shared by every tier: the job spec (and, later, status, phases, CRD schema).

Depends on pydantic and PyYAML only, so the service, the operator and the workers can all import it.
"""

from rljob.spec import (
    AlgorithmSpec,
    ImportanceSamplingSpec,
    JobSpec,
    KlSpec,
    ModelSpec,
    OptimizerSpec,
    PrecisionSpec,
    ResourcesSpec,
    RolloutSpec,
    SpecError,
    TaskSpec,
    TinyModel,
    TokenizerSpec,
    ValidationSpec,
    WarmupSpec,
    describe_errors,
    load_spec,
    parse_spec,
)

__all__ = [
    "AlgorithmSpec",
    "ImportanceSamplingSpec",
    "JobSpec",
    "KlSpec",
    "ModelSpec",
    "OptimizerSpec",
    "PrecisionSpec",
    "ResourcesSpec",
    "RolloutSpec",
    "SpecError",
    "TaskSpec",
    "TinyModel",
    "TokenizerSpec",
    "ValidationSpec",
    "WarmupSpec",
    "describe_errors",
    "load_spec",
    "parse_spec",
]
