"""The Grafana dashboard: valid layout, and every query uses only metrics (and labels) that a real
driver run and a real control plane export."""

from __future__ import annotations

import copy
import json
import re
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

from rljob.metrics import LABELS, PHASES, PROMETHEUS
from tests.helm.exported import exported, parse_exposition, unknown_metrics
from tests.helm.promql import selectors

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "fp8rl" / "dashboards" / "fp8rl.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
FILTER = {"namespace": '=~"$namespace"', "job": '=~"$job"', "recipe": '=~"$recipe"'}
MISMATCH = "fp8rl_token_mult_prob_error"
GRAFANA_UNITS = {"short", "none", "s", "ms", "bytes", "Bps", "percentunit", "percent"}


def load() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """All panels, rows included, with the panels of collapsed rows."""
    out: list[dict[str, Any]] = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def variable_query(variable: dict[str, Any]) -> str:
    query = variable["query"]
    return str(query["query"] if isinstance(query, dict) else query)


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and query-variable queries."""
    out = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    out += [variable_query(v) for v in variables(dashboard).values() if v["type"] == "query"]
    return out


def panel_metrics(panel: dict[str, Any]) -> set[str]:
    return {name for t in panel.get("targets", []) for name, _ in selectors(t["expr"])}


# --- layout and metadata (no driver run needed) ---------------------------------------------------


def test_dashboard_identity_and_variables() -> None:
    d = load()
    assert (d["schemaVersion"], d["uid"], d["title"]) == (39, "fp8rl-rl", "fp8rl: FP8 RL jobs")
    v = variables(d)
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"
    for name in ("namespace", "job", "recipe"):
        assert v[name]["type"] == "query" and v[name]["multi"] and v[name]["includeAll"], name
        assert v[name]["datasource"] == DATASOURCE
        [(metric, matchers)] = selectors(variable_query(v[name]))
        assert metric == "fp8rl_step" and matchers[name] == '!=""', "label_values(fp8rl_step..., name)"
    # each variable narrows by the ones before it
    assert selectors(variable_query(v["job"]))[0][1]["namespace"] == FILTER["namespace"]
    assert {k: selectors(variable_query(v["recipe"]))[0][1][k] for k in ("namespace", "job")} == {
        "namespace": FILTER["namespace"],
        "job": FILTER["job"],
    }


def test_panels_have_ids_titles_descriptions_and_targets() -> None:
    ps = panels(load())
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    titles = [p["title"] for p in ps]
    assert all(titles) and len(titles) == len(set(titles)), titles
    graphs = [p for p in ps if p["type"] != "row"]
    assert {p["type"] for p in graphs} <= {"timeseries", "stat"}
    assert len(graphs) >= 15
    for p in graphs:
        assert len(p.get("description", "")) >= 40, f"{p['title']}: tell the user how to read it"
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["fieldConfig"]["defaults"]["unit"] in GRAFANA_UNITS, p["title"]
        targets = p["targets"]
        assert targets, p["title"]
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)) and all(refs), p["title"]
        for t in targets:
            assert t["expr"].strip() and t["datasource"] == DATASOURCE, p["title"]
    for row in (p for p in ps if p["type"] == "row"):
        assert "targets" not in row and row["gridPos"]["h"] == 1, row["title"]


def overlaps(a: dict[str, int], b: dict[str, int]) -> bool:
    across = a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
    return across and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]


def test_overlap_helper() -> None:
    a = {"x": 0, "y": 0, "w": 8, "h": 8}
    assert overlaps(a, {"x": 7, "y": 7, "w": 2, "h": 2})
    assert not overlaps(a, {"x": 8, "y": 0, "w": 8, "h": 8})  # side by side
    assert not overlaps(a, {"x": 0, "y": 8, "w": 8, "h": 8})  # stacked


def test_grid_positions_fit_and_do_not_overlap() -> None:
    ps = panels(load())
    for p in ps:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1, p["title"]
        assert g["x"] + g["w"] <= 24, p["title"]
    clashes = [
        (a["title"], b["title"]) for a, b in combinations(ps, 2) if overlaps(a["gridPos"], b["gridPos"])
    ]
    assert not clashes


def test_mismatch_panel_draws_a_red_line_at_1_05() -> None:
    mismatch = [p for p in panels(load()) if MISMATCH in panel_metrics(p)]
    assert any(p["type"] == "timeseries" for p in mismatch)
    for p in mismatch:
        defaults = p["fieldConfig"]["defaults"]
        assert {"color": "red", "value": 1.05} in defaults["thresholds"]["steps"], p["title"]
        if p["type"] == "timeseries":
            assert defaults["custom"]["thresholdsStyle"]["mode"] == "line", p["title"]
            assert "1.05" in p["description"] and "1.0" in p["description"]


def test_validation_panels_show_accuracy_and_reward_per_job_and_recipe() -> None:
    by_title = {p["title"]: p for p in panels(load())}
    for title, metric, unit in (
        ("Validation accuracy", "fp8rl_val_accuracy", "percentunit"),
        ("Validation reward mean", "fp8rl_val_reward_mean", "short"),
    ):
        p = by_title[title]
        [target] = p["targets"]
        assert selectors(target["expr"]) == [(metric, FILTER)], title
        assert {"job", "recipe"} <= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"]))
        defaults = p["fieldConfig"]["defaults"]
        assert (p["type"], defaults["unit"], defaults["min"], defaults["max"]) == ("timeseries", unit, 0, 1)
        assert "held-out" in p["description"], title
    # in a row of their own, right below the training reward
    rows = [p["title"] for p in load()["panels"] if p["type"] == "row"]
    assert rows[rows.index("Progress and reward") + 1] == "Validation (held-out problems)"


# --- against the real expositions ----------------------------------------------------------------


def test_the_real_run_exports_the_whole_table() -> None:
    """The exposition the checks use is complete: every PROMETHEUS name, with its labels."""
    known = exported()
    for m in PROMETHEUS:
        assert set(LABELS) <= known.get(m.name, set()), m.name
    assert known["fp8rl_step_duration_seconds"] == {*LABELS, "phase"}
    assert known["fp8rl_jobs"] == {"namespace", "phase"}
    assert "fp8rl_not_a_metric" not in known


def test_dashboard_uses_only_exported_metrics_and_labels() -> None:
    assert unknown_metrics(exprs(load())) == []


def test_every_panel_is_filtered_by_the_variables() -> None:
    known = exported()
    for p in panels(load()):
        for t in p.get("targets", []):
            for name, matchers in selectors(t["expr"]):
                if "job" in known[name]:  # driver metrics
                    assert {k: matchers.get(k) for k in FILTER} == FILTER, (p["title"], t["expr"])
                else:  # the control plane's fp8rl_jobs has no job or recipe label
                    assert matchers.get("namespace") == FILTER["namespace"], (p["title"], t["expr"])


def test_dashboard_shows_every_exported_metric() -> None:
    used = {name for e in exprs(load()) for name, _ in selectors(e)}
    wanted = {m.name for m in PROMETHEUS} | {"fp8rl_step_duration_seconds", "fp8rl_jobs"}
    assert wanted <= set(exported())
    assert wanted - used == set()
    step_time = [p for p in panels(load()) if "fp8rl_step_duration_seconds" in panel_metrics(p)]
    assert [p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] for p in step_time] == ["normal"]
    assert all(phase in step_time[0]["description"] for phase in PHASES)


def test_legends_name_labels_of_the_selected_metrics() -> None:
    for p in panels(load()):
        for t in p.get("targets", []):
            used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
            labels = {label for name, _ in selectors(t["expr"]) for label in exported().get(name, set())}
            assert used <= labels, (p["title"], used - labels)


# --- the check itself fails when it should --------------------------------------------------------


def with_expr(dashboard: dict[str, Any], title: str, expr: str) -> dict[str, Any]:
    changed = copy.deepcopy(dashboard)
    [panel] = [p for p in panels(changed) if p["title"] == title]
    panel["targets"][0]["expr"] = expr
    return changed


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ('fp8rl_not_a_metric{namespace=~"$namespace"}', "fp8rl_not_a_metric, which is not exported"),
        ("fp8rl_token_mult_prob_error_total", "not exported"),  # a real name with a wrong suffix
        ('fp8rl_step{tenant="a"}', "on ['tenant']"),
        ('fp8rl_jobs{job=~"$job"}', "on ['job']"),  # the control plane's metric has no job label
        ("sum(rate(fp8rl_step[5m])", "does not parse"),
        ("vector(1)", "selects no metric"),
    ],
)
def test_the_check_catches_a_bad_expr(expr: str, reason: str) -> None:
    d = load()
    assert unknown_metrics(exprs(d)) == []
    problems = unknown_metrics(exprs(with_expr(d, "Token multiplicative probability error", expr)))
    assert len(problems) == 1 and reason in problems[0], problems


def test_the_check_catches_a_bad_variable_query() -> None:
    d = copy.deepcopy(load())
    variables(d)["job"]["query"] = "label_values(fp8rl_step, tenant)"
    [problem] = unknown_metrics(exprs(d))
    assert "tenant" in problem


def test_unknown_metrics_on_a_given_table() -> None:
    known = {"a_total": {"job", "phase"}, "b": {"namespace"}}
    assert unknown_metrics(['sum by (phase) (rate(a_total{job="x"}[5m])) / on() b'], known) == []
    assert unknown_metrics(['{__name__="b", namespace="n"}', "label_values(phase)"], known) == []
    assert len(unknown_metrics(["a", 'b{job="x"}', "label_values(instance)"], known)) == 3


def test_parse_exposition_keys_samples_by_name() -> None:
    text = (
        "# TYPE t counter\n"
        't_total{job="j",recipe="r"} 1.0\n'
        't_created{job="j",recipe="r"} 1.7e9\n'
        "# TYPE g gauge\n"
        'g{phase="a"} 1.0\n'
        'g{phase="b",extra="x"} 2.0\n'
    )
    assert parse_exposition(text) == {
        "t_total": {"job", "recipe"},
        "t_created": {"job", "recipe"},
        "g": {"phase", "extra"},
    }
