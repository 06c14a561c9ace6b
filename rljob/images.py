"""Which container images a job may run: an allow-list of prefixes, read by both tiers.

Whoever may create an RLJob picks ``spec.cluster.image``, and the operator runs that image in
pods with the tenant's GPUs, volume and service account. So the image must come from a path the
cluster's admin allowed (the chart's ``jobDefaults.allowedImages``, and always the chart's own
worker image, exactly as the chart pins it). The operator refuses any other (the RLJob fails with
InvalidSpec, naming the field); the REST API gives tenants no image field at all (its body is the
job spec only).

The rule, for an image reference ``image`` and an allowed ``prefix``:

- ``image`` must be a well-formed reference: ``[registry[:port]/]path[:tag][@algorithm:hex]``
  with the lower-case path components of the OCI distribution grammar (so no ``..``, spaces or
  upper case can make two spellings of one name);
- ``image == prefix``, or ``image`` is ``prefix``'s repository with a tag or digest: ``prefix``
  followed by ``@`` (a digest) or ``:`` and a tag (text without ``/``: ``registry.example:5000/x``
  is another registry, not a tag of ``registry.example``). A repository *under* the prefix's path is
  allowed only where the prefix says so by ending in ``/``; a prefix that ends in ``:`` or ``@``
  allows only tags or only digests of its repository.

So ``registry.example/fp8rl-worker`` allows ``registry.example/fp8rl-worker:1.2`` and
``registry.example/fp8rl-worker@sha256:...``, but neither ``registry.example/fp8rl-worker/cuda12:1``
(a sub-path: list it, or allow ``registry.example/fp8rl-worker/``) nor
``registry.example/fp8rl-worker-evil:1``. A prefix is text, not a trust root: a registry
that lets anyone push under the allowed path lets anyone supply the image; pin digests where
that matters.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# the OCI distribution reference grammar (distribution/reference), as regular expressions
_ALNUM = r"[a-z0-9]+"
_COMPONENT = rf"{_ALNUM}(?:(?:[._]|__|-+){_ALNUM})*"
_HOST_PART = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"(?:{_HOST_PART}(?:\.{_HOST_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}"
REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?")
NAME_MAX = 255  # characters of the repository name (distribution's limit)
BOUNDARIES = "/:@"


def is_reference(image: str) -> bool:
    """Whether ``image`` is a well-formed image reference."""
    found = REFERENCE.fullmatch(image)
    return found is not None and len(found.group("name")) <= NAME_MAX


def repository_of(image: str) -> str:
    """``image`` without its tag and digest (``ghcr.io/fp8rl/worker:0.1.0`` -> ``ghcr.io/fp8rl/worker``)."""
    name = image.split("@", 1)[0]
    head, sep, tail = name.rpartition(":")
    return head if sep and "/" not in tail else name


def allowed_by(image: str, prefix: str) -> bool:
    """Whether ``prefix`` allows ``image`` (the boundary rule of this module's docstring)."""
    if not prefix or not image.startswith(prefix):
        return False
    if image == prefix:
        return True
    rest = image[len(prefix) :]
    if prefix[-1] in BOUNDARIES:  # the boundary is the prefix's own last character
        sep, tail = prefix[-1], rest
    else:
        sep, tail = rest[0], rest[1:]
    if sep == "/":
        return prefix[-1] == "/"  # a sub-path only where the prefix itself ends in "/"
    if sep == "@":
        return True
    return sep == ":" and "/" not in tail  # a tag, not a registry's port


def image_problems(image: str, allowed_prefixes: Sequence[str]) -> list[str]:
    """What is wrong with running ``image`` under ``allowed_prefixes`` (empty list: nothing).
    Messages name no field: each caller prefixes its own path (``spec.cluster.image``)."""
    if not is_reference(image):
        return [
            f"{image!r} is not an image reference: [registry[:port]/]path[:tag][@sha256:<hex>], "
            "path in lower case"
        ]
    if any(allowed_by(image, prefix) for prefix in allowed_prefixes):
        return []
    allowed = ", ".join(repr(p) for p in allowed_prefixes) or "none"
    return [
        f"{image!r} is not an allowed image: it must be one of {allowed}, or that repository with "
        "':<tag>' or '@<digest>' (a path under one only where it ends in '/')"
    ]
