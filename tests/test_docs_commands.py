"""Every ``fp8rl ...`` command the docs show exists, with the options they give it.

The docs (README.md and docs/*.md) show commands in two places:

- fenced shell blocks (```bash, ```sh, ```shell, ```console; in an unlabelled fence only a line
  with a ``$ `` prompt), where a line ending in ``\\`` continues on the next and ``#`` starts a
  comment;
- inline code in prose (`` `fp8rl bench step --model smollm2` ``), which may wrap onto the next line.

A command starts where ``fp8rl`` (or ``path/to/fp8rl``) stands at a command position: at the
start, after ``;``, ``&&``, ``|``, ``(`` or ``$(``, past ``VAR=value`` assignments. So ``helm
install fp8rl helm/fp8rl`` and "the ``fp8rl`` command line" are not commands. It ends at ``;``,
``&&``, ``||``, a pipe or a background ``&`` set apart by spaces.

Words after ``fp8rl`` name subcommands while the command reached is a group (``fp8rl``, ``fp8rl
bench``, ``fp8rl model``). A placeholder there (``SPEC``, ``<name>``, ``...``, ``$VAR``) leaves the
command unknown and nothing after it is checked; ``a|b|c`` is a list of alternatives, each of which
must be a subcommand. Past the last subcommand every word that starts with ``-`` is an option
(``--set=x`` is ``--set``; ``[--device auto|cpu|cuda]`` is ``--device``; ``--a|--b`` is both) and
must appear in the options table of that command's ``--help`` (an option its help's prose merely
mentions does not count). Each command's help is rendered once, in process, with typer's test
runner on ``fp8rl.cli.app``; which words are subcommands is read from the same app's click tree.
"""

from __future__ import annotations

import functools
import re
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
import typer.main
from pydantic import BaseModel
from typer.testing import CliRunner

from fp8rl.cli import app
from rljob.spec import JobSpec

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
# `fp8rl` at a command position, past a `$ ` prompt and `VAR=value` assignments
START = re.compile(r"(?:^|(?<=[;&|(]))\s*(?:\$\s+)?(?:[A-Za-z_]\w*=\S*\s+)*(?:[\w.~/-]*/)?fp8rl(?=\s|$)")
# where a command ends: `;`, `&&`, `||`, or a pipe / background `&` with spaces around it
END = re.compile(r";|&&|\|\||(?<=\s)[|&](?=\s|$)")
PLACEHOLDER = re.compile(r"^$|\.\.\.|[<>{}$]|^[A-Z][A-Z0-9_]*(?:\.\w+)?$")
HELP_ENV = {"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"}


@dataclass(frozen=True)
class Word:
    text: str
    line: int


@dataclass(frozen=True)
class Usage:
    """One ``fp8rl`` command as a doc shows it: the words after ``fp8rl``, each with its line."""

    file: str
    line: int
    words: tuple[Word, ...]

    def shown(self) -> str:
        return " ".join(["fp8rl", *(w.text for w in self.words)])


def _clean(word: str) -> str:
    """A word without the brackets, quotes and parentheses docs wrap around it."""
    return word.strip("[]()\"'`,")


def commands_in(text: str, file: str, first_line: int) -> Iterator[Usage]:
    """The ``fp8rl`` commands of one shell command line or code span that starts on ``first_line``
    (continuation newlines kept, so that each word knows its line)."""
    for start in START.finditer(text):
        rest_at = start.end()
        end = END.search(text, rest_at)
        rest = text[rest_at : end.start() if end else len(text)]
        words = tuple(
            Word(m.group(0), first_line + text.count("\n", 0, rest_at + m.start()))
            for m in re.finditer(r"\S+", rest)
        )
        yield Usage(file, first_line + text.count("\n", 0, start.start()), words)


def _strip_comment(line: str) -> str:
    return re.sub(r"(^|\s)#.*$", "", line)


