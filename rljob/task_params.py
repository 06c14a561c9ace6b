"""What ``task.params`` may hold: the keyword arguments of each reasoning-gym generator, allow-listed.

``task.params`` goes to a reasoning-gym generator's config as it is, so it is where a tenant could
name a file (``spell_backward``'s ``data_file`` reads any path the driver can open) or ask for
problems that cost without bound (4,000-digit sums). The rules, checked wherever a spec is read
(``fp8rl run``, the control plane's POST, the operator), with no file opened, so the answer is the
same whether a path exists or not:

- **Keys**: the fields of the generator's config (``reasoning_gym_params.json``, generated from the
  pinned reasoning-gym by ``workers.tasks.params_table`` and held equal to it by a test), except
  ``size`` and ``seed`` (``task.size`` and ``task.seed`` set them) and every field that names a file
  (``*_file``, ``*_path``, ``*_dir``). An unknown generator is refused with the names it could be.
- **Values**: JSON scalars, lists and objects only, at most ``MAX_DEPTH`` deep, strings of at most
  ``MAX_STRING`` characters, lists of at most ``MAX_ITEMS``, finite numbers. A string never looks like
  a path (``/`` or ``\\`` beside other characters, a leading ``~``, ``..``, a NUL).
- **Sizes**: a number given for a numeric field is at most ``max(PARAM_FLOOR, 10 x |its default|)``
  in magnitude (the table holds each field's cap); numbers inside lists at most ``LIST_NUMBER_CAP``.
  The whole of ``task.params`` as JSON is bounded by the service's ``max_task_params_bytes``.
- ``composite``'s ``datasets`` (``[{name, weight, config}]``) is checked entry by entry by the same
  rules, each ``config`` against its own generator.
"""

from __future__ import annotations

import json
import math
from functools import cache
from importlib import resources
from typing import Any

MAX_DEPTH = 4
MAX_STRING = 256
MAX_ITEMS = 256
PARAM_FLOOR = 100  # the cap of a numeric field whose default is small (or 0)
NONE_DEFAULT_CAP = 1000  # the cap of a numeric field whose default is None
LIST_NUMBER_CAP = 1e6
RESERVED = frozenset({"size", "seed"})  # task.size and task.seed
FILE_SUFFIXES = ("_file", "_path", "_dir", "_dirs", "_files", "_paths", "_url")
NESTED = "datasets"  # the table's kind of composite's list of generators
ANY = "any"  # the table's kind of a non-numeric field


def names_a_file(field: str) -> bool:
    """True for a config field whose name says it holds a path (never allowed in ``task.params``)."""
    low = field.lower()
    return low.endswith(FILE_SUFFIXES) or low in {"file", "path", "dir", "url", "filename"}


@cache
def table() -> dict[str, dict[str, float | str]]:
    """``{generator: {field: cap}}``: a number is a numeric field's magnitude cap; ``"any"`` a
    non-numeric field; ``"datasets"`` composite's nested list."""
    text = resources.files("rljob").joinpath("reasoning_gym_params.json").read_text()
    data: dict[str, dict[str, float | str]] = json.loads(text)["generators"]
    return data


def _looks_like_path(text: str) -> bool:
    """A NUL, a leading ``~``, ``..``, or a separator beside other characters (``"/"`` alone is
    basic_arithmetic's division)."""
    separated = ("/" in text or "\\" in text) and len(text) > 1
    return separated or "\x00" in text or text.startswith("~") or text == ".."


