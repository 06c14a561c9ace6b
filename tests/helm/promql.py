"""A small PromQL reader for tests: which metrics an expression selects, with which label matchers.

Not a full parser: it tokenizes the expression and reads every metric selector out of it, which is
what a check "does this dashboard (or alert rule) use only metrics we export, with labels they
have?" needs. It ignores function and aggregation names, keywords (``by``, ``without``, ``on``,
``ignoring``, ``group_left``, ``group_right``, ``offset``, ``bool``, ``and``, ``or``, ``unless``,
``atan2``), string literals, numbers (``1.05``, ``2e-3``, ``0x1f``, ``Inf``, ``NaN``), durations,
whatever is in ``[...]`` (ranges, subqueries, ``$__rate_interval``), the label lists of ``by (...)``,
``on (...)`` and friends, ``# comments`` and Grafana variables (``$namespace``, ``${job}``,
``${job:regex}``, ``[[job]]``) outside strings.

Grafana's variable query ``label_values(metric{...}, label)`` is read as the selector of ``metric``
with ``label`` as a label that must exist (matcher text ``!=""``, PromQL's "label is set");
``label_values(label)`` gives the metric name ``""`` (any metric).

Malformed input (unbalanced brackets, an unterminated string, a bad matcher, a character PromQL does
not have, a metric name glued to a Grafana variable) raises :class:`PromQLError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["PromQLError", "selectors"]


class PromQLError(ValueError):
    """The expression is not PromQL this reader understands."""


# Binary operators and modifiers that are words; PromQL reads keywords case-insensitively.
KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or"}
    | {"unless", "atan2"}
)
# Keywords that take a label list in parentheses (optional only after group_left/group_right).
LABEL_LIST = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
NUMBER_WORDS = frozenset({"inf", "nan"})
MATCH_OPS = frozenset({"=", "!=", "=~", "!~"})
MUST_EXIST = '!=""'  # matcher text of a label that must be set (label_values' 2nd argument)

_UNIT = r"(?:ms|[smhdwy])"
_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>(?:0[xX][0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)(?:"""
    + _UNIT
    + r"""(?:\d+"""
    + _UNIT
    + r""")*)?)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=@:])
  | (?P<punct>[(){}\[\],])
    """,
    re.VERBOSE,
)
_OPENERS = {"(": ")", "[": "]", "{": "}"}
_CLOSERS = {v: k for k, v in _OPENERS.items()}


@dataclass(frozen=True)
class Token:
    kind: str  # string | var | number | ident | op | one of ( ) [ ] { } ,
    text: str
    pos: int

    @property
    def end(self) -> int:
        return self.pos + len(self.text)