def _shell_commands(lines: list[tuple[int, str]], file: str) -> Iterator[Usage]:
    """Commands of a fenced shell block: ``\\``-continued lines joined, comments dropped."""
    pending: list[str] = []
    first = 0
    for number, raw in lines:
        line = _strip_comment(raw)
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending.append(line.rstrip()[:-1])
            continue
        pending.append(line)
        yield from commands_in("\n".join(pending), file, first)
        pending = []
    if pending:
        yield from commands_in("\n".join(pending), file, first)


def _inline_commands(paragraph: list[tuple[int, str]], file: str) -> Iterator[Usage]:
    """Commands in the code spans of one prose paragraph (a span may wrap onto the next line)."""
    if not paragraph:
        return
    text = "\n".join(line for _, line in paragraph)
    for span in re.finditer(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.DOTALL):
        line = paragraph[0][0] + text.count("\n", 0, span.start(2))
        yield from commands_in(span.group(2), file, line)


def doc_commands(markdown: str, file: str) -> list[Usage]:
    """Every ``fp8rl`` command that ``markdown`` shows (in shell fences and in inline code)."""
    found: list[Usage] = []
    fence: str | None = None
    block: list[tuple[int, str]] = []
    paragraph: list[tuple[int, str]] = []
    for number, line in enumerate(markdown.splitlines(), 1):
        opening = FENCE.match(line)
        if fence is None and opening:
            found += _inline_commands(paragraph, file)
            paragraph, fence, block = [], opening.group(2).lower(), []
        elif fence is not None and opening and not opening.group(2):
            if fence in SHELL_LANGS:
                found += _shell_commands(block, file)
            elif fence == "":
                prompts = [(n, re.sub(r"^\s*\$\s+", "", t)) for n, t in block if re.match(r"\s*\$\s", t)]
                found += _shell_commands(prompts, file)
            fence = None
        elif fence is not None:
            block.append((number, line))
        elif line.strip():
            paragraph.append((number, line))
        else:
            found += _inline_commands(paragraph, file)
            paragraph = []
    found += _inline_commands(paragraph, file)
    return found


Tree = dict[str, "Tree"]  # subcommand name -> its subcommands (empty: a command, not a group)


@functools.cache
def command_tree() -> Tree:
    """The subcommands of ``fp8rl``, read from the app's click tree (typer's ``TyperGroup``)."""

    def tree(command: object) -> Tree:
        return {name: tree(sub) for name, sub in getattr(command, "commands", {}).items()}

    return tree(typer.main.get_command(app))


@functools.cache
def help_text(path: tuple[str, ...]) -> str:
    """``fp8rl <path> --help``, rendered in process and wide enough that no option wraps."""
    result = CliRunner().invoke(app, [*path, "--help"], env=HELP_ENV)
    assert result.exit_code == 0, f"fp8rl {' '.join(path)} --help: exit {result.exit_code}\n{result.output}"
    return result.output


# a row of the options table: its leading option names (rich: "│ *  --out  -o  <path>  ...";
# plain click: "  -o, --out PATH  ..."); wrapped description lines start with words, not dashes
OPTION_ROW = re.compile(r"^[│|\s]*\*?\s*((?:--?[A-Za-z][\w-]*[,\s]+)+)")


@functools.cache
def help_options(path: tuple[str, ...]) -> frozenset[str]:
    """The option names that ``fp8rl <path> --help`` lists in its options table (not those its
    prose happens to mention)."""
    names: set[str] = set()
    in_options = False
    for line in help_text(path).splitlines():
        if heading := re.match(r"^(?:╭─)?\s*(\w[\w ]*?)(?::|\s*─)", line):  # a panel or section
            in_options = heading.group(1) == "Options"
        elif in_options and (row := OPTION_ROW.match(line)):
            names.update(re.findall(r"--?[A-Za-z][\w-]*", row.group(1)))
    assert "--help" in names, f"no options table read from fp8rl {' '.join(path)} --help"
    return frozenset(names)


