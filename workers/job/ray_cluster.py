"""The Ray cluster a job's actors run on: starting or joining it (:func:`ray_init`, token auth
on for a local one), where each actor runs (:func:`actor_options`) and how they talk
(:func:`collective_backend`). "Cluster" is a local Ray, or the RayCluster of a KubeRay RayJob."""

from __future__ import annotations

import logging
import os
from typing import Any

from rljob.resource import RAY_AUTH_MODE_ENV, RAY_GROUP_RESOURCES, RAY_GROUPS_ENV
from rljob.spec import JobSpec

# glibc's malloc for a CPU actor: freed memory kept (trim threshold 64 GiB) and no mmap of its own
# for large blocks, so the tensors of every step reuse the pages of the last instead of faulting
# in fresh ones (docs/benchmarks.md: a SmolLM2 job's CPU steps 1.29x faster); read at process start only
CPU_MALLOC_TUNABLES = "glibc.malloc.trim_threshold=68719476736:glibc.malloc.mmap_max=0"
CPU_MALLOC_ENV = "FP8RL_CPU_MALLOC"


def actor_options(spec: JobSpec, role: str) -> dict[str, Any]:
    """Ray options of a generator or trainer actor. In a RayJob built by the operator
    (``FP8RL_RAY_GROUPS=1``) each also asks for its worker group's custom resource. An actor
    without a GPU starts with :data:`CPU_MALLOC_TUNABLES` (:func:`cpu_malloc_env`)."""
    res = spec.resources
    gpus: float = res.gpus_per_generator if role == "generation" else res.gpus_per_trainer
    if res.share_gpu:  # every actor on the one GPU
        gpus = 1.0 / (res.trainers + res.generators)
    opts: dict[str, Any] = {"num_cpus": res.cpus_per_actor, "num_gpus": gpus}
    if os.environ.get(RAY_GROUPS_ENV) == "1":
        opts["resources"] = {RAY_GROUP_RESOURCES[role]: 1}
    env = cpu_malloc_env() if gpus == 0 else {}
    if env:
        opts["runtime_env"] = {"env_vars": env}
    return opts


def cpu_malloc_env() -> dict[str, str]:
    """The environment a CPU actor's process starts with beyond its node's: ``GLIBC_TUNABLES`` for
    glibc's malloc (:data:`CPU_MALLOC_TUNABLES`), unless ``FP8RL_CPU_MALLOC=default`` turns it off
    or ``GLIBC_TUNABLES`` is already set (the actors inherit that one). Elsewhere than glibc the
    variable is ignored."""
    wanted = os.environ.get(CPU_MALLOC_ENV, "tuned")
    if wanted not in ("tuned", "default"):
        raise ValueError(
            f"{CPU_MALLOC_ENV}={wanted!r}: use tuned (default) or default (glibc's own malloc settings)"
        )
    if wanted == "default" or "GLIBC_TUNABLES" in os.environ:
        return {}
    return {"GLIBC_TUNABLES": CPU_MALLOC_TUNABLES}


def collective_backend(spec: JobSpec) -> str:
    """NCCL when every actor has GPUs of its own; gloo on CPUs and on a shared GPU (NCCL refuses
    two ranks on one device). Collectives always run on the tensors' own device."""
    res = spec.resources
    own_gpus = res.gpus_per_trainer > 0 and res.gpus_per_generator > 0 and not res.share_gpu
    return "nccl" if own_gpus else "gloo"


def ray_init(spec: JobSpec, address: str | None = None) -> bool:
    """Start a local Ray (or join ``address``, else ``RAY_ADDRESS``); True when this call started it.

    A local Ray requires Ray's auth token (``RAY_AUTH_MODE=token``) unless the user's environment
    says otherwise: the token is ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or Ray's own
    ``~/.ray/auth_token`` (made on first use). Ray 2.60 turns this on for local clusters by
    itself but warns on every start when the mode is left unset; setting it says it is meant. A
    cluster that is joined brings its own mode and token (a RayJob's pods have both)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        _token_auth_unless_set()
        res = spec.resources
        need = (res.trainers + res.generators) * res.cpus_per_actor
        ray.init(
            num_cpus=max(int(need + 0.999), os.cpu_count() or 1),
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    return True


def _token_auth_unless_set() -> None:
    """``RAY_AUTH_MODE=token`` for a local Ray when the environment does not choose a mode. Ray
    reads the mode into its config when it is imported, so the config is read again (as Ray's own
    default does when it turns token auth on); its processes inherit the variable."""
    if RAY_AUTH_MODE_ENV in os.environ:
        return
    os.environ[RAY_AUTH_MODE_ENV] = "token"
    try:  # a private API (pyproject bounds Ray to the minor version it was tested on)
        from ray._raylet import Config  # type: ignore[attr-defined]  # compiled; not in its stub

        Config.initialize("")
    except (ImportError, AttributeError, TypeError) as err:
        # Ray 2.60 turns token auth on for local clusters by itself; only its warning comes back
        logging.getLogger(__name__).warning(
            "Ray's config was not read again (%s): Ray's default auth applies", err
        )


def ray_shutdown() -> None:
    """Stop the Ray that :func:`ray_init` started."""
    import ray

    ray.shutdown()
