"""The ``fp8rl`` program names the extra to install when a command's tier is missing (an image
holds one tier: docker/README.md)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fp8rl.entry import tiers_of

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("module", "tiers"),
    [
        # pyproject.toml: torch and reasoning-gym are the worker's, kopf the operator's, fastapi
        # the control plane's; the Kubernetes client is in both service tiers
        ("torch", ["worker"]),
        ("reasoning_gym", ["worker"]),
        ("kopf", ["operator"]),
        ("fastapi", ["controlplane"]),
        ("kubernetes", ["controlplane", "operator"]),
        ("workers", ["worker"]),
        ("operators", ["operator"]),
        ("vllm", []),  # the gpu and engines-cpu extras are not tiers
        ("pytest", []),  # dev only
        ("no_such_module", []),
    ],
)
def test_tiers_of(module: str, tiers: list[str]) -> None:
    assert sorted(tiers_of(module)) == sorted(tiers)


# a Python without the worker tier's packages, running the fp8rl program
WITHOUT_WORKERS = textwrap.dedent(
    """
    import sys

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {"workers", "torch", "ray", "transformers"}:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Absent())
    sys.argv = ["fp8rl", *sys.argv[1:]]
    from fp8rl.entry import main

    main()
    """
)


def test_a_command_of_a_missing_tier_says_what_to_install(tmp_path: Path) -> None:
    spec = REPO / "examples" / "arithmetic-cpu.yaml"
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_WORKERS, "run", str(spec), "--output", str(tmp_path / "run")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "pip install 'fp8rl[worker]'" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_the_other_commands_still_run(tmp_path: Path) -> None:
    """Without the worker tier, the commands of the other tiers are as they were."""
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_WORKERS, "operator", "--config", str(tmp_path / "absent.yaml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "error: operator config" in result.stderr, result.stderr
