"""What a tenant's job may ask for, checked at ``POST /v1/jobs`` before it is recorded.

- **Files** (:mod:`rljob.paths`): ``task.dataset``, ``model.name`` and ``tokenizer.name`` must stay
  inside the tenant's directory (``<data-dir>/tenants/<tenant>/`` for the embedded default, where
  its drivers run; ``/data`` in a job's pods on Kubernetes) or the service's read-only roots
  (``FP8RL_MODEL_ROOTS``). On the embedded default symlinks are followed; on Kubernetes the files
  live in the pods, so only the path text is checked (and again by the operator).
- **Sizes**: the tenant's caps on one job (``FP8RL_MAX_PROBLEMS``, ``FP8RL_MAX_NEW_TOKENS``,
  ``FP8RL_MAX_ACTORS``, per tenant in ``FP8RL_TENANT_LIMITS``): problems generated in memory,
  response length, Ray actors.

Every problem is one ``(field, message)`` with the field as a path into the request body
(``spec.task.dataset``), answered as a 422 like any invalid field.
"""

from __future__ import annotations

from rljob.paths import POD_HOME, path_problems
from rljob.spec import JobSpec
from service.settings import Settings


def admission_problems(spec: JobSpec, tenant: str, settings: Settings) -> list[tuple[str, str]]:
    """``[(field, message)]`` of everything ``tenant`` may not ask for in ``spec``."""
    if settings.store == "kubernetes":
        paths = path_problems(spec, POD_HOME, settings.read_only_roots, resolve=False)
    else:
        paths = path_problems(spec, settings.tenant_home(tenant), settings.read_only_roots)
    out = [(f"spec.{p.field}", p.message) for p in paths]
    caps = settings.caps(tenant)
    problems = spec.task.size + (spec.validation.size if spec.validation.interval else 0)
    sizes = (
        ("spec.task.size", problems, "max_problems", "task.size + validation.size"),
        (
            "spec.rollout.max_new_tokens",
            spec.rollout.max_new_tokens,
            "max_new_tokens",
            "rollout.max_new_tokens",
        ),
        (
            "spec.resources.trainers",
            spec.resources.trainers + spec.resources.generators,
            "max_actors",
            "resources.trainers + generators",
        ),
    )
    for field, asked, cap, what in sizes:
        if asked > caps[cap]:
            out.append(
                (
                    field,
                    f"{what} is {asked}, over tenant {tenant!r}'s limit of {caps[cap]} ({cap}); ask for "
                    "less, or ask the service's operator to raise it (FP8RL_TENANT_LIMITS)",
                )
            )
    return out
