"""One tier per image: each Dockerfile installs one extra of pyproject.toml and copies the packages
its command loads, and the control plane and the operator carry no torch, Ray or transformers.

Checked three ways: from the files (the extras, the Dockerfiles' pip and COPY lines, an import walk
over the copied packages), and at run time, in a Python where everything the image leaves out
cannot be imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.docker import tiers
from tests.docker.dockerfile import (
    REPO,
    copies,
    dockerfile,
    exec_form,
    is_local,
    local_source,
    pip_installs,
)
from tests.docker.tiers import ALSO_RUNS, EXTRA, PACKAGES

# The commands of the worker image besides its CMD: those that run a job or read its results, and
# the benchmarks of the engines (`bench api` and `bench operator` need the other tiers)
WORKER_COMMANDS = ["run", "export", "report", "layer-diff"] + [
    f"bench {name}" for name in ("fp8", "rollout", "step", "sync", "mismatch", "gradients")
]
SERVICE_IMAGES = ("controlplane", "operator")
HEAVY = {"torch", "ray", "transformers"}  # what the service images must never carry
TIERS = ("controlplane", "operator", "worker")


def _names(requirements: list[Requirement]) -> set[str]:
    return {canonicalize_name(r.name) for r in requirements}


# --- pyproject.toml --------------------------------------------------------------------------


def test_dev_holds_every_tier() -> None:
    dev = _names(tiers.requirements(["dev"]))
    for tier in TIERS:
        missing = _names(tiers.requirements([tier])) - dev
        assert not missing, f"the dev extra lacks {sorted(missing)} of the {tier} extra"


def test_the_base_is_light() -> None:
    """What every tier installs: the contract and the CLI, none of the engines or servers."""
    base = _names(tiers.requirements())
    assert base == {"pydantic", "pyyaml", "typer", "rich", "httpx"}


@pytest.mark.parametrize("tier", SERVICE_IMAGES)
def test_service_extras_bring_no_torch_ray_or_transformers(tier: str) -> None:
    """Named directly, and nowhere among their dependencies' dependencies (the installed
    distributions' metadata; `pip install --dry-run --report` says the same from the index)."""
    assert not _names(tiers.requirements([tier])) & HEAVY
    brought = tiers.distributions(tiers.requirements([tier]))
    assert {"pydantic", "typer"} <= brought  # the walk does go through the base
    assert not brought & (HEAVY | {"numpy", "triton", "matplotlib"}), sorted(brought & HEAVY)


def test_the_worker_extra_brings_the_engines() -> None:
    """The counterpart of the test above, so that it cannot pass by reading nothing."""
    assert tiers.distributions(tiers.requirements(["worker"])) >= HEAVY


# --- the Dockerfiles -------------------------------------------------------------------------


def _source_installs(image: str) -> list[tuple[str, tuple[str, ...]]]:
    """(path, extras) of every local requirement the image pip-installs (wheels left out)."""
    return [
        local_source(r)
        for stage in dockerfile(image).stages
        for pip in pip_installs(stage)
        for r in pip.requirements
        if is_local(r) and not r.endswith(".whl")
    ]


@pytest.mark.parametrize("image", TIERS)
def test_the_image_installs_its_tier_extra_only(image: str) -> None:
    assert [extras for _, extras in _source_installs(image)] == [EXTRA[image]]


@pytest.mark.parametrize("image", SERVICE_IMAGES)
def test_no_pip_line_installs_torch_ray_or_transformers(image: str) -> None:
    for stage in dockerfile(image).stages:
        for pip in pip_installs(stage):
            named = {canonicalize_name(Requirement(r).name) for r in pip.requirements if not is_local(r)}
            assert not named & HEAVY, f"{image}.Dockerfile:{pip.line} installs {sorted(named & HEAVY)}"
            assert "download.pytorch.org" not in " ".join(pip.options), pip


def copied_packages(image: str) -> set[str]:
    """The first-party packages the image's COPY lines bring from the build context."""
    return {
        source
        for stage in dockerfile(image).stages
        for copy in copies(stage)
        if "from" not in copy.flags
        for source in copy.sources
        if source in tiers.FIRST_PARTY
    }


@pytest.mark.parametrize("image", TIERS)
def test_the_image_copies_its_tier_packages_only(image: str) -> None:
    assert copied_packages(image) == PACKAGES[image]


