"""What a tenant's job may ask for, checked at ``POST /v1/jobs`` before it is recorded.

- **Files** (:mod:`rljob.paths`): ``task.dataset``, ``task.validation_dataset``, python graders'
  ``file``, ``model.name`` and ``tokenizer.name`` must stay
  inside the tenant's directory (``<data-dir>/tenants/<tenant>/`` for the embedded default, where
  its drivers run; ``/data`` in a job's pods on Kubernetes) or the service's read-only roots
  (``FP8RL_MODEL_ROOTS``). On the embedded default symlinks are followed; on Kubernetes the files
  live in the pods, so only the path text is checked (and again by the operator).
- **Graders**: python and code graders (tenants' code) in a local job (``--store sql``) only where
  the grader sandbox runs, or with ``--allow-unsandboxed-graders`` (:mod:`service.graders`).
- **Sizes**: the tenant's caps on one job (``FP8RL_MAX_PROBLEMS``, ``FP8RL_MAX_NEW_TOKENS``,
  ``FP8RL_MAX_ACTORS``, ``FP8RL_MAX_PARAMETERS``, ``FP8RL_MAX_TOKENS_PER_STEP``,
  ``FP8RL_MAX_THREADS``, ``FP8RL_MAX_TASK_PARAMS_BYTES``, per tenant in ``FP8RL_TENANT_LIMITS``):
  problems generated in memory, response length, Ray actors, a tiny model's parameters, tokens a
  step generates and trains on, torch threads, and ``task.params`` (:mod:`rljob.costs`).

Every problem is one ``(field, message)`` with the field as a path into the request body
(``spec.task.dataset``), answered as a 422 like any invalid field.
"""

from __future__ import annotations

from rljob.costs import costs
from rljob.paths import POD_HOME, path_problems, shown_home
from rljob.spec import JobSpec
from service.graders import GraderRuntime
from service.settings import Settings


def admission_problems(
    spec: JobSpec, tenant: str, settings: Settings, graders: GraderRuntime | None = None
) -> list[tuple[str, str]]:
    """``[(field, message)]`` of everything ``tenant`` may not ask for in ``spec``; ``graders``:
    the service's grader runtime, which refuses tenants' code in local jobs without a sandbox."""
    if settings.store == "kubernetes":
        paths = path_problems(spec, POD_HOME, settings.read_only_roots, resolve=False)
    else:
        paths = path_problems(
            spec, settings.tenant_home(tenant), settings.read_only_roots, shown_home=shown_home(tenant)
        )
    out = [(f"spec.{p.field}", p.message) for p in paths]
    if graders is not None and settings.store == "sql":
        refused = graders.refusal(spec.task.grader_list())
        if refused is not None:
            out.append(("spec.task.graders", refused))
    caps = settings.caps(tenant)
    cost = costs(spec)
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
        ("spec.model.tiny", cost.parameters, "max_parameters", "the tiny model's parameter count"),
        (
            "spec.rollout.max_new_tokens",
            cost.tokens_per_step,
            "max_tokens_per_step",
            "rollout.prompts_per_step x group_size x max_new_tokens",
        ),
        (
            "spec.resources.threads_per_actor",
            cost.threads,
            "max_threads",
            "(resources.trainers + generators) x threads_per_actor",
        ),
        ("spec.task.params", cost.params_bytes, "max_task_params_bytes", "task.params as JSON (bytes)"),
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
