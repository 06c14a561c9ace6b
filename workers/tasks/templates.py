"""Substituting ``{{item.*}}`` and ``{{sample.*}}`` into a grader's text fields.

A placeholder is replaced by the value it names, as text: a string as it is, a number or
boolean as JSON writes it (``3``, ``0.5``, ``true``), a list or object as compact JSON, and a
missing field or ``null`` as the empty string. Nothing is evaluated: the placeholder's path is
split on dots and looked up (an object's key, or a list's index when the part is digits). The
placeholders a spec may hold are checked when it is read (:func:`rljob.graders.template_problems`).

``sample.output_json`` is the response parsed as JSON (all of it, or its first fenced ```json
block); a response that does not parse gives the empty string.

Worked example: item ``{"answer": 7, "meta": {"tags": ["x", "y"]}}``, response ``'{"n": 7}'``:
``"{{item.answer}}"`` -> ``"7"``; ``"{{item.meta.tags.1}}"`` -> ``"y"``; ``"{{sample.output_json.n}}"``
-> ``"7"``; ``"{{item.nope}}"`` -> ``""``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*\}\}")
_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_MISSING = object()


def parse_json(text: str) -> Any:
    """The JSON value ``text`` holds (all of it, or its first fenced block); ``_MISSING`` when none."""
    for candidate in (text.strip(), *(m.group(1).strip() for m in _FENCE.finditer(text))):
        if not candidate:
            continue
        try:
            return json.loads(candidate)
        except (ValueError, RecursionError):
            continue
    return _MISSING


def parses_as_json(text: str) -> tuple[bool, Any]:
    """(whether ``text`` holds JSON, the value)."""
    value = parse_json(text)
    return value is not _MISSING, (None if value is _MISSING else value)


@dataclass
class Sample:
    """A model's response as graders see it."""

    output_text: str
    _json: Any = field(default=None, init=False, repr=False)
    _parsed: bool = field(default=False, init=False, repr=False)

    @property
    def output_json(self) -> Any:
        """The response parsed as JSON; None when it does not parse."""
        if not self._parsed:
            value = parse_json(self.output_text)
            self._json, self._parsed = (None if value is _MISSING else value), True
        return self._json

    def as_dict(self) -> dict[str, Any]:
        """What a python grader receives as ``sample``."""
        return {"output_text": self.output_text, "output_json": self.output_json}


def lookup(root: Any, parts: list[str]) -> Any:
    """``root`` followed down ``parts`` (keys, or list indices); None where the path ends."""
    node = root
    for part in parts:
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def as_text(value: Any) -> str:
    """A value as the text a placeholder becomes (module docstring)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def render(template: str, item: dict[str, Any], sample: Sample) -> str:
    """``template`` with every placeholder replaced (module docstring)."""

    def value(match: re.Match[str]) -> str:
        root, *parts = match.group(1).split(".")
        if root == "item":
            return as_text(lookup(item, parts))
        if parts[:1] == ["output_text"] and len(parts) == 1:
            return sample.output_text
        if parts[:1] == ["output_json"]:
            return as_text(lookup(sample.output_json, parts[1:]))
        return match.group(0)  # the spec refuses other placeholders; never reached from a valid one

    return _PLACEHOLDER.sub(value, template)
