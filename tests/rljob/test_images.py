"""The image allow-list (``rljob.images``): which references a prefix admits, written out by hand
from the boundary rule (prefix, then ``/``, ``@`` or ``:`` and a tag; or the prefix itself)."""

from __future__ import annotations

import pytest

from rljob.images import allowed_by, image_problems, is_reference, repository_of

PREFIX = "registry.example/fp8rl-worker"
DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        (PREFIX, True),  # the prefix itself
        (f"{PREFIX}:1.2", True),  # a tag
        (f"{PREFIX}@{DIGEST}", True),  # a digest
        (f"{PREFIX}:1.2@{DIGEST}", True),  # both
        (f"{PREFIX}/cuda12:1", False),  # a repository under the path: only with a prefix ending in /
        (f"{PREFIX}-evil:1", False),  # a longer name that only starts like it
        (f"{PREFIX}evil", False),
        ("registry.example/fp8rl-work:1", False),  # shorter
        ("other.example/fp8rl-worker:1", False),
        (f"evil.example/{PREFIX}:1", False),  # the prefix further in
    ],
)
def test_a_prefix_allows_its_tags_digests_and_sub_paths_only(image: str, allowed: bool) -> None:
    assert allowed_by(image, PREFIX) is allowed
    assert (image_problems(image, [PREFIX]) == []) is allowed


def test_a_registry_prefix_is_not_fooled_by_a_port() -> None:
    # "registry.example:5000/x" is another registry (a port), not a tag of "registry.example"
    assert not allowed_by("registry.example/team/x:1", "registry.example")  # no implicit sub-path
    assert not allowed_by("registry.example:5000/team/x:1", "registry.example")
    # a prefix with its boundary built in
    assert allowed_by("registry.example/team/x:1", "registry.example/")
    assert not allowed_by("registry.example-evil/x:1", "registry.example/")
    assert allowed_by(f"{PREFIX}@{DIGEST}", f"{PREFIX}@")
    assert not allowed_by(f"{PREFIX}:1", f"{PREFIX}@")
    assert allowed_by(f"{PREFIX}:1.2", f"{PREFIX}:")
    assert not allowed_by(f"{PREFIX}:5000/x", f"{PREFIX}:")
    # exact pins: a tag or a digest and nothing else
    assert allowed_by(f"{PREFIX}:1.2", f"{PREFIX}:1.2")
    assert not allowed_by(f"{PREFIX}:1.20", f"{PREFIX}:1.2")
    assert not allowed_by(f"{PREFIX}:1.2", "")


@pytest.mark.parametrize(
    "image",
    [
        "registry.example/fp8rl-worker/../evil:1",  # ".." is no path component
        "registry.example/FP8RL-worker:1",  # upper case in the path
        "registry.example/fp8rl-worker:1 ",
        "registry.example/fp8rl-worker:",
        "registry.example/fp8rl-worker@sha256:abc",  # a digest too short
        "",
    ],
)
def test_malformed_references_are_refused_even_under_an_allowed_prefix(image: str) -> None:
    assert not is_reference(image)
    [problem] = image_problems(image, ["registry.example/"])
    assert "is not an image reference" in problem


def test_the_message_lists_what_is_allowed() -> None:
    [problem] = image_problems(
        "docker.io/library/ubuntu:24.04", ["ghcr.io/fp8rl/worker", "registry.example/"]
    )
    assert problem.startswith("'docker.io/library/ubuntu:24.04' is not an allowed image")
    assert "'ghcr.io/fp8rl/worker', 'registry.example/'" in problem
    assert "none" in image_problems("ghcr.io/fp8rl/worker:1", [])[0]


def test_repository_of_drops_tag_and_digest_not_a_port() -> None:
    assert repository_of("ghcr.io/fp8rl/worker:0.1.0") == "ghcr.io/fp8rl/worker"
    assert repository_of(f"ghcr.io/fp8rl/worker@{DIGEST}") == "ghcr.io/fp8rl/worker"
    assert repository_of(f"ghcr.io/fp8rl/worker:0.1.0@{DIGEST}") == "ghcr.io/fp8rl/worker"
    assert repository_of("localhost:5000/worker") == "localhost:5000/worker"
    assert repository_of("localhost:5000/worker:1") == "localhost:5000/worker"
