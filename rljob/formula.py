"""A ``multi`` grader's formula: arithmetic over its sub-graders' scores, never Python.

The text is parsed with :mod:`ast` and walked by :func:`evaluate`; nothing is compiled or
``eval``-ed. What a formula may hold:

- numbers (``0.5``, ``2``), and the names of the multi grader's sub-graders (each a score in [0, 1]);
- ``+ - * /`` and unary ``-``/``+``; ``/`` by 0 gives 0 (a grader's score is never a division error);
- comparisons ``< <= > >= == !=`` (1.0 when true, else 0.0), and ``a if cond else b``;
- the functions ``min(a, b, ...)``, ``max(a, b, ...)``, ``abs(x)``, ``clip(x, lo, hi)``.

Anything else (attributes, subscripts, calls to other names, ``**``, strings, lambdas,
comprehensions) is refused with the offending text named. Worked example:
``0.7 * correct + 0.3 * min(fmt, 1)`` with correct = 1, fmt = 0.5 is 0.7 + 0.15 = 0.85.

The job's reward is the formula's value clipped to [0, 1] (:func:`evaluate` does not clip; the
grader does).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping

MAX_FORMULA_CHARS = 1024
MAX_NODES = 256  # a formula of 1 KiB holds fewer; a bound on the walk, not on what users write

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: lambda a, b: a / b if b != 0 else 0.0,
}
_COMPARE: dict[type[ast.cmpop], Callable[[float, float], bool]] = {
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
}
# name -> (fewest arguments, most arguments or None for any, the function)
_FUNCTIONS: dict[str, tuple[int, int | None, Callable[..., float]]] = {
    "min": (1, None, min),
    "max": (1, None, max),
    "abs": (1, 1, abs),
    "clip": (3, 3, lambda x, lo, hi: min(max(x, lo), hi)),
}


class FormulaError(ValueError):
    """The formula holds something other than the module docstring's arithmetic."""


def parse(text: str, names: set[str]) -> ast.Expression:
    """The formula's tree, checked: only the allowed nodes, and only ``names`` as variables.
    Raises :class:`FormulaError` naming the offending part."""
    if len(text) > MAX_FORMULA_CHARS:
        raise FormulaError(f"the formula has {len(text)} characters; at most {MAX_FORMULA_CHARS}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as err:
        raise FormulaError(f"the formula is not an expression: {err.msg} (column {err.offset})") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise FormulaError(f"the formula has {len(nodes)} parts; at most {MAX_NODES}")
    called = {id(n.func) for n in nodes if isinstance(n, ast.Call)}
    for node in nodes:
        _check(node, text, names, called)
    return tree


def _check(node: ast.AST, text: str, names: set[str], called: set[int]) -> None:
    where = ast.get_source_segment(text.strip(), node) or type(node).__name__
    if isinstance(node, ast.Expression | ast.Load | ast.UnaryOp | ast.IfExp):
        if isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.USub | ast.UAdd):
            raise FormulaError(f"{where!r}: only unary - and + are allowed")
        return
    if isinstance(node, ast.operator | ast.unaryop | ast.cmpop):
        return  # checked on their BinOp / UnaryOp / Compare
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise FormulaError(f"{where!r}: only numbers are allowed as constants")
        if not math.isfinite(node.value):
            raise FormulaError(f"{where!r}: a number must be finite")
        return
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY:
            raise FormulaError(f"{where!r}: only + - * / are allowed")
        return
    if isinstance(node, ast.Compare):
        if any(type(op) not in _COMPARE for op in node.ops):
            raise FormulaError(f"{where!r}: only < <= > >= == != are allowed")
        return
    if isinstance(node, ast.Name):
        if node.id in _FUNCTIONS and id(node) in called:
            return  # checked as a call
        if node.id in _FUNCTIONS:
            raise FormulaError(f"{where!r}: {node.id} is a function; call it, e.g. {node.id}(a, b)")
        if node.id not in names:
            raise FormulaError(
                f"{where!r} is not a grader of this multi grader (its graders: {', '.join(sorted(names))})"
            )
        return
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
            raise FormulaError(f"{where!r}: the only functions are {', '.join(_FUNCTIONS)}")
        low, high, _ = _FUNCTIONS[node.func.id]
        n = len(node.args)
        if node.keywords or n < low or (high is not None and n > high):
            want = f"{low}" if low == high else f"at least {low}"
            raise FormulaError(f"{where!r}: {node.func.id} takes {want} positional arguments")
        return
    raise FormulaError(f"{where!r}: not allowed in a formula (module rljob.formula says what is)")


def evaluate(tree: ast.Expression, scores: Mapping[str, float]) -> float:
    """The value of a :func:`parse`-d formula with each grader's name bound to its score."""
    return float(_value(tree.body, scores))


def _value(node: ast.AST, scores: Mapping[str, float]) -> float:
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, int | float)  # parse() lets only numbers through
        return float(node.value)
    if isinstance(node, ast.Name):
        return float(scores[node.id])
    if isinstance(node, ast.UnaryOp):
        v = _value(node.operand, scores)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_value(node.left, scores), _value(node.right, scores))
    if isinstance(node, ast.Compare):
        left = _value(node.left, scores)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = _value(right_node, scores)
            if not _COMPARE[type(op)](left, right):
                return 0.0
            left = right
        return 1.0
    if isinstance(node, ast.IfExp):
        return _value(node.body if _value(node.test, scores) else node.orelse, scores)
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)
        return float(_FUNCTIONS[node.func.id][2](*(_value(a, scores) for a in node.args)))
    raise FormulaError(f"{type(node).__name__} is not allowed in a formula")  # parse() refuses it first