def image_walk(image: str) -> tiers.Walk:
    """What the image's command loads: ``fp8rl <subcommand>`` (the CLI and that command), plus
    the modules ALSO_RUNS names."""
    final = dockerfile(image).final
    argv = exec_form(final, "ENTRYPOINT") + exec_form(final, "CMD")
    assert argv[0] == "fp8rl", argv
    words = [a for a in argv[1:] if not a.startswith("-")]
    commands = words[:1] + (WORKER_COMMANDS if image == "worker" else [])
    return tiers.walk(["fp8rl.cli", *ALSO_RUNS[image]], commands)


@pytest.mark.parametrize("image", TIERS)
def test_the_copied_packages_are_closed_under_imports(image: str) -> None:
    loaded = image_walk(image)
    assert {"fp8rl.cli", "rljob.spec"} <= loaded.modules  # the walk went somewhere
    outside = [
        f"{i.module}:{i.line} imports {i.target}"
        for i in loaded.first_party
        if i.target.split(".")[0] not in PACKAGES[image]
    ]
    assert not outside, f"{image} image lacks what these import: {outside}"


@pytest.mark.parametrize("image", SERVICE_IMAGES)
def test_every_third_party_import_comes_with_the_extra(image: str) -> None:
    brought = tiers.distributions(tiers.requirements(list(EXTRA[image])))
    missing = [
        f"{i.module}:{i.line} imports {i.target}"
        for i in image_walk(image).third_party
        if not tiers.provided_by(i.target.split(".")[0]) & brought
    ]
    assert not missing, f"the {EXTRA[image]} extras do not bring: {missing}"


def test_the_walk_sees_lazy_and_dispatched_imports(tmp_path: Path) -> None:
    """The checker itself, on a tree made for it: a lazy import counts, a TYPE_CHECKING one does
    not, and in the CLI only the command the image runs counts."""
    (tmp_path / "fp8rl").mkdir()
    (tmp_path / "rljob").mkdir()
    (tmp_path / "fp8rl" / "__init__.py").write_text("")
    (tmp_path / "rljob" / "__init__.py").write_text("")
    (tmp_path / "fp8rl" / "cli.py").write_text(
        textwrap.dedent(
            """
            import typer
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from workers import hidden
            app = typer.Typer()

            @app.command("serve")
            def serve() -> None:
                from rljob.store import Store

            @app.command("run")
            def run() -> None:
                import workers.job.driver
            """
        )
    )
    (tmp_path / "rljob" / "store.py").write_text("def f():\n    import service.app\n\nStore = 1\n")
    serve = tiers.walk(["fp8rl.cli"], ["serve"], root=tmp_path)
    assert serve.modules == {"fp8rl", "fp8rl.cli", "rljob", "rljob.store", "service", "service.app"}
    assert [(i.module, i.target) for i in serve.first_party] == [
        ("fp8rl.cli", "rljob.store.Store"),
        ("rljob.store", "service.app"),
    ]
    assert [i.target for i in serve.third_party] == ["typer"]
    run = tiers.walk(["fp8rl.cli"], ["run"], root=tmp_path)
    assert "workers.job.driver" in run.modules and "rljob.store" not in run.modules
    with pytest.raises(AssertionError, match=r"defines the commands \['grade'\]"):
        tiers.walk(["fp8rl.cli"], ["run", "grade"], root=tmp_path)


# --- at run time -----------------------------------------------------------------------------

# Makes ``names`` unimportable, as in an image that lacks them (argv[1]: a JSON list).
HIDE = textwrap.dedent(
    """
    import json, sys

    class Absent:
        def __init__(self, names):
            self.names = set(names)

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.names:
                raise ModuleNotFoundError(f"No module named {name!r} (not in this image)", name=name)
            return None

    sys.meta_path.insert(0, Absent(json.loads(sys.argv[1])))
    for name in ("torch", "ray", "transformers"):
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"{name} is still importable: the test would prove nothing")
    """
)


def hidden_from(image: str) -> list[str]:
    """Everything the dev install has that the image does not: the other tiers' packages and
    the import names of the distributions its extra does not bring."""
    brought = tiers.distributions(tiers.requirements(list(EXTRA[image])))
    everything = tiers.distributions(tiers.requirements(["dev"]))
    names = tiers.import_names(everything - brought) | (set(tiers.FIRST_PARTY) - PACKAGES[image])
    assert names >= HEAVY and "numpy" in names
    return sorted(names)


