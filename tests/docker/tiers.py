"""What each image needs, read from the source: the first-party modules its command loads (an
import walk over the files with ``ast``), the third-party names those modules import, and the
distributions an extra of pyproject.toml brings (its requirements, followed through the installed
distributions' metadata).

The walk follows every import a module makes at run time, at module level or inside a function
(a lazy import is a dependency too), leaving out ``if TYPE_CHECKING:`` blocks. The dispatch
modules of the command line (:data:`DISPATCH`: ``fp8rl.cli``, ``fp8rl.bench_cli``, ...) are the
exception: each command imports its own tier lazily, so there only the module-level imports
count, plus those of the commands an image runs.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as metadata
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.docker.dockerfile import REPO

FIRST_PARTY = ("rljob", "workers", "service", "operators", "bench", "fp8rl")

# What each image is (stated here, independently of the Dockerfiles): the extra it installs, the
# packages it holds, and the modules it starts besides its ENTRYPOINT/CMD (KubeRay runs the driver
# in the worker image; the Makefile's gpu-check runs bench.gpu_check there).
# The worker image also serves the chart's controlPlane.store "sql", whose API pod runs the
# drivers itself: it holds the control plane's tier too.
EXTRA = {"controlplane": ("controlplane",), "operator": ("operator",), "worker": ("worker", "controlplane")}
PACKAGES = {
    "controlplane": {"fp8rl", "rljob", "service"},
    "operator": {"fp8rl", "rljob", "operators"},
    "worker": {"fp8rl", "rljob", "workers", "bench", "service"},
}
ALSO_RUNS: dict[str, list[str]] = {
    "controlplane": [],
    "operator": [],
    "worker": ["workers.job.driver", "bench.gpu_check", "service.main"],
}
# module: its Typer object; and the command group it holds ("bench fp8" is fp8 in fp8rl.bench_cli)
DISPATCH = {
    "fp8rl.cli": "app",
    "fp8rl.bench_cli": "bench_app",
    "fp8rl.bench_kernels_cli": "bench_app",  # more bench commands, on fp8rl.bench_cli's app
    "fp8rl.model_cli": "model_app",
    "fp8rl.data_cli": "data_app",
    "fp8rl.client_cli": "client_app",
}
GROUP = {
    "fp8rl.cli": "",
    "fp8rl.bench_cli": "bench",
    "fp8rl.bench_kernels_cli": "bench",
    "fp8rl.model_cli": "model",
    "fp8rl.data_cli": "data",
    "fp8rl.client_cli": "",  # its commands are at the top level
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    line: int
    target: str  # what it imports, dotted (``from a.b import c``: "a.b.c")


def module_file(module: str, root: Path = REPO) -> Path | None:
    """The source file of a first-party ``module`` (a package's ``__init__.py``), or None."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_in(nodes: Iterable[ast.stmt], module: str, top_level_only: bool) -> list[Import]:
    """The absolute imports in ``nodes``; with ``top_level_only`` not those inside functions or
    classes (a module-level ``if``/``try`` counts: it runs on import)."""
    out: list[Import] = []
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out += [Import(module, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [Import(module, node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        if top_level_only and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        stack.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
    return sorted(out, key=lambda i: (i.line, i.target))


def _command_function(tree: ast.Module, typer_object: str, command: str) -> ast.FunctionDef | None:
    """The function registered as ``@<typer_object>.command("<command>")`` (None: not here; a
    group's commands may be spread over several dispatch modules, :func:`walk` checks each is
    somewhere)."""
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if (
                isinstance(decorator, ast.Call)
                and isinstance(decorator.func, ast.Attribute)
                and decorator.func.attr == "command"
                and isinstance(decorator.func.value, ast.Name)
                and decorator.func.value.id == typer_object
                and decorator.args
                and isinstance(decorator.args[0], ast.Constant)
                and decorator.args[0].value == command
            ):
                return node
    return None


def imports_of(
    module: str, commands: Iterable[str] = (), root: Path = REPO, defined: set[str] | None = None
) -> list[Import]:
    """What ``module`` imports when it runs: every import, or for a dispatch module its
    module-level ones and those of ``commands`` ("operator", "bench api", ...) it defines (added
    to ``defined``)."""
    path = module_file(module, root)
    assert path is not None, module
    tree = ast.parse(path.read_text(), filename=str(path))
    if module not in DISPATCH:
        return _imports_in(tree.body, module, top_level_only=False)
    found = _imports_in(tree.body, module, top_level_only=True)
    for command in commands:
        group, _, name = command.rpartition(" ")
        if group != GROUP[module]:
            continue
        function = _command_function(tree, DISPATCH[module], name)
        if function is not None:
            found += _imports_in(function.body, module, top_level_only=False)
            if defined is not None:
                defined.add(command)
    return found


def _with_parents(module: str) -> list[str]:
    """Importing ``a.b.c`` runs ``a``, ``a.b`` and ``a.b.c``."""
    parts = module.split(".")
    return [".".join(parts[: n + 1]) for n in range(len(parts))]


@dataclass
class Walk:
    modules: set[str]  # first-party modules loaded
    first_party: list[Import]  # every first-party import seen (to check against the image's packages)
    third_party: list[Import]  # every third-party import seen (top-level name in ``target``)


def walk(entries: Iterable[str], commands: Iterable[str] = (), root: Path = REPO) -> Walk:
    """The first-party modules ``entries`` load, following imports from module to module (see
    the module docstring for which imports count); every one of ``commands`` must be defined by a
    dispatch module they load."""
    commands = tuple(commands)
    result, defined = Walk(set(), [], []), set[str]()
    todo = [m for entry in entries for m in _with_parents(entry)]
    while todo:
        module = todo.pop()
        if module in result.modules:
            continue
        result.modules.add(module)
        if module_file(module, root) is None:  # a package absent from this tree: reported, not read
            continue
        for imp in imports_of(module, commands, root, defined):
            top = imp.target.split(".")[0]
            if top == "__future__" or top in sys.stdlib_module_names:
                continue
            if top not in FIRST_PARTY:
                result.third_party.append(imp)
                continue
            result.first_party.append(imp)
            todo += _with_parents(_loaded(imp.target, root))
    missing = sorted(set(commands) - defined)
    assert not missing, f"no dispatch module loaded defines the commands {missing}"
    return result


def _loaded(target: str, root: Path) -> str:
    """The module an import of ``target`` runs: ``from a.b import c`` runs ``a.b.c`` when that is
    a submodule, else ``a.b`` (c is a name in it)."""
    parent = target.rpartition(".")[0]
    if module_file(target, root) is None and parent and module_file(parent, root) is not None:
        return parent
    return target


# --- pyproject.toml's extras -----------------------------------------------------------------


@functools.cache
def project() -> dict[str, object]:
    meta: dict[str, object] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return meta


def requirements(extras: Iterable[str] = ()) -> list[Requirement]:
    """The base dependencies and those of ``extras``, the project's own extras (``fp8rl[a,b]``)
    expanded."""
    meta = project()
    name = canonicalize_name(str(meta["name"]))
    optional: dict[str, list[str]] = meta["optional-dependencies"]  # type: ignore[assignment]
    out = [Requirement(r) for r in meta["dependencies"]]  # type: ignore[attr-defined]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in optional[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == name:
                todo += sorted(req.extras)
            else:
                out.append(req)
    return out


def _applies(req: Requirement, extras: Iterable[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": extra}) for extra in (*extras, ""))


def distributions(requirements: Iterable[Requirement]) -> set[str]:
    """Every distribution ``requirements`` bring, through the installed distributions' metadata
    (canonical names). A requirement that applies here but is not installed is an error: the
    answer would be incomplete."""
    found: set[str] = set()
    todo = [r for r in requirements if _applies(r, ())]
    while todo:
        req = todo.pop()
        key = canonicalize_name(req.name) + "[" + ",".join(sorted(req.extras)) + "]"
        if key in found:
            continue
        found.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError as err:
            raise AssertionError(f"{req} is required but not installed: pip install -e '.[dev]'") from err
        todo += [sub for sub in map(Requirement, dist.requires or []) if _applies(sub, req.extras)]
    return {key.partition("[")[0] for key in found}


@functools.cache
def _providers() -> dict[str, frozenset[str]]:
    """{top-level import name: the installed distributions that provide it} (canonical names)."""
    return {
        name: frozenset(canonicalize_name(d) for d in dists)
        for name, dists in metadata.packages_distributions().items()
    }


def provided_by(top_level: str) -> set[str]:
    """The installed distributions that provide import name ``top_level``."""
    return set(_providers().get(top_level, ()))


def import_names(dists: set[str]) -> set[str]:
    """The top-level import names that only ``dists`` provide (among the installed ones)."""
    return {
        name
        for name, providers in _providers().items()
        if providers and providers <= dists and name.isidentifier()
    }