def set_key_problem(key: str) -> str | None:
    """Why ``--set KEY=...`` names no field of the job spec (read from its pydantic models), or
    None. A placeholder key is not checked; below a mapping field (``task.params``) any key goes."""
    if not key or PLACEHOLDER.search(key) or key.startswith("$"):
        return None
    model: Any = JobSpec
    parts = key.split(".")
    for depth, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            known = ", ".join(sorted(fields))
            return f"{key}: the spec has no field {'.'.join(parts[: depth + 1])} (there: {known})"
        nested = _models_in(fields[part].annotation)
        if depth == len(parts) - 1:
            return None
        if _is_mapping(fields[part].annotation):
            return None
        if not nested:
            return f"{key}: {'.'.join(parts[: depth + 1])} is a value, with no fields below it"
        model = nested[0]
    return None


def _models_in(annotation: Any) -> list[Any]:
    """The pydantic models an annotation names (through Optional, unions, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _is_mapping(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (dict, Mapping) or annotation is dict:
        return True
    return any(_is_mapping(arg) for arg in typing.get_args(annotation))


def _named(path: tuple[str, ...], name: str | None = None) -> str:
    return "`" + " ".join(["fp8rl", *path, *([name] if name else [])]) + "`"


def problems(usage: Usage) -> list[str]:
    """What is wrong with one command a doc shows, as ``file:line: ...`` lines (none: all exist)."""
    where = f"`{usage.shown()}`"
    found: list[str] = []
    group = command_tree()
    path: tuple[str, ...] = ()
    words = list(usage.words)
    while words and group and not _clean(words[0].text).startswith("-"):
        word = words.pop(0)
        name = _clean(word.text)
        if "|" in name:  # alternatives, each a subcommand; which one the options belong to is open
            unknown = [c for c in name.split("|") if not PLACEHOLDER.search(c) and c not in group]
            return [
                f"{usage.file}:{word.line}: unknown command {_named(path, c)} in {where}" for c in unknown
            ]
        if PLACEHOLDER.search(name):
            return found  # the command is left open: nothing after it can be checked
        if name not in group:
            return [f"{usage.file}:{word.line}: unknown command {_named(path, name)} in {where}"]
        group, path = group[name], (*path, name)
    for i, word in enumerate(words):
        text = _clean(word.text)
        if text.startswith("--set") and "--set" in help_options(path):
            value = (
                text.split("=", 1)[1]
                if "=" in text
                else _clean(words[i + 1].text)
                if i + 1 < len(words)
                else ""
            )
            if why := set_key_problem(value.split("=", 1)[0]):
                found.append(f"{usage.file}:{word.line}: --set {why} in {where}")
        for part in text.split("|"):
            option = part.split("=", 1)[0]
            if not re.fullmatch(r"--?[A-Za-z][\w-]*", option):
                continue  # a value, a placeholder, `--`, a negative number
            if option not in help_options(path):
                found.append(
                    f"{usage.file}:{word.line}: {_named(path)} has no option {option} "
                    f"(not in its --help) in {where}"
                )
    return found


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# how scripts and the Makefile spell the command: `$(VENV)/bin/fp8rl`, `$py -m fp8rl.cli`
SCRIPT_SPELLINGS = re.compile(r"\$\(VENV\)/bin/fp8rl\b|(?:\$\(PY\)|\$\{?py\}?|python3?) -m fp8rl(?:\.cli)?\b")


def script_commands(text: str, file: str) -> list[Usage]:
    """The ``fp8rl`` commands of a shell script or a Makefile: every line is shell (Make's ``$$``
    is the shell's ``$``), ``\\`` continues a line and ``#`` starts a comment."""
    lines = [
        (n, SCRIPT_SPELLINGS.sub("fp8rl", line.replace("$$", "$")))
        for n, line in enumerate(text.splitlines(), 1)
    ]
    return list(_shell_commands(lines, file))


def comment_commands(text: str, file: str) -> list[Usage]:
    """The ``fp8rl`` commands in a YAML file's comments: a comment indented past ``#`` (``#   fp8rl
    run ...``) is a shell line; the others are prose, whose code spans are read."""
    shell: list[tuple[int, str]] = []
    paragraphs: list[list[tuple[int, str]]] = [[]]  # prose: runs of consecutive comment lines
    for number, line in enumerate(text.splitlines(), 1):
        comment = re.match(r"\s*#(.*)$", line)
        body = comment.group(1) if comment else ""
        if comment and re.match(r"\s{2,}\S", body):
            shell.append((number, body))
        if not comment or re.match(r"\s{2,}\S", body):
            paragraphs.append([])
        else:
            paragraphs[-1].append((number, body))
    return [*_shell_commands(shell, file), *(u for p in paragraphs for u in _inline_commands(p, file))]


def all_usages() -> list[Usage]:
    """Every command the docs, the examples' comments, the Makefile and the GPU session show."""
    usages = [u for p in doc_files() for u in doc_commands(p.read_text(), str(p.relative_to(ROOT)))]
    for path in (ROOT / "Makefile", ROOT / "bench" / "gpu_session.sh"):
        usages += script_commands(path.read_text(), str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        usages += comment_commands(path.read_text(), str(path.relative_to(ROOT)))
    return usages


def test_every_command_the_docs_show_exists_with_its_options() -> None:
    usages = all_usages()
    # the scan sees the docs' commands at all (the README alone shows a dozen)
    assert len(usages) > 50, f"only {len(usages)} fp8rl commands found: is the scanner blind?"
    files = {u.file for u in usages}
    assert {"Makefile", "bench/gpu_session.sh", "examples/smollm2-addition.yaml"} <= files, files
    found = [line for usage in usages for line in problems(usage)]
    assert not found, "commands or options the docs show that fp8rl lacks:\n" + "\n".join(found)


# The scanner and checker themselves, on markdown written for them.

FAKE_DOC = """\
# A page

Prose: the `fp8rl` command line; `fp8rl bench step --quick` runs it
fast, and `fp8rl bench
step --model 100m` wraps.

```bash
make run   # installs fp8rl first
helm install fp8rl helm/fp8rl -f values.yaml
fp8rl run SPEC --recipe bf16|fp8-gen \\
    --seed S --no-such-flag   # fp8rl bench api --comment-only
dir=$(fp8rl model fetch NAME | tail -1); fp8rl bench nonsuch --x
FOO=1 .venv/bin/fp8rl bench fp8 --shapes quick --device=cuda &
```

```
$ fp8rl bench fp8 --fast
fp8rl bench fp8 --output-only: printed by the command, no prompt
```

```mermaid
fp8rl --> bench
```

`fp8rl bench ...`, `fp8rl model import <file> --name x`, `fp8rl bench fp8|step|nope`,
`fp8rl serve [--store sql|kubernetes] [--port 8000]`.
"""


def test_the_scanner_finds_commands_where_docs_show_them() -> None:
    shown = [(u.line, u.shown()) for u in doc_commands(FAKE_DOC, "fake.md")]
    assert shown == [
        (3, "fp8rl"),
        (3, "fp8rl bench step --quick"),
        (4, "fp8rl bench step --model 100m"),
        (10, "fp8rl run SPEC --recipe bf16|fp8-gen --seed S --no-such-flag"),
        (12, "fp8rl model fetch NAME"),
        (12, "fp8rl bench nonsuch --x"),
        (13, "fp8rl bench fp8 --shapes quick --device=cuda"),
        (17, "fp8rl bench fp8 --fast"),
        (25, "fp8rl bench ..."),
        (25, "fp8rl model import <file> --name x"),
        (25, "fp8rl bench fp8|step|nope"),
        (26, "fp8rl serve [--store sql|kubernetes] [--port 8000]"),
    ]


def test_the_checker_flags_unknown_options_and_commands_with_file_and_line() -> None:
    found = [line for usage in doc_commands(FAKE_DOC, "fake.md") for line in problems(usage)]
    assert found == [
        "fake.md:3: `fp8rl bench step` has no option --quick (not in its --help)"
        " in `fp8rl bench step --quick`",
        "fake.md:11: `fp8rl run` has no option --no-such-flag (not in its --help)"
        " in `fp8rl run SPEC --recipe bf16|fp8-gen --seed S --no-such-flag`",
        "fake.md:12: unknown command `fp8rl bench nonsuch` in `fp8rl bench nonsuch --x`",
        "fake.md:17: `fp8rl bench fp8` has no option --fast (not in its --help) in `fp8rl bench fp8 --fast`",
        "fake.md:25: unknown command `fp8rl bench nope` in `fp8rl bench fp8|step|nope`",
    ]


def test_the_readme_table_line_of_issue_42_would_fail() -> None:
    """The README's GPU table once cited `bench step --quick`, an option `bench step` never had."""
    row = "| RL step fp8-e2e / bf16 (100M, `fp8rl bench step --quick`) | >= 1.2x | 0.48x |\n"
    assert [line for u in doc_commands(row, "README.md") for line in problems(u)] == [
        "README.md:1: `fp8rl bench step` has no option --quick (not in its --help)"
        " in `fp8rl bench step --quick`"
    ]


def test_scripts_makefiles_and_example_comments_are_read_and_set_keys_checked() -> None:
    makefile = (
        "run: $(STAMP)\n"
        "\t$(VENV)/bin/fp8rl run x.yaml --recipe $(RECIPE) --set precision.fp8_kv_cache=true \\\n"
        "\t  --set precision.kv_cache=true --nope  # fp8rl bench gone\n"
        "\tout=$$($(VENV)/bin/fp8rl model fetch smollm2)\n"
    )
    script = 'py=python\n$py -m fp8rl.cli bench step --steps 1 --set-nothing >"$dir/x.txt"\n'
    example = (
        "# Run it:\n"
        "#   fp8rl run examples/x.yaml --set rollout.group_size=4 --set rollout.size=2\n"
        "# or pass `fp8rl run x.yaml --set task.params.min_value=1 --set steps.total=3` and the\n"
        "# fp8rl service runs it too.\n"
        "model: {name: x}  # fp8rl run --not-a-comment-command\n"
    )
    usages = [
        *script_commands(makefile, "Makefile"),
        *script_commands(script, "gpu.sh"),
        *comment_commands(example, "ex.yaml"),
    ]
    assert [(u.file, u.line, u.shown()) for u in usages] == [
        ("Makefile", 2, "fp8rl run x.yaml --recipe $(RECIPE) --set precision.fp8_kv_cache=true "
                        "--set precision.kv_cache=true --nope"),
        ("Makefile", 4, "fp8rl model fetch smollm2)"),
        ("gpu.sh", 2, 'fp8rl bench step --steps 1 --set-nothing >"$dir/x.txt"'),
        ("ex.yaml", 2, "fp8rl run examples/x.yaml --set rollout.group_size=4 --set rollout.size=2"),
        ("ex.yaml", 3, "fp8rl run x.yaml --set task.params.min_value=1 --set steps.total=3"),
    ]  # fmt: skip
    found = [line for u in usages for line in problems(u)]
    assert [line.split(" in `")[0] for line in found] == [
        "Makefile:3: --set precision.kv_cache: the spec has no field precision.kv_cache"
        " (there: bf16_layers, exact, fp8_format, fp8_kv_cache, fp8_kv_cache_in_training, keep_bf16_layers,"
        " kv_calibration_sequences, master_dtype, mismatch_slo, power_of_two_scales, recipe)",
        "Makefile:3: `fp8rl run` has no option --nope (not in its --help)",
        "gpu.sh:2: `fp8rl bench step` has no option --set-nothing (not in its --help)",
        f"ex.yaml:2: --set rollout.size: the spec has no field rollout.size (there: "
        f"{', '.join(sorted(_models_in(JobSpec.model_fields['rollout'].annotation)[0].model_fields))})",
        "ex.yaml:3: --set steps.total: steps is a value, with no fields below it",
    ]