def run_hidden(image: str, body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", HIDE + textwrap.dedent(body), json.dumps(hidden_from(image))],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_cli_helps_without_any_tier(tmp_path: Path) -> None:
    """``fp8rl --help`` and each image's command's help with the base's dependencies alone and no
    tier package but the contract (rljob)."""
    body = """
    from typer.testing import CliRunner
    from fp8rl.cli import app
    for argv in (["--help"], ["serve", "--help"], ["operator", "--help"], ["run", "--help"]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 0, (argv, result.output, result.exception)
    print("ok")
    """
    hidden = json.dumps(
        sorted(
            tiers.import_names(
                tiers.distributions(tiers.requirements(["dev"])) - tiers.distributions(tiers.requirements())
            )
            | {"workers", "service", "operators", "bench"}
        )
    )
    result = subprocess.run(
        [sys.executable, "-c", HIDE + textwrap.dedent(body), hidden],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


def test_the_operator_starts_without_the_other_tiers(tmp_path: Path) -> None:
    """``fp8rl operator`` up to kopf's run loop (stubbed: no API server here): its settings load,
    its handlers register for RLJobs."""
    (tmp_path / "operator.yaml").write_text("poll_seconds: 7\n")
    body = """
    import kopf
    from typer.testing import CliRunner
    from fp8rl.cli import app

    ran = {}
    kopf.run = lambda **kwargs: ran.update(kwargs)
    argv = ["operator", "--config=operator.yaml", "--liveness=http://0.0.0.0:8080/healthz", "-n", "team-a"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, (result.output, result.exception)
    assert ran["namespaces"] == ["team-a"] and ran["liveness_endpoint"].endswith("/healthz")
    handlers = ran["registry"]._changing.get_all_handlers()
    resources = {(h.selector.group, h.selector.any_name) for h in handlers}
    assert resources == {("fp8rl.io", "rljobs")}, resources
    import sys
    assert "torch" not in sys.modules and "workers" not in sys.modules
    print("ok", len(handlers))
    """
    result = run_hidden("operator", body, tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("ok "), result.stdout + result.stderr


def test_the_control_plane_serves_without_the_other_tiers(tmp_path: Path) -> None:
    """``fp8rl serve`` with either store, the server stubbed by an in-process client: the app is
    built, answers /healthz, and with the sql store authenticates and lists jobs."""
    (tmp_path / "tokens.yaml").write_text("a-token-of-sixteen-chars: team-a\n")
    (tmp_path / "kubeconfig").write_text(
        textwrap.dedent(
            """
            apiVersion: v1
            kind: Config
            clusters: [{name: c, cluster: {server: "http://127.0.0.1:9"}}]
            users: [{name: u, user: {token: t}}]
            contexts: [{name: x, context: {cluster: c, user: u}}]
            current-context: x
            """
        )
    )
    body = """
    import uvicorn
    from starlette.testclient import TestClient
    from typer.testing import CliRunner
    from fp8rl.cli import app

    seen = []

    def serve(application, **_):
        with TestClient(application) as client:
            seen.append(client.get("/healthz").status_code)
            seen.append(client.get("/v1/jobs").status_code)
            if store == "sql":  # the kubernetes store would call an API server, which is not here
                auth = {"Authorization": "Bearer a-token-of-sixteen-chars"}
                seen.append(client.get("/v1/jobs", headers=auth).status_code)

    uvicorn.run = serve
    for store in ("sql", "kubernetes"):
        argv = ["serve", "--store", store, "--data-dir", "data", "--tokens-file", "tokens.yaml"]
        if store == "kubernetes":
            argv += ["--kubeconfig", "kubeconfig"]
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 0, (store, result.output, result.exception)
    import sys
    assert "torch" not in sys.modules and "workers" not in sys.modules
    print("ok", seen)
    """
    result = run_hidden("controlplane", body, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # sql: healthy, 401 without a token, 200 with one; kubernetes: healthy, 401 without a token
    assert result.stdout.split("ok ", 1)[1].strip() == "[200, 401, 200, 200, 401]", result.stdout
