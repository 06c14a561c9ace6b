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


def test_the_check_sees_an_upward_a_sideways_and_a_lazy_import(tmp_path: Path) -> None:
    """The checker itself, on a tree made for it: each kind of wrong import is caught, with its
    file and line; downward and same-package imports pass."""
    for package in FLOORS:
        (tmp_path / package).mkdir()
    (tmp_path / "rljob" / "a.py").write_text("import rljob.b\nfrom workers import x\n")
    (tmp_path / "service" / "s.py").write_text("from rljob import a\n\ndef f():\n    import operators.o\n")
    (tmp_path / "workers" / "w.py").write_text("from rljob.a import b\nimport torch\n")
    (tmp_path / "fp8rl" / "c.py").write_text("from bench import y\nfrom service import s\n")
    assert violations(tmp_path) == [
        "rljob/a.py:2 imports workers (upward)",
        "service/s.py:4 imports operators (sideways)",
    ]
    (tmp_path / "bench" / "r.py").write_text("from . import y\n")
    with pytest.raises(AssertionError, match="relative import"):
        violations(tmp_path)
