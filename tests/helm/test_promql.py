"""The PromQL reader on hand-written expressions, each answer worked out by hand."""

from __future__ import annotations

import pytest

from tests.helm.promql import PromQLError, selectors, tokenize

NS = '=~"$namespace"'


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        # a bare metric, with and without matchers
        ("up", [("up", {})]),
        ('fp8rl_step{job="a"}', [("fp8rl_step", {"job": '="a"'})]),
        (
            'x{a="1", b!="2", c=~"3.*", d!~"4|5",}',  # all four operators, trailing comma
            [("x", {"a": '="1"', "b": '!="2"', "c": '=~"3.*"', "d": '!~"4|5"'})],
        ),
        ("x{a='single', b=`raw\\d`}", [("x", {"a": "='single'", "b": "=`raw\\d`"})]),
        ('x{a="q\\"uote,}"}', [("x", {"a": '="q\\"uote,}"'})]),  # escaped quote, brace in a string
        ("recording:rule_name:rate5m", [("recording:rule_name:rate5m", {})]),
        # functions are not metrics, however deeply nested
        (
            'sum by (phase) (rate(x_total{a="b"}[5m]))',
            [("x_total", {"a": '="b"'})],
        ),
        ("sum(rate(x_total[5m])) by (phase)", [("x_total", {})]),
        ("SUM WITHOUT (instance) (x)", [("x", {})]),  # keywords are case-insensitive
        ("abs(ceil(clamp_min(delta(g[1h]), 0)))", [("g", {})]),
        ("topk(3, x)", [("x", {})]),
        ('count_values("value", x)', [("x", {})]),
        ('label_replace(x, "dst", "$1", "src", "(.*)")', [("x", {})]),
        ("time() - vector(1) + scalar(y)", [("y", {})]),
        (
            'histogram_quantile(0.99, sum by (le, job) (rate(http_seconds_bucket{code=~"2.."}[5m])))',
            [("http_seconds_bucket", {"code": '=~"2.."'})],
        ),
        # binary operators, vector matching, modifiers
        (
            'a{j="1"} / on(job, instance) group_left(version) b',
            [("a", {"j": '="1"'}), ("b", {})],
        ),
        ("a * ignoring(phase) group_right b", [("a", {}), ("b", {})]),
        ("a and b or c unless d", [("a", {}), ("b", {}), ("c", {}), ("d", {})]),
        ("a atan2 b", [("a", {}), ("b", {})]),
        ("x offset 1h", [("x", {})]),
        ("rate(x[5m] offset -1d)", [("x", {})]),
        ("x @ 1609746000 offset 1h30m", [("x", {})]),
        ("x @ start()", [("x", {})]),
        ("max_over_time(rate(x[5m])[1h:1m])", [("x", {})]),  # subquery
        ("avg_over_time(x[1h:])", [("x", {})]),
        # comparisons and numbers of every shape
        ("x > 1.05", [("x", {})]),
        ("x > bool 1", [("x", {})]),
        ("x >= 1e-3 and y < 2.5E+6", [("x", {}), ("y", {})]),
        ("x == 0x1F or y != .5", [("x", {}), ("y", {})]),
        ("x < Inf and y > -inf and z != NaN", [("x", {}), ("y", {}), ("z", {})]),
        ("-x + 2 ^ 3 % 4", [("x", {})]),
        ("1.05", []),
        ('"just a string"', []),
        ("", []),
        # Grafana variables, outside and inside strings and ranges
        (f"x{{namespace{NS}}}", [("x", {"namespace": NS})]),
        ('rate(x{job=~"${job}"}[$__rate_interval])', [("x", {"job": '=~"${job}"'})]),
        ('x{job=~"${job:regex}"}[${__range}]', [("x", {"job": '=~"${job:regex}"'})]),
        ("topk($top, x)", [("x", {})]),
        ("rate(x[[[interval]]])", [("x", {})]),
        # comments
        ("x # the metric y{a='b'} is only mentioned\n + z", [("x", {}), ("z", {})]),
        # selectors without a leading name
        ('{__name__="fp8rl_step", job="a"}', [("fp8rl_step", {"__name__": '="fp8rl_step"', "job": '="a"'})]),
        ('{__name__=~"fp8rl_.*"}', [("", {"__name__": '=~"fp8rl_.*"'})]),
        ('{"my.dotted.metric", a="b"}', [("my.dotted.metric", {"a": '="b"'})]),
        ('x{"dotted.label"="v"}', [("x", {"dotted.label": '="v"'})]),
        # one label matched twice
        ('x{a!="1", a!="2"}', [("x", {"a": '!="1",!="2"'})]),
        # Grafana variable queries
        ("label_values(fp8rl_step, namespace)", [("fp8rl_step", {"namespace": '!=""'})]),
        (
            f"label_values(fp8rl_step{{namespace{NS}}}, job)",
            [("fp8rl_step", {"namespace": NS, "job": '!=""'})],
        ),
        ('label_values(x{job="a"}, job)', [("x", {"job": '="a"'})]),  # the matcher already there wins
        ("label_values(job)", [("", {"job": '!=""'})]),
        ("query_result(topk(5, x))", [("x", {})]),
    ],
)
def test_selectors(expr: str, expected: list[tuple[str, dict[str, str]]]) -> None:
    assert selectors(expr) == expected


def test_order_and_repeats_are_kept() -> None:
    expr = 'b{x="1"} / a + b{x="2"}'
    assert selectors(expr) == [("b", {"x": '="1"'}), ("a", {}), ("b", {"x": '="2"'})]


def test_grouping_labels_are_not_selectors() -> None:
    # `phase`, `le` and `job` here are label names; a reader that took them for metrics would fail
    expr = "sum by (phase, le) (x) / on (job) group_left (phase) sum without (le) (y)"
    assert [name for name, _ in selectors(expr)] == ["x", "y"]


def test_durations_and_numbers_are_one_token() -> None:
    assert [t.text for t in tokenize("x[1h30m] offset 5m > 1.5e-3")] == [
        "x",
        "[",
        "1h30m",
        "]",
        "offset",
        "5m",
        ">",
        "1.5e-3",
    ]
    assert [t.kind for t in tokenize('a =~ "b" # c')] == ["ident", "op", "string"]


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("sum(rate(x[5m])", "unclosed '\\('"),
        ("x[5m))", "unbalanced '\\)'"),
        ('x{a="b")', "unbalanced '\\)'"),
        ('x{a="b}', "unterminated string"),
        ("x{a=b}", "quoted value"),
        ("x{a}", "without a matcher"),
        ('x{a=="b"}', "quoted value"),
        ('x{a="b" c="d"}', "expected ','"),
        ('x{,a="b"}', "expected a label name"),
        ("{}", "empty selector"),
        ("fp8rl_$metric", "glued to a Grafana variable"),
        ("x ; y", "unexpected ';'"),
        ("x > 1.2.3", "malformed number"),
        ("rate(x[5mm])", "malformed number"),
        ("sum by x", "without a label list"),
        ("label_values(x, job, extra)", "label_values takes"),
        ('label_values(x, "job")', "label_values takes"),
        ("label_values(a + b, job)", "exactly one metric selector"),
        ('x{__name__="y"}', "metric named twice"),
    ],
)
def test_malformed_expressions_are_refused(expr: str, message: str) -> None:
    with pytest.raises(PromQLError, match=message):
        selectors(expr)
