"""The real tools the chart tests run: helm, promtool, prometheus and node with the Prometheus
Operator's schemas. ``make tools`` (``.ci/tools``) puts them in ``.tools/`` when they are not on PATH; a
missing tool fails the test that needs it, saying how to get it (never a skip)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "fp8rl"
TOOLS = ROOT / ".tools"
NODE_MODULES = TOOLS / "node" / "node_modules"
MONITORING_VALIDATOR = Path(__file__).with_name("validate_monitoring.mjs")


def tool(name: str) -> str:
    """The path of ``name``: on PATH, else in .tools/bin; fails the test when neither."""
    found = shutil.which(name) or shutil.which(name, path=str(TOOLS / "bin"))
    if found is None:
        pytest.fail(f"{name} not found on PATH or in .tools/bin: run `make tools` (.ci/tools)", pytrace=False)
    return found


def run(cmd: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120, check=False)


def render(
    *args: str, values: dict[str, Any] | None = None, namespace: str = "fp8rl-system"
) -> list[dict[str, Any]]:
    """``helm template`` of the chart (release "fp8rl") as a list of objects; ``args`` go to helm
    (``-f file``, ``--api-versions ...``), ``values`` as a values file. Fails on a helm error."""
    done = _template(["--namespace", namespace, *args], values)
    assert done.returncode == 0, f"helm template {' '.join(args)} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render_error(*args: str, values: dict[str, Any] | None = None) -> str:
    """The error helm prints for a rendering that must fail."""
    done = _template(list(args), values)
    assert done.returncode != 0, f"helm template {' '.join(args)} should have failed"
    return done.stderr


# ``helm template`` has no cluster to keep generated tokens in and refuses to mint them
# (controlplane-secret.yaml): renders name tokens unless a test's values say otherwise
OFFLINE_AUTH = {"tokens": {"a-token-for-offline-renders": "default"}}


def _template(args: list[str], values: dict[str, Any] | None) -> subprocess.CompletedProcess[str]:
    cmd = [tool("helm"), "template", "fp8rl", str(CHART), *args]
    # after ``args``: a values file's auth.existingSecret (the GPU example's) is kept, and wins
    chosen = {"auth": OFFLINE_AUTH, **(values or {})}
    return run([*cmd, "--values", "-"], yaml.safe_dump(chosen))


def validate_monitoring(objects: list[dict[str, Any]]) -> list[str]:
    """Problems of monitoring.coreos.com objects against the Prometheus Operator's schemas."""
    if not NODE_MODULES.joinpath("@kubernetes-models", "prometheus-operator").is_dir():
        pytest.fail(
            "the Prometheus Operator schemas are missing from .tools/node: run `make tools`", pytrace=False
        )
    done = run([tool("node"), str(MONITORING_VALIDATOR), str(NODE_MODULES)], json.dumps(objects))
    assert done.returncode == 0, done.stderr
    problems: list[str] = json.loads(done.stdout)
    return problems


def by_kind(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        out.setdefault(obj["kind"], []).append(obj)
    return out
