"""The Grafana dashboard's queries as Grafana sends them to a real Prometheus, and what is wrong
with their answers.

Grafana substitutes the dashboard's variables into each query (``$namespace``, ``${job}``, and its
own ``$__interval`` and ``$__rate_interval``) and sends it to Prometheus' query API; a variable's
``label_values(selector, label)`` becomes ``/api/v1/label/<label>/values?match[]=selector``.
:func:`dashboard_problems` does the same for every panel target and variable and lists what a user
would see wrong: a query Prometheus refuses, a panel without data, a value out of the panel's
range, a legend naming a label the answer lacks, a panel or variable the variables do not narrow.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

from tests.helm.monitoring import Prometheus, QueryError, Sample, metric_names

__all__ = ["LABEL_VALUES", "dashboard_problems", "interpolate", "panels", "targets", "variables"]

# Grafana's own reading of a variable query (the Prometheus data source's metric_find_query.ts)
LABEL_VALUES = re.compile(r"^label_values\((?:(.+),\s*)?([a-zA-Z_$][a-zA-Z0-9_]*)\)\s*$")
# Grafana's built-in intervals for a 6-hour dashboard on a 1s scrape interval: $__interval is the
# range over the panel's data points (6h / ~1000 points, rounded: 20s); $__rate_interval is
# max($__interval + scrape interval, 4 x scrape interval) = 21s
BUILTINS = {"__interval": "20s", "__rate_interval": "21s"}
NOTHING = "no-such-value"  # a variable value that matches no series
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_REGEX_SPECIAL = re.compile(r"[\\^$*+?.()|\[\]{}]")
# Panels whose values may be negative, with the reason
SIGNED = {
    "Policy loss": "the policy-gradient loss is -mean(advantage x ratio): negative when the advantages are"
    " positive on the whole"
}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """All panels, rows included, with the panels of collapsed rows."""
    out: list[dict[str, Any]] = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every query of every panel."""
    for p in panels(dashboard):
        for t in p.get("targets", []):
            yield p, t


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def variable_query(variable: dict[str, Any]) -> str:
    query = variable["query"]
    return str(query["query"] if isinstance(query, dict) else query)


def interpolate(text: str, values: dict[str, str]) -> str:
    """``text`` with Grafana's variables replaced: ``values`` (already formatted) and BUILTINS."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        found = {**BUILTINS, **values}.get(name)
        if found is None:
            raise KeyError(f"{text!r} uses ${name}, which is neither a dashboard variable nor a built-in")
        return found

    return _VARIABLE.sub(one, text)


def selected(variable: dict[str, Any], value: str | None) -> str:
    """The text Grafana puts in place of ``variable`` set to ``value`` (None: "All", its allValue)."""
    if value is None:
        return str(variable["allValue"])
    # Grafana regex-escapes values of multi-value variables; ours need none (say so if one did)
    assert not _REGEX_SPECIAL.search(value), f"{variable['name']}={value!r} would need escaping"
    return value


def _variable_values(prom: Prometheus, variable: dict[str, Any], values: dict[str, str]) -> list[str]:
    m = LABEL_VALUES.match(variable_query(variable))
    if m is None:
        raise QueryError(f"{variable_query(variable)!r} is not label_values([selector,] label)")
    selector, label = m.groups()
    return prom.label_values(label, interpolate(selector, values) if selector else None)


def _resolve(prom: Prometheus, dashboard: dict[str, Any], problems: list[str]) -> dict[str, list[str]]:
    """Each query variable's values (the ones before it set to All) into ``problems``: no values,
    or values a variable before it does not narrow."""
    found: dict[str, list[str]] = {}
    all_values: dict[str, str] = {}
    for name, v in variables(dashboard).items():
        if v["type"] != "query":
            continue
        try:
            found[name] = _variable_values(prom, v, all_values)
            for before in all_values:
                if _variable_values(prom, v, {**all_values, before: NOTHING}):
                    problems.append(f"variable {name}: ${before} matching nothing leaves values")
        except (QueryError, KeyError) as e:
            problems.append(f"variable {name}: {e}")
            found[name] = []
        if not found[name]:
            problems.append(f"variable {name}: {variable_query(v)!r} gives no values")
        all_values[name] = selected(v, None)
    return found


def value_range(panel: dict[str, Any]) -> tuple[float, float]:
    """The values a panel may show: non-negative unless SIGNED; at most 1 for a ratio
    (percentunit); within the panel's own min and max where it sets them."""
    defaults = panel["fieldConfig"]["defaults"]
    low = -math.inf if panel["title"] in SIGNED else 0.0
    high = 1.0 if defaults.get("unit") == "percentunit" else math.inf
    return max(low, defaults.get("min", low)), min(high, defaults.get("max", high))


def _answer_problems(panel: dict[str, Any], target: dict[str, Any], answer: list[Sample]) -> list[str]:
    if not answer:
        return ["no data"]
    low, high = value_range(panel)
    out = [
        f"value {s.value} of {s.labels} outside [{low}, {high}]" for s in answer if not low <= s.value <= high
    ]
    legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
    out += [
        f"legend names {sorted(legend - set(s.labels))}, not in {s.labels}"
        for s in answer
        if legend - set(s.labels)
    ]
    return out


def dashboard_problems(prom: Prometheus, dashboard: dict[str, Any]) -> list[str]:
    """What is wrong with the dashboard's answers from ``prom``, one line each, naming the panel.

    Every target is asked with each variable at "All" and at each of its values; it must answer,
    with data in :func:`value_range` and the labels its legend names. With one variable set to
    match nothing the target must answer nothing (but for the label-less 0 of ``or vector(0)``):
    ``$namespace`` must narrow every panel, ``$job`` and ``$recipe`` every panel that reads a
    metric of the run (all but the control plane's)."""
    problems: list[str] = []
    found = _resolve(prom, dashboard, problems)
    query_vars = {name: v for name, v in variables(dashboard).items() if v["type"] == "query"}
    everything = {name: selected(v, None) for name, v in query_vars.items()}
    choices = [everything] + [
        {**everything, name: selected(query_vars[name], value)} for name in found for value in found[name]
    ]
    control_plane = set(prom.label_values("__name__", f'{{instance="{prom.api_instance}"}}'))
    for panel, target in targets(dashboard):
        expr, where = target["expr"], f"{panel['title']} ({target['refId']})"
        reads_the_run = bool(metric_names(expr) - control_plane) or not metric_names(expr)
        narrowing = ["namespace"] + (["job", "recipe"] if reads_the_run else [])
        try:
            for values in choices:
                for problem in _answer_problems(panel, target, prom.query(interpolate(expr, values))):
                    problems.append(f"{where} at {values}: {problem}")
            for name in narrowing:
                left = [
                    s for s in prom.query(interpolate(expr, {**everything, name: NOTHING})) if s != ({}, 0.0)
                ]
                if left:
                    problems.append(f"{where}: ${name} matching nothing leaves {left}")
        except (QueryError, KeyError) as e:
            problems.append(f"{where}: {e}")
    return problems