def _value_problems(value: Any, where: str, depth: int = 0) -> list[tuple[str, str]]:
    """Problems of one value's shape: JSON types, depth, lengths, finite numbers, no paths."""
    if depth > MAX_DEPTH:
        return [(where, f"nested more than {MAX_DEPTH} levels deep")]
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            return [(where, f"{value} is not a finite number")]
        if abs(value) > LIST_NUMBER_CAP and depth > 0:
            return [(where, f"{value} is over {LIST_NUMBER_CAP:g} in magnitude")]
        return []
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            return [(where, f"a string of {len(value)} characters; at most {MAX_STRING}")]
        if _looks_like_path(value):
            return [(where, f"{value[:40]!r} looks like a file path; task.params never names files")]
        return []
    if isinstance(value, list | tuple):
        if len(value) > MAX_ITEMS:
            return [(where, f"a list of {len(value)} items; at most {MAX_ITEMS}")]
        out: list[tuple[str, str]] = []
        for i, item in enumerate(value):
            out += _value_problems(item, f"{where}.{i}", depth + 1)
        return out
    if isinstance(value, dict):
        if len(value) > MAX_ITEMS:
            return [(where, f"an object of {len(value)} keys; at most {MAX_ITEMS}")]
        out = []
        for key, item in value.items():
            if not isinstance(key, str) or len(key) > MAX_STRING:
                out.append((where, "object keys are strings of at most 256 characters"))
                continue
            out += _value_problems(item, f"{where}.{key}", depth + 1)
        return out
    return [(where, f"a {type(value).__name__}; only JSON values (numbers, strings, lists, objects)")]


def _field_problems(
    generator: str, params: Any, where: str, depth: int, name_at: str
) -> list[tuple[str, str]]:
    gens = table()
    if generator not in gens:
        close = sorted(g for g in gens if g[:4] == generator[:4])[:8]
        hint = f"; did you mean {', '.join(close)}?" if close else f" ({len(gens)} generators in all)"
        return [(name_at, f"unknown reasoning-gym generator {generator!r}{hint}")]
    if not isinstance(params, dict):
        return [(where, "an object of the generator's keyword arguments")]
    fields = gens[generator]
    out: list[tuple[str, str]] = []
    for key, value in params.items():
        at = f"{where}.{key}"
        if key in RESERVED:
            out.append((at, f"set by task.{key}, not in task.params"))
            continue
        if names_a_file(key):
            out.append(
                (at, "names a file; task.params never names files (use task.dataset for a JSONL file)")
            )
            continue
        if key not in fields:
            allowed = ", ".join(sorted(fields)) or "none"
            out.append((at, f"not a parameter of {generator!r}; it takes: {allowed}"))
            continue
        kind = fields[key]
        if kind == NESTED and depth == 0:
            out += _nested_problems(value, at)
            continue
        if kind == NESTED:
            out.append((at, "composite datasets cannot nest"))
            continue
        shape = _value_problems(value, at, 1 if isinstance(value, list | tuple | dict) else 0)
        if shape:
            out += shape
            continue
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if isinstance(kind, int | float) and numeric and abs(value) > kind:
            out.append(
                (at, f"{value} is over {kind:g} in magnitude (10x its default, at least {PARAM_FLOOR})")
            )
    return out


def _nested_problems(value: Any, where: str) -> list[tuple[str, str]]:
    if not isinstance(value, list) or len(value) > MAX_ITEMS:
        return [(where, f"a list of at most {MAX_ITEMS} {{name, weight, config}} entries")]
    out: list[tuple[str, str]] = []
    for i, entry in enumerate(value):
        at = f"{where}.{i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            out.append((at, "an object {name, weight, config} naming a reasoning-gym generator"))
            continue
        extra = set(entry) - {"name", "weight", "config"}
        if extra:
            out.append((at, f"unknown keys {sorted(extra)}; an entry holds name, weight and config"))
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            out.append((f"{at}.weight", "a finite number"))
        elif not 0 <= weight <= LIST_NUMBER_CAP:
            out.append((f"{at}.weight", f"between 0 and {LIST_NUMBER_CAP:g}"))
        out += _field_problems(entry["name"], entry.get("config") or {}, f"{at}.config", 1, f"{at}.name")
    return out


def params_problems(generator: str | None, params: dict[str, Any]) -> list[tuple[str, str]]:
    """``[(field, message)]`` of ``params`` for ``generator`` (fields as paths from ``task``, e.g.
    ``task.params.data_file``); empty when they may go to reasoning-gym. Without a generator (a
    dataset file) params must be empty."""
    if generator is None:
        if params:
            return [("task.params", "task.params are a reasoning-gym generator's; a dataset file takes none")]
        return []
    return _field_problems(generator, params, "task.params", 0, "task.reasoning_gym")
