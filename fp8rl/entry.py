"""The ``fp8rl`` program: the command line, and what to install when a command's tier is missing.

An installation holds the tiers it was installed with (``pip install 'fp8rl[operator]'``, or an
image that copies only its own packages), and each command imports its tier when it runs. A
command of a tier that is not there ends in one line that names the extra to install instead of an
import traceback.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re

import typer

# the extra that brings each first-party package's dependencies (the package itself comes with
# any install from the source; an image leaves out those of other tiers)
PACKAGE_TIER = {"workers": "worker", "service": "controlplane", "operators": "operator", "bench": "dev"}
TIER_EXTRAS = ("worker", "controlplane", "operator")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def tiers_of(module: str) -> list[str]:
    """The extras that provide top-level ``module``: from the table above for fp8rl's own
    packages, else from the installed distribution's requirements (``torch; extra == "worker"``);
    empty when no tier's extra names it."""
    if module in PACKAGE_TIER:
        return [PACKAGE_TIER[module]]
    try:
        requirements = metadata.requires("fp8rl") or []
    except metadata.PackageNotFoundError:
        return []
    found: list[str] = []
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", requirement)
        if not (name and extra and extra.group(1) in TIER_EXTRAS):
            continue
        if _canonical(name.group(0)) == _canonical(module) and extra.group(1) not in found:
            found.append(extra.group(1))
    return found


def main() -> None:
    from fp8rl.cli import app

    try:
        app()
    except ModuleNotFoundError as err:
        tiers = tiers_of((err.name or "").partition(".")[0])
        if not tiers:
            raise
        install = " or ".join(f"pip install 'fp8rl[{tier}]'" for tier in tiers)
        typer.echo(
            f"error: this command needs a tier of fp8rl that this installation lacks ({err}): {install}",
            err=True,
        )
        raise SystemExit(2) from err
