"""A small Dockerfile reader for the image tests (no Docker engine here): stages and their
instructions, ARG defaults, the WORKDIR each instruction runs in, COPY/ADD, the ``pip install``
commands inside RUN, and the ``.dockerignore`` matcher that decides what the build context holds.
"""

from __future__ import annotations

import functools
import json
import posixpath
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"


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

    def all(self, keyword: str) -> list[Instruction]:
        """The stage's instructions with ``keyword``, in order."""
        return [ins for ins in self.instructions if ins.keyword == keyword]

    def walk(self) -> Iterator[tuple[str, Instruction]]:
        """Each instruction with the WORKDIR it runs in (ARGs expanded; "/" until the first)."""
        workdir = "/"
        for ins in self.instructions:
            if ins.keyword == "WORKDIR":
                workdir = posixpath.join(workdir, expand(ins.args, self.args))
            yield workdir, ins


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
    found = stage.all(keyword)
    if not found:
        return []
    value = json.loads(found[-1].args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), found[-1]
    return value


def env(stage: Stage) -> dict[str, str]:
    """The stage's ENV, later values winning."""
    out: dict[str, str] = {}
    for ins in stage.all("ENV"):
        for word in shlex.split(ins.args):
            key, _, value = word.partition("=")
            out[key] = value
    return out


def exposed(stage: Stage) -> set[int]:
    return {int(p.split("/")[0]) for ins in stage.all("EXPOSE") for p in ins.args.split()}


def run_text(stage: Stage) -> str:
    """Every RUN command of ``stage``, joined: what a search for a command is made in."""
    return " ".join(ins.args for ins in stage.all("RUN"))


@dataclass(frozen=True)
class Copy:
    line: int
    workdir: str
    flags: dict[str, str]  # --from=..., --chown=...
    sources: tuple[str, ...]
    dest: str

    def targets(self) -> dict[str, str]:
        """{path in the image: source}, by COPY's rules: into a directory when the destination
        ends with "/" or there are several sources, else to the destination itself."""
        dest = posixpath.join(self.workdir, self.dest)
        if dest.endswith("/") or len(self.sources) > 1:
            return {posixpath.normpath(posixpath.join(dest, posixpath.basename(s))): s for s in self.sources}
        return {posixpath.normpath(dest): self.sources[0]}


def copies(stage: Stage) -> list[Copy]:
    """The stage's COPY and ADD instructions, ARGs expanded."""
    out: list[Copy] = []
    for workdir, ins in stage.walk():
        if ins.keyword in ("COPY", "ADD"):
            flags, words = flags_and_words(expand(ins.args, stage.args))
            assert len(words) >= 2, f"line {ins.line}: {ins.keyword} {ins.args}"
            out.append(Copy(ins.line, workdir, flags, tuple(words[:-1]), words[-1]))
    return out


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
    for workdir, ins in stage.walk():
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


def local_source(requirement: str) -> tuple[str, tuple[str, ...]]:
    """A local requirement's path and extras: ``.[operator]`` -> (".", ("operator",))."""
    path, bracket, rest = requirement.partition("[")
    if not bracket:
        return requirement, ()
    assert rest.endswith("]"), requirement
    return path, tuple(e.strip() for e in rest[:-1].split(","))


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