def tokenize(expr: str) -> list[Token]:
    """The tokens of ``expr`` without spaces and comments."""
    out: list[Token] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            what = "an unterminated string" if expr[pos] in "\"'`" else f"unexpected {expr[pos]!r}"
            raise PromQLError(f"{what} at offset {pos} of {expr!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind == "number" and m.end() < len(expr) and re.match(r"[A-Za-z0-9_.]", expr[m.end()]):
            raise PromQLError(f"malformed number or duration at offset {pos} of {expr!r}")
        if kind == "punct":
            kind = m.group()
        if kind not in ("space", "comment"):
            out.append(Token(kind, m.group(), pos))
        pos = m.end()
    return out


def _pairs(tokens: list[Token], expr: str) -> dict[int, int]:
    """Index of each opening bracket -> index of its closing one; raises on any imbalance."""
    stack: list[int] = []
    pairs: dict[int, int] = {}
    for i, t in enumerate(tokens):
        if t.kind in _OPENERS:
            stack.append(i)
        elif t.kind in _CLOSERS:
            if not stack or tokens[stack[-1]].kind != _CLOSERS[t.kind]:
                raise PromQLError(f"unbalanced {t.kind!r} at offset {t.pos} of {expr!r}")
            pairs[stack.pop()] = i
    if stack:
        t = tokens[stack[-1]]
        raise PromQLError(f"unclosed {t.kind!r} at offset {t.pos} of {expr!r}")
    return pairs


def _unquote(text: str) -> str:
    if text.startswith("`"):
        return text[1:-1]
    return re.sub(r"\\(.)", r"\1", text[1:-1])


class _Reader:
    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.tokens = tokenize(expr)
        self.pairs = _pairs(self.tokens, expr)

    def fail(self, message: str, token: Token) -> PromQLError:
        return PromQLError(f"{message} at offset {token.pos} of {self.expr!r}")

    def kind(self, i: int, end: int) -> str | None:
        return self.tokens[i].kind if i < end else None

    def walk(self, start: int, end: int) -> list[tuple[str, dict[str, str]]]:
        out: list[tuple[str, dict[str, str]]] = []
        i = start
        while i < end:
            t = self.tokens[i]
            if t.kind == "[":  # range, subquery, [[grafana_var]]: durations and variables only
                i = self.pairs[i] + 1
            elif t.kind == "{":  # a selector without a leading name: {__name__="x"} or {"x"}
                close = self.pairs[i]
                name, matchers = self.matchers(i + 1, close)
                if not name and not matchers:
                    raise self.fail("an empty selector {} selects nothing", t)
                out.append((name, matchers))
                i = close + 1
            elif t.kind == "ident":
                i = self.word(i, end, out)
            else:  # numbers, strings, variables, operators, parentheses, commas
                i += 1
        return out

    def word(self, i: int, end: int, out: list[tuple[str, dict[str, str]]]) -> int:
        """Read the identifier at ``i`` (keyword, function or metric name); the index after it."""
        t = self.tokens[i]
        word = t.text.lower()
        nxt = self.kind(i + 1, end)
        if word in LABEL_LIST:
            if nxt == "(":
                return self.pairs[i + 1] + 1  # grouping / matching labels, not selectors
            if word in ("by", "without", "on", "ignoring"):
                raise self.fail(f"{t.text!r} without a label list", t)
            return i + 1
        if word in KEYWORDS or word in NUMBER_WORDS:
            return i + 1
        if nxt == "var" and self.tokens[i + 1].pos == t.end:
            raise self.fail(f"metric name {t.text!r} glued to a Grafana variable cannot be checked", t)
        if nxt == "ident" and self.tokens[i + 1].text.lower() in ("by", "without"):
            return i + 1  # an aggregation written `sum by (labels) (...)`
        if nxt == "(":  # a function or an aggregation: its arguments are read as they come
            if t.text == "label_values":
                close = self.pairs[i + 1]
                out.append(self.label_values(i, close))
                return close + 1
            return i + 1
        if nxt == "{":
            close = self.pairs[i + 1]
            name, matchers = self.matchers(i + 2, close)
            if name and name != t.text:
                raise self.fail(f"metric named twice ({t.text!r} and {name!r})", t)
            out.append((t.text, matchers))
            return close + 1
        out.append((t.text, {}))
        return i + 1

    def matchers(self, start: int, end: int) -> tuple[str, dict[str, str]]:
        """Label matchers between braces; the metric name if one is given there (``__name__="x"``
        or PromQL 3's quoted ``{"x"}``). A label matched twice gets its texts joined by ``,``."""
        name = ""
        found: dict[str, str] = {}
        i = start
        while i < end:
            t = self.tokens[i]
            if t.kind == "string" and (i + 1 == end or self.tokens[i + 1].kind == ","):
                name = _unquote(t.text)  # {"metric.name", ...}
                i += 2
                continue
            if t.kind not in ("ident", "string"):
                raise self.fail(f"expected a label name, got {t.text!r}", t)
            if i + 2 >= end:
                raise self.fail(f"label {t.text!r} without a matcher and a value", t)
            op, value = self.tokens[i + 1], self.tokens[i + 2]
            if op.kind != "op" or op.text not in MATCH_OPS or value.kind != "string":
                raise self.fail(f"label {t.text!r} needs =, !=, =~ or !~ and a quoted value", t)
            label = t.text if t.kind == "ident" else _unquote(t.text)
            text = op.text + value.text
            found[label] = f"{found[label]},{text}" if label in found else text
            if label == "__name__" and op.text == "=":
                name = _unquote(value.text)
            i += 3
            if i < end:
                if self.tokens[i].kind != ",":
                    raise self.fail("expected ',' between label matchers", self.tokens[i])
                i += 1
        return name, found

    def label_values(self, i: int, close: int) -> tuple[str, dict[str, str]]:
        """Grafana's ``label_values([metric_selector,] label)``; ``i`` is its name, ``close`` its ``)``."""
        args: list[tuple[int, int]] = []
        j = start = i + 2
        while j < close:
            if self.tokens[j].kind in _OPENERS:
                j = self.pairs[j]
            elif self.tokens[j].kind == ",":
                args.append((start, j))
                start = j + 1
            j += 1
        args.append((start, close))
        label_start, label_end = args[-1]
        if len(args) > 2 or label_end - label_start != 1 or self.tokens[label_start].kind != "ident":
            raise self.fail("label_values takes ([metric selector,] label name)", self.tokens[i])
        label = self.tokens[label_start].text
        if len(args) == 1:
            return "", {label: MUST_EXIST}
        found = self.walk(*args[0])
        if len(found) != 1:
            raise self.fail("label_values needs exactly one metric selector", self.tokens[i])
        name, matchers = found[0]
        return name, {**matchers, label: matchers.get(label, MUST_EXIST)}


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """Every metric selector of ``expr`` in order of appearance: (metric name, {label: matcher text}).

    Matcher text is the operator and the quoted value as written, e.g. ``'=~"$namespace"'``. The
    metric name is ``""`` for a selector that names none (``{job="x"}``, ``label_values(job)``).
    """
    reader = _Reader(expr)
    return reader.walk(0, len(reader.tokens))
