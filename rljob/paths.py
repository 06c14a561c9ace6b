"""Which files a job submitted to the service may name: its tenant's directory and shared read-only roots.

A job spec names files the driver opens: ``task.dataset``, ``task.validation_dataset``, a python
grader's ``file``, and ``model.name`` / ``tokenizer.name`` when they are local checkpoints rather
than Hugging Face ids. ``fp8rl run`` on a laptop opens
whatever its user names. A job that arrives through the service (REST, or an RLJob that the
operator runs) is confined:

- a relative path resolves under the tenant's home (``<data-dir>/tenants/<tenant>/`` for the
  embedded default, ``/data`` in a job's pods on Kubernetes); the driver runs there, so a Hugging
  Face id such as ``Qwen/Qwen2.5-1.5B`` is read from the home if it is there, else downloaded;
- an absolute path must lie under the home or one of the service's read-only roots (e.g.
  ``FP8RL_MODEL_ROOTS`` for shared checkpoints);
- ``..`` that climbs out, and (where the files can be seen: the embedded default) symlinks that
  lead out, are refused.

The check never opens a file, and its message is the same whether the path exists or not, so it
tells a tenant nothing about files outside its reach. Shared by the service (at POST) and the
operator (when it builds a RayJob from an RLJob created with kubectl): both tiers read it here.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence
from pathlib import Path, PurePath, PurePosixPath
from typing import NamedTuple

from rljob.spec import JobSpec

# the spec fields the driver opens as files (or Hugging Face ids), as (section, field); and the
# python graders' files (spec_paths)
PATH_FIELDS: tuple[tuple[str, str], ...] = (
    ("task", "dataset"),
    ("task", "validation_dataset"),
    ("model", "name"),
    ("tokenizer", "name"),
)


def spec_paths(spec: JobSpec) -> list[tuple[str, str]]:
    """``[(field, path)]`` of every file ``spec`` names: PATH_FIELDS that are set, each python
    grader's ``file``, each http grader's ``token_file`` and each model grader's ``model``
    (``task.graders[1].file``, a multi's child as ``...graders.<name>.file``)."""
    out = []
    for section, name in PATH_FIELDS:
        value = getattr(getattr(spec, section), name)
        if value is not None:
            out.append((f"{section}.{name}", value))
    task = spec.task
    listed = [("task.grader", task.grader)] if task.grader is not None else []
    listed += [(f"task.graders[{i}]", g) for i, g in enumerate(task.graders or [])]
    for where, grader in listed:
        children = [(where, grader)]
        if grader.type == "multi":
            children += [(f"{where}.graders.{n}", c) for n, c in grader.graders.items()]
        out += [(f"{w}.file", g.file) for w, g in children if g.type == "python" and g.file is not None]
        out += [(f"{w}.token_file", g.token_file) for w, g in children if g.type == "http" and g.token_file]
        out += [(f"{w}.model", g.model) for w, g in children if g.type == "model"]
    return out


class PathProblem(NamedTuple):
    field: str  # dotted path in the job spec, e.g. task.dataset
    message: str


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def path_problems(
    spec: JobSpec,
    home: str | PurePath,
    read_only: Sequence[str | PurePath] = (),
    resolve: bool = True,
    shown_home: str | None = None,
) -> list[PathProblem]:
    """The path fields of ``spec`` that lead outside ``home`` and ``read_only``.

    ``resolve``: follow symlinks on this machine's file system (the service runs the driver here);
    ``False`` normalizes the text only (the files are in pods this process cannot see).
    ``shown_home``: how the messages name the home (the service names it without the host's
    directories, ``<data-dir>/tenants/<tenant>``); default: ``home`` itself.
    """

    def norm(p: str) -> str:
        return os.path.realpath(p) if resolve else posixpath.normpath(p)

    home_s = norm(str(home))
    roots = [home_s, *(norm(str(r)) for r in read_only)]
    out = []
    for field, value in spec_paths(spec):
        if "\x00" in value:
            out.append(PathProblem(field, "contains a NUL character"))
            continue
        joined = value if posixpath.isabs(value) else posixpath.join(str(home), value)
        if not any(_inside(norm(joined), root) for root in roots):
            shared = (
                f" or under a shared read-only root ({', '.join(str(r) for r in read_only)})"
                if read_only
                else ""
            )
            out.append(
                PathProblem(
                    field,
                    f"{value!r} leads outside the tenant's files: give a path relative to the tenant's "
                    f"directory ({shown_home or home}), where the job runs{shared}; '..' and symlinks may "
                    "not lead out",
                )
            )
    return out


POD_HOME = PurePosixPath("/data")  # a job's working directory in its pods on Kubernetes


def shown_home(tenant: str) -> str:
    """A tenant's home as messages name it: no directory of the service's host in them."""
    return f"<data-dir>/tenants/{tenant}"


def tenant_home(data_dir: Path, tenant: str) -> Path:
    """A tenant's home on the embedded default: where its drivers run and its jobs' relative paths
    resolve (the service's admission check and its local executor both read it here)."""
    return data_dir / "tenants" / tenant
