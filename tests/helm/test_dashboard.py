"""The Grafana dashboard: a valid layout, and every query (panels and variables) asked, as Grafana
asks it, of a real Prometheus scraping a real run and a real control plane (monitoring.py): each
answers, with data in range, narrowed by the variables; every metric the run and the control plane
export is on a panel."""

from __future__ import annotations

import copy
import json
import re
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

from rljob.prometheus import (
    ACTOR_RESTARTS,
    DRIVER_ATTEMPT,
    GRADER_PROMETHEUS,
    MISMATCH_LAYER_PROMETHEUS,
    PHASES,
    PROMETHEUS,
    RUN_COMPLETE,
)
from rljob.status import Phase
from tests.helm.grafana import (
    LABEL_VALUES,
    dashboard_problems,
    interpolate,
    panels,
    targets,
    variable_query,
    variables,
)
from tests.helm.monitoring import (
    DRIVER_JOB,
    DRIVER_NAMESPACE,
    IDLE_TENANT,
    MAX_NEW_TOKENS,
    RECIPE,
    Prometheus,
    Sample,
    metric_names,
)
from tests.helpers import TINY_MODEL

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "fp8rl" / "dashboards" / "fp8rl.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
FILTER = 'namespace=~"$namespace", job=~"$job", recipe=~"$recipe"'
MISMATCH = "fp8rl_token_mult_prob_error"
GRAFANA_UNITS = {"short", "none", "s", "ms", "bytes", "Bps", "percentunit", "percent"}


def load() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def panel_metrics(panel: dict[str, Any]) -> set[str]:
    return {name for t in panel.get("targets", []) for name in metric_names(t["expr"])}


# --- layout and metadata (no driver run needed) ---------------------------------------------------


def test_dashboard_identity_and_variables() -> None:
    d = load()
    assert (d["schemaVersion"], d["uid"], d["title"]) == (39, "fp8rl-rl", "fp8rl: FP8 RL jobs")
    v = variables(d)
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"
    selectors = {}
    for name in ("namespace", "job", "recipe"):
        assert v[name]["type"] == "query" and v[name]["multi"] and v[name]["includeAll"], name
        assert v[name]["datasource"] == DATASOURCE and v[name]["allValue"] == ".*", name
        m = LABEL_VALUES.match(variable_query(v[name]))
        assert m is not None and m.group(2) == name, variable_query(v[name])
        selectors[name] = m.group(1)
    # each variable narrows by the ones before it (that they really do: test_every_query_...)
    assert selectors == {
        "namespace": "fp8rl_step",
        "job": 'fp8rl_step{namespace=~"$namespace"}',
        "recipe": 'fp8rl_step{namespace=~"$namespace", job=~"$job"}',
    }


def test_panels_have_ids_titles_descriptions_and_targets() -> None:
    ps = panels(load())
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    titles = [p["title"] for p in ps]
    assert all(titles) and len(titles) == len(set(titles)), titles
    graphs = [p for p in ps if p["type"] != "row"]
    assert {p["type"] for p in graphs} <= {"timeseries", "stat", "heatmap"}
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


