"""The tiers import only downward (docs/architecture.md):

    rljob  <  workers  <  service | operators  <  bench  <  fp8rl

A module may import its own package and the packages on lower floors; ``service`` and
``operators`` share a floor and never import each other. Every import counts: module level,
inside a function, and ``TYPE_CHECKING`` blocks alike, since a lazy import is a dependency too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"rljob": 0, "workers": 1, "service": 2, "operators": 2, "bench": 3, "fp8rl": 4}


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}:{node.lineno}: relative import; the project uses absolute ones")
    return out


def violations(root: Path) -> list[str]:
    found = []
    for package, floor in FLOORS.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, target in imported_packages(path):
                if target not in FLOORS or target == package:
                    continue
                if FLOORS[target] >= floor:
                    way = "sideways" if FLOORS[target] == floor else "upward"
                    found.append(f"{path.relative_to(root)}:{line} imports {target} ({way})")
    return found


def test_every_import_goes_down_a_floor() -> None:
    assert violations(ROOT) == []


def made_tree(root: Path, files: dict[str, str]) -> Path:
    """A tree of the project's packages under ``root`` holding ``files`` (path -> source), for
    the checkers' own tests."""
    for package in FLOORS:
        (root / package).mkdir()
    for name, source in files.items():
        (root / name).write_text(source)
    return root


def test_the_check_sees_an_upward_a_sideways_and_a_lazy_import(tmp_path: Path) -> None:
    """The checker itself, on a tree made for it: each kind of wrong import is caught, with its
    file and line; downward and same-package imports pass."""
    made_tree(
        tmp_path,
        {
            "rljob/a.py": "import rljob.b\nfrom workers import x\n",
            "service/s.py": "from rljob import a\n\ndef f():\n    import operators.o\n",
            "workers/w.py": "from rljob.a import b\nimport torch\n",
            "fp8rl/c.py": "from bench import y\nfrom service import s\n",
        },
    )
    assert violations(tmp_path) == [
        "rljob/a.py:2 imports workers (upward)",
        "service/s.py:4 imports operators (sideways)",
    ]
    (tmp_path / "bench" / "r.py").write_text("from . import y\n")
    with pytest.raises(AssertionError, match="relative import"):
        violations(tmp_path)


def module_imports(root: Path) -> dict[str, list[tuple[int, str, list[str]]]]:
    """Project module -> (line, imported project module, names taken) of each of its imports, at
    any level. ``from pkg import mod`` counts as importing ``pkg.mod`` when that is a module."""
    modules = {}
    for package in FLOORS:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    out: dict[str, list[tuple[int, str, list[str]]]] = {}
    for name, path in modules.items():
        edges: list[tuple[int, str, list[str]]] = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges += [(node.lineno, a.name, []) for a in node.names if a.name in modules]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                taken = []
                for a in node.names:
                    if f"{node.module}.{a.name}" in modules:
                        edges.append((node.lineno, f"{node.module}.{a.name}", []))
                    else:
                        taken.append(a.name)
                if taken and node.module in modules:
                    edges.append((node.lineno, node.module, taken))
        out[name] = edges
    return out


def import_circles(imports: dict[str, list[tuple[int, str, list[str]]]]) -> list[list[str]]:
    """The modules that import each other in a loop (strongly connected components of more than
    one module, or a module importing itself), each sorted. A package's ``__init__`` counts as a
    module like any other."""
    graph = {m: {t for _, t, _ in edges if t in imports} for m, edges in imports.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:  # Tarjan's algorithm, recursive: the graph is a few hundred modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def private_imports(imports: dict[str, list[tuple[int, str, list[str]]]]) -> list[str]:
    """``module:line takes _name from other`` for every private name imported across modules."""
    return [
        f"{m}:{line} takes {n} from {target}"
        for m, edges in sorted(imports.items())
        for line, target, names in edges
        for n in names
        if n.startswith("_") and not n.startswith("__") and target != m
    ]


def test_no_import_circle_and_no_private_name_across_modules() -> None:
    imports = module_imports(ROOT)
    assert len(imports) > 100, "the module scan is broken"
    assert import_circles(imports) == []
    assert private_imports(imports) == []


def test_the_checks_see_a_circle_and_a_private_import(tmp_path: Path) -> None:
    """The two checks on a tree made for them: a three-module loop through a lazy import, a
    module importing itself, and a private name taken across modules; a straight chain passes."""
    tree = made_tree(
        tmp_path,
        {
            "workers/a.py": "from workers.b import f\n",
            "workers/b.py": "def f():\n    from workers import c\n",
            "workers/c.py": "import workers.a\nfrom workers.d import _g, h\n",
            "workers/d.py": "from rljob.e import x\n",
            "rljob/e.py": "x = 1\n",
            "rljob/s.py": "from rljob.s import y\ny = 2\n",
        },
    )
    imports = module_imports(tree)
    assert import_circles(imports) == [["rljob.s"], ["workers.a", "workers.b", "workers.c"]]
    assert private_imports(imports) == ["workers.c:2 takes _g from workers.d"]


# workers/ in rooms, from the bottom up (workers/__init__.py): a room imports only rooms below it.
WORKER_ROOMS = ["fp8", "algo", "weight_sync", "engines", "models", "tasks", "rl", "job"]


def room_violations(root: Path) -> list[str]:
    """Imports from a lower room of workers/ to a higher one, and modules outside every room."""
    found = []
    for path in sorted((root / "workers").rglob("*.py")):
        parts = path.relative_to(root / "workers").parts
        if parts == ("__init__.py",):
            continue
        if len(parts) == 1 or parts[0] not in WORKER_ROOMS:
            found.append(f"workers/{'/'.join(parts)} is in no room")
            continue
        floor = WORKER_ROOMS.index(parts[0])
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                bits = name.split(".")
                if (
                    len(bits) > 1
                    and bits[0] == "workers"
                    and bits[1] in WORKER_ROOMS
                    and WORKER_ROOMS.index(bits[1]) > floor
                ):
                    where = f"workers/{'/'.join(parts)}:{node.lineno}"
                    found.append(f"{where} imports workers.{bits[1]} (upward)")
                    break
    return found


def test_workers_rooms_import_only_downward() -> None:
    assert room_violations(ROOT) == []


def test_the_room_check_sees_an_upward_import_and_a_flat_module(tmp_path: Path) -> None:
    for room in ("fp8", "rl", "job"):
        (tmp_path / "workers" / room).mkdir(parents=True)
    (tmp_path / "workers" / "__init__.py").write_text("")
    (tmp_path / "workers" / "loose.py").write_text("")
    (tmp_path / "workers" / "fp8" / "q.py").write_text("def f():\n    from workers.rl import step\n")
    (tmp_path / "workers" / "job" / "d.py").write_text("import workers.rl.step\nfrom workers.fp8 import q\n")
    assert room_violations(tmp_path) == [
        "workers/fp8/q.py:2 imports workers.rl (upward)",
        "workers/loose.py is in no room",
    ]