def test_mismatch_panels_follow_each_jobs_slo_not_one_threshold() -> None:
    """The mismatch SLO's bounds differ per recipe (and per job), so no panel draws one fixed red
    line: the time series draws each job's own bound beside its mismatch, and the stat panel shows
    the job's verdict (breached 1 in red)."""
    by_title = {p["title"]: p for p in panels(load())}
    series = by_title["Token multiplicative probability error"]
    assert [t["expr"] for t in series["targets"]] == [
        f"{MISMATCH}{{{FILTER}}}",
        f"fp8rl_mismatch_slo_median_bound{{{FILTER}}}",
        f"fp8rl_mismatch_slo_median{{{FILTER}}}",
        f"fp8rl_mismatch_slo_tail_bound{{{FILTER}}}",
    ]
    assert series["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "off"
    verdict = by_title["Mismatch SLO"]
    assert [t["expr"] for t in verdict["targets"]] == [f"fp8rl_mismatch_slo_breached{{{FILTER}}}"]
    assert {"color": "red", "value": 1} in verdict["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert "1.25" in verdict["description"] and "1.1" in verdict["description"]


def test_validation_panels_show_accuracy_and_reward_per_job_and_recipe() -> None:
    by_title = {p["title"]: p for p in panels(load())}
    for title, metric, unit in (
        ("Validation accuracy", "fp8rl_val_accuracy", "percentunit"),
        ("Validation reward mean", "fp8rl_val_reward_mean", "short"),
    ):
        p = by_title[title]
        [target] = p["targets"]
        assert target["expr"] == f"{metric}{{{FILTER}}}", title
        assert {"job", "recipe"} <= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"]))
        defaults = p["fieldConfig"]["defaults"]
        assert (p["type"], defaults["unit"], defaults["min"], defaults["max"]) == ("timeseries", unit, 0, 1)
        assert "held-out" in p["description"], title
    # in a row of their own, right below the training reward
    rows = [p["title"] for p in load()["panels"] if p["type"] == "row"]
    assert rows[rows.index("Progress and reward") + 1] == "Validation (held-out problems)"


# --- asked of a real Prometheus (monitoring.py) --------------------------------------------------

ALL = {"namespace": ".*", "job": ".*", "recipe": ".*"}  # each variable at "All" (its allValue)


def ask(prom: Prometheus, title: str, values: dict[str, str] = ALL) -> list[list[Sample]]:
    """The answers to the targets of the panel ``title``, the variables set to ``values``."""
    return [prom.query(interpolate(t["expr"], values)) for p, t in targets(load()) if p["title"] == title]


@pytest.mark.slow
def test_every_query_answers_in_range_and_is_narrowed_by_the_variables(prom: Prometheus) -> None:
    assert dashboard_problems(prom, load()) == []


@pytest.mark.slow
def test_the_run_and_the_control_plane_export_the_whole_table(prom: Prometheus) -> None:
    """The series the checks see are the complete set, with the labels fp8rl gives them."""
    own = {
        "job": DRIVER_JOB,
        "namespace": DRIVER_NAMESPACE,
        "recipe": RECIPE,
        "instance": prom.driver_instance,
    }
    for m in PROMETHEUS:
        assert prom.series(m.name) == [{"__name__": m.name, **own}], m.name
    for name, _, _ in GRADER_PROMETHEUS.values():  # the default grader's series, labelled by it
        assert prom.series(name) == [{"__name__": name, **own, "grader": "answer"}], name
    phases = prom.series("fp8rl_step_duration_seconds")
    assert sorted(s.pop("phase") for s in phases) == sorted(PHASES)
    assert phases == [{"__name__": "fp8rl_step_duration_seconds", **own}] * len(PHASES)
    # the control plane counts jobs per tenant and phase, 0 where it has none (the idle tenant: 0
    # for every phase); its exposition has no job label, so the scrape job's name fills it
    counts = {(s.labels["namespace"], s.labels["phase"]): s.value for s in prom.query("fp8rl_jobs")}
    expected = {(tenant, p.value): 0.0 for tenant in (DRIVER_NAMESPACE, IDLE_TENANT) for p in Phase}
    assert counts == {**expected, (DRIVER_NAMESPACE, "Failed"): 1.0}
    assert {(s["job"], s["instance"]) for s in prom.series("fp8rl_jobs")} == {
        ("fp8rl-api", prom.api_instance)
    }


@pytest.mark.slow
def test_dashboard_shows_every_exported_metric(prom: Prometheus) -> None:
    exported = set(prom.label_values("__name__", '{__name__=~"fp8rl_.*"}'))
    # prometheus_client adds a `_created` series (the creation time) to each counter: not for a panel
    wanted = {name for name in exported if not name.endswith("_created")}
    assert wanted == {m.name for m in PROMETHEUS} | {n for n, _, _ in GRADER_PROMETHEUS.values()} | {
        "fp8rl_step_duration_seconds",
        MISMATCH_LAYER_PROMETHEUS[0],
        "fp8rl_jobs",
        ACTOR_RESTARTS.name,
        RUN_COMPLETE,
        DRIVER_ATTEMPT,
    }
    used = {name for _, t in targets(load()) for name in metric_names(t["expr"])}
    # the operator's, not a panel's: fp8rl_run_complete (a job's outcome where KubeRay cannot read
    # it) and fp8rl_driver_attempt (in-place retries); the RLJob's phase and attempts show them
    assert wanted - used == {RUN_COMPLETE, DRIVER_ATTEMPT}
    step_time = [p for p in panels(load()) if "fp8rl_step_duration_seconds" in panel_metrics(p)]
    assert [p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] for p in step_time] == ["normal"]
    assert all(phase in step_time[0]["description"] for phase in PHASES)


@pytest.mark.slow
def test_panels_show_what_the_run_and_the_control_plane_did(prom: Prometheus) -> None:
    # no job of the control plane runs; one of tenant `default` failed; the idle tenant has none
    assert ask(prom, "Running jobs") == [[({}, 0.0)]]
    [by_phase] = ask(prom, "Jobs by phase")
    assert {s.labels["phase"]: s.value for s in by_phase} == {
        p.value: float(p is Phase.FAILED) for p in Phase
    }
    [idle] = ask(prom, "Jobs by phase", {**ALL, "namespace": IDLE_TENANT})
    assert {s.labels["phase"]: s.value for s in idle} == {p.value: 0.0 for p in Phase}
    # the run: a whole step count, at least the 3 steps the stack waited for
    [[step]] = ask(prom, "Step progress")
    assert step.value >= 3 and step.value.is_integer()
    # exp(|logp_train - logp_gen|) is at least 1; a response has 1 to max_new_tokens tokens
    # beside it the run's SLO (its recipe's defaults): the median over the window, its bound and
    # the tail bound; and how many steps of the window were above that bound (none: a healthy run)
    [[mismatch], [bound], [median], [tail_bound]] = ask(prom, "Token multiplicative probability error")
    assert mismatch.value >= 1.0 and median.value >= 1.0
    assert (bound.value, tail_bound.value) == (1.1, 1.1)
    [[tail_steps]] = ask(prom, "Mismatch SLO: steps above the tail bound")
    assert tail_steps.value == 0.0
    [[length]] = ask(prom, "Mean response length")
    assert 1.0 <= length.value <= MAX_NEW_TOKENS
    [by_phase] = ask(prom, "Step time by phase")
    assert sorted(s.labels["phase"] for s in by_phase) == sorted(PHASES)
    # the per-layer attribution of the run (every step: RUN_SPEC), one row per decoder layer
    [layers] = ask(prom, "Mismatch by decoder layer")
    assert sorted(s.labels["layer"] for s in layers) == [str(i) for i in range(TINY_MODEL["num_layers"])]
    [[kv_cache], [weights]] = ask(prom, "Generator memory: KV cache and weights")
    assert kv_cache.value > 0 and weights.value > 0


# --- the check itself fails when it should --------------------------------------------------------

MISMATCH_PANEL = "Token multiplicative probability error"


def with_target(dashboard: dict[str, Any], title: str, change: dict[str, str]) -> dict[str, Any]:
    changed = copy.deepcopy(dashboard)
    [panel] = [p for p in panels(changed) if p["title"] == title]
    panel["targets"][0].update(change)
    return changed


@pytest.mark.slow
@pytest.mark.parametrize(
    ("title", "change", "reason"),
    [
        (MISMATCH_PANEL, {"expr": f"fp8rl_not_a_metric{{{FILTER}}}"}, "no data"),
        (MISMATCH_PANEL, {"expr": f"{MISMATCH}_total{{{FILTER}}}"}, "no data"),  # a real name, wrong suffix
        (MISMATCH_PANEL, {"expr": f'{MISMATCH}{{tenant="a", {FILTER}}}'}, "no data"),  # a label it lacks
        # the control plane's metric has no job of its own: nothing for job "dash"
        (MISMATCH_PANEL, {"expr": 'fp8rl_jobs{namespace=~"$namespace", job=~"$job"}'}, "no data"),
        (MISMATCH_PANEL, {"expr": "sum(rate(fp8rl_step[5m])"}, "parse error"),
        (MISMATCH_PANEL, {"expr": "vector(1)"}, "$namespace matching nothing leaves"),
        (
            MISMATCH_PANEL,
            {"expr": f'{MISMATCH}{{namespace=~"$namespace", recipe=~"$recipe"}}'},
            "$job matching",
        ),
        (MISMATCH_PANEL, {"expr": f'{MISMATCH}{{namespace=~"$namespace", job=~"$jobs"}}'}, "uses $jobs"),
        (MISMATCH_PANEL, {"legendFormat": "{{namespace}}/{{tenant}}"}, "legend names ['tenant']"),
        # a ratio panel showing tokens/s
        (
            "IS weights out of bounds",
            {"expr": f"fp8rl_train_tokens_per_second{{{FILTER}}}"},
            "outside [0.0, 1.0]",
        ),
        ("Step progress", {"expr": f"-fp8rl_step{{{FILTER}}}"}, "outside [0.0, inf]"),
    ],
)
def test_the_check_catches_a_bad_target(
    prom: Prometheus, title: str, change: dict[str, str], reason: str
) -> None:
    problems = dashboard_problems(prom, with_target(load(), title, change))
    assert problems and all(p.startswith(title) for p in problems), problems
    assert any(reason in p for p in problems), problems


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "query", "reason"),
    [
        ("job", "label_values(fp8rl_step, tenant)", "gives no values"),
        ("job", "label_values(fp8rl_step, job)", "$namespace matching nothing leaves values"),
        ("recipe", 'label_values(fp8rl_step{namespace=~"$namespace"}, recipe)', "$job matching nothing"),
        ("recipe", "fp8rl_step", "is not label_values"),
    ],
)
def test_the_check_catches_a_bad_variable(prom: Prometheus, name: str, query: str, reason: str) -> None:
    d = copy.deepcopy(load())
    variable = variables(d)[name]
    if isinstance(variable["query"], dict):
        variable["query"]["query"] = query
    else:
        variable["query"] = query
    problems = dashboard_problems(prom, d)
    assert problems and all(p.startswith(f"variable {name}") for p in problems), problems
    assert any(reason in p for p in problems), problems
